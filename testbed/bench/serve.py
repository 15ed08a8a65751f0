"""`testbed bench serve --url URL TRACE | --dataset random|sharegpt`: replay requests against an
OpenAI-compatible server with streaming, time them client-side (client.py), print the result
block and write a run directory (mode "real").

requests.parquet comes from the client's timings (arrival = send time after the start); when the
server was started with `--log-steps DIR` and `--server-log-steps DIR` is given here (same host,
same clock), steps.parquet holds the server's steps inside the run window and each request gets
its server-side first_scheduled time, preemption count and replica (data parallelism: every
replica logs its own steps.R.jsonl / requests.R.jsonl there). Prefix-cache and preemption totals come
from the server's /metrics before and after the run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy imports wait until a benchmark runs, so building the CLI stays fast
    from testbed.engine.metrics import Recorder
    from testbed.bench.client import RequestResult
    from testbed.bench.datasets import BenchRequest


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with its `serve` subcommand) on the CLI's subparsers."""
    from testbed.cli_args import RawDescriptionDefaultsHelpFormatter
    p = subparsers.add_parser("bench", help="benchmark a running server")
    sub = p.add_subparsers(dest="bench_command", required=True, help="what to benchmark")
    s = sub.add_parser("serve", help="replay a trace or dataset against `testbed serve` (or any OpenAI server)",
                       description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    s.add_argument("trace", nargs="?", default=None, help="trace file (project JSONL, Azure CSV, Mooncake, lengths)")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    s.add_argument("--endpoint", default="/v1/completions", help="completions path (default: %(default)s)")
    s.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    s.add_argument("--api-key", default=os.environ.get("TESTBED_API_KEY") or os.environ.get("OPENAI_API_KEY"), help="sent as a bearer token (default: $TESTBED_API_KEY or $OPENAI_API_KEY)")
    s.add_argument("--dataset", choices=("random", "sharegpt"), default=None, help="instead of a TRACE")
    s.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset sharegpt")
    s.add_argument("--trace-format", default="auto", choices=("auto", "jsonl", "azure", "mooncake", "lengths"), help="trace file format (auto: from its first line)")
    s.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: 1000 for datasets, the whole trace)")
    s.add_argument("--request-rate", type=float, default=None,
                   help="req/s of a gamma arrival process (default: the trace's own arrivals; inf for datasets)")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    s.add_argument("--random-input-len", type=int, default=1024, help="--dataset random: prompt tokens")
    s.add_argument("--random-output-len", type=int, default=128, help="--dataset random: output tokens")
    s.add_argument("--random-range-ratio", type=float, default=0.0, help="--dataset random: lengths vary by this fraction")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested output lengths (default: on)")
    s.add_argument("--seed", type=int, default=0, help="seed of the dataset and arrivals")
    s.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds, for goodput")
    s.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds, for goodput")
    s.add_argument("--server-log-steps", default=None, metavar="DIR", help="the server's --log-steps DIR")
    s.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request timeout, seconds")
    s.add_argument("--output", "-o", default=None, help="run directory (default: runs/<date>-real-<trace>-<model>)")
    s.add_argument("--format", choices=("table", "json"), default="table", help="summary on stdout")
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_bench_serve)
    return p


def _get_json(url: str, api_key: str | None) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach the server at {url}: {e} (is `testbed serve` running? check --url)") from None
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def scrape_counters(base: str) -> dict[str, float]:
    """Totals of the server's counters over every engine, by name without the prefix (`vllm:` by default,
    `testbed:` under --metrics-prefix testbed; a vLLM server's too); empty when /metrics is unavailable."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                prefix, _, name = sample.name.partition(":")
                if prefix in ("vllm", "testbed") and name.endswith("_total"):
                    out[name] = out.get(name, 0.0) + sample.value
        return out
    except (httpx.HTTPError, ValueError):
        return {}


def _read_jsonl(path: Path) -> list[list]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line the server was still writing
    return rows


def build_records(results: list[RequestResult], requests: list[BenchRequest], t0_wall: float, t_end_wall: float,
                  log_dir: str | None) -> Recorder:
    """Client timings as REQUEST_COLUMNS rows (times relative to the start); server steps when logged."""
    from testbed.engine.metrics import Recorder, logged_step_extra, shifted_step_row
    rec = Recorder()
    server_reqs: dict[str, list] = {}
    if log_dir is not None:
        d = Path(log_dir)
        if not d.is_dir():
            raise ValueError(f"--server-log-steps {log_dir}: no such directory (start the server with --log-steps)")
        for path in sorted(d.glob("steps*.jsonl")):  # steps.jsonl, or steps.R.jsonl per data-parallel replica
            for row in _read_jsonl(path):
                if t0_wall <= row[1] <= t_end_wall:
                    rec.step_extra = logged_step_extra(row)  # an async server's rows: their schedule times too
                    rec.steps.append(shifted_step_row(row, t0_wall))
        server_reqs = {row[0]: row for path in sorted(d.glob("requests*.jsonl")) for row in _read_jsonl(path)}
    for i, (res, req) in enumerate(zip(results, requests)):
        srv = server_reqs.get(f"{res.server_id}-0") if res.server_id else None
        first_sched = srv[4] - t0_wall if srv is not None and srv[4] is not None else None
        first = res.send_s + res.ttft if res.ttft is not None else None
        rec.requests.append((res.server_id or req.id, srv[1] if srv is not None else 0, 0, res.send_s, first_sched,
                             first, res.send_s + res.latency,
                             res.prompt_tokens if res.prompt_tokens is not None else req.input_tokens,
                             res.output_tokens, res.cached_tokens, srv[10] if srv is not None else 0,
                             res.finish_reason, i))
        rec.itl.extend(res.itl)
    return rec


def run_bench(args: argparse.Namespace) -> tuple[Path | None, dict]:
    import httpx

    from testbed.engine.metrics import summarize
    from testbed.server import run_event_loop
    from testbed.bench.client import replay
    from testbed.bench.datasets import from_trace, random_dataset, sharegpt_dataset
    base = args.url.rstrip("/")
    if (args.trace is None) == (args.dataset is None):
        raise ValueError("give either a TRACE file or --dataset random|sharegpt (not both)")
    info = _get_json(f"{base}/v1/models", args.api_key)["data"][0]
    model = args.model or info["id"]
    max_model_len = int(info.get("max_model_len") or 1 << 30)
    vocab = info.get("vocab_size")
    if vocab is None and args.dataset != "sharegpt":
        raise ValueError(f"the server at {base} does not report vocab_size in /v1/models; token-id prompts need it")
    n = args.num_prompts
    rate = args.request_rate
    clipped = 0
    if args.trace is not None:
        requests, clipped = from_trace(args.trace, vocab_size=vocab, max_model_len=max_model_len, request_rate=rate,
                                       burstiness=args.burstiness, seed=args.seed, limit=n, fmt=args.trace_format)
    elif args.dataset == "random":
        requests = random_dataset(n or 1000, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                  vocab_size=vocab, max_model_len=max_model_len, request_rate=rate or math.inf,
                                  burstiness=args.burstiness, seed=args.seed)
    else:
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE (a ShareGPT conversation JSON)")
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}) as h:
            def count(text: str) -> int:
                r = h.post(f"{base}/tokenize", json={"model": model, "prompt": text})
                r.raise_for_status()
                return r.json()["count"]
            requests = sharegpt_dataset(args.dataset_path, n or 1000, tokenize=count, max_model_len=max_model_len,
                                        request_rate=rate or math.inf, burstiness=args.burstiness, seed=args.seed)
    if clipped:
        print(f"testbed bench serve: {clipped} trace requests clipped to max_model_len {max_model_len}", file=sys.stderr)

    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="requests", file=sys.stderr, leave=False)
    before = scrape_counters(base)
    results, duration, t0_wall = run_event_loop(replay(
        base + args.endpoint, model, requests, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        api_key=args.api_key, timeout=args.timeout, on_done=(lambda _: bar.update(1)) if bar else None))
    t_end_wall = time.time()
    if bar is not None:
        bar.close()
    time.sleep(0.2 if args.server_log_steps else 0.0)  # the engine flushes its log after each step
    after = scrape_counters(base)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    rec = build_records(results, requests, t0_wall, t_end_wall, args.server_log_steps)
    summary = summarize(rec.request_columns(), rec.step_columns(), rec.itl, args.slo_ttft, args.slo_tpot,
                        int(delta.get("prefix_cache_queries_total", 0)),
                        int(delta.get("prefix_cache_hits_total", 0)))
    if not rec.steps:
        summary["num_preemptions"] = int(delta.get("num_preemptions_total", 0))
    errors = [r.error for r in results if r.error]
    summary.update(duration_s=duration, num_failed=sum(r.finish_reason == "error" for r in results),
                   first_error=errors[0] if errors else None)
    from testbed.cli_args import default_run_dir
    from testbed.runs.rundir import environment_info, write_run
    out = args.output or default_run_dir("real", args.trace or args.dataset, model)
    manifest = {
        "mode": "real", "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "server": {"url": base, "model": info}, "model": model,
        "trace": {"path": args.trace, "dataset": args.dataset, "dataset_path": args.dataset_path,
                  "format": args.trace_format, "num_requests": len(requests), "request_rate": rate,
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "clipped": clipped},
        "hardware": None, "emulated": info.get("emulated"), "seed": args.seed, "wall_time_s": duration, "step_log": args.server_log_steps,
        **environment_info(),
    }
    return write_run(out, manifest, rec, summary)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from testbed.cli_args import print_result
    run_dir, summary = run_bench(args)
    print_result(summary, run_dir, args.format, "Serving Benchmark Result")
    return 0 if summary["num_finished"] else 1
