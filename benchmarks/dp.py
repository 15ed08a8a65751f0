"""Data parallelism on one host, real and simulated: R replicas per GPU against one.

  # one H200, Llama-3.2-1B with dummy weights: 256 s with model loads (2026-11-24)
  python benchmarks/dp.py --gpus 1 --model Llama-3.2-1B --load-format dummy --out OUT
  # CPU smoke run (short requests, a few seconds of arrivals)
  python benchmarks/dp.py --device cpu --model SmolLM2-135M --load-format dummy --trace SHORT.jsonl \\
      --rates 2 4 --num-prompts 12 --warmup 4 --engine-args "--max-model-len 512 --num-gpu-blocks 256" --out OUT
  # no GPU: simulate an earlier benchmark's real runs again, e.g. with another profile
  python benchmarks/dp.py --resimulate OUT --cost-model PROFILE.json --out OUT2

Layouts: `--gpus` G GPUs with 1 replica each (--gpu-memory-utilization 0.9, the baseline; G = 1
is a single engine) and with `--replicas-per-gpu` R each (0.9 / R: R replicas share a GPU, each
sizing its KV cache from its share). For each layout and each `--rates` value the trace's first
`--num-prompts` requests, re-timed at that rate, run through the real engine, one run directory
each. A single engine is built once, warmed up by a discarded replay (kernels compiled, caches
filled for every later process) and replays every rate in one child process; a data-parallel
layout runs `testbed replay -dp N` per rate (the DP coordinator and its replica processes).

Then `testbed simulate` runs the same requests on the same KV-cache size twice per run: predicted
with `--cost-model` (default `auto`: the shipped profile of the model and GPU, as `testbed simulate`
picks it; `profile`: measure a new one with `testbed profile` first, one replica owning the GPU; or
`roofline` or a profile JSON), and replayed from the run's own recorded timings (decision parity:
every routing and batch must match). The simulator does not model replicas contending for one GPU:
the prediction error of the shared layout measures what that leaves out.

Everything goes under OUT: the run directories and logs (OUT/runs/), a new profile if measured,
OUT/dp_results.json (rewritten after every step, so a cut-short run keeps what it did) and
OUT/dp_tables.md, the markdown tables also printed at the end: throughput and TTFT/TPOT percentiles,
real vs predicted and the relative error; decision parity; the DP stack's measured routing hop,
stats-report transit and arrival -> admission at an idle replica (`--dp-routing-delay measured` simulates with
its median over the benchmark's DP runs; by default the simulator's own delay). Every run has a time limit, and
no real run starts once `--budget-s` has passed (those left are marked skipped).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's testbed, as the `python -m testbed.cli` subprocesses (cwd ROOT) use
TRACE = ROOT / "traces" / "azure_conv_10min.jsonl"
METRICS = [("output_throughput", None), ("request_throughput", None), ("ttft_s", "mean"), ("ttft_s", "p50"),
           ("ttft_s", "p90"), ("ttft_s", "p99"), ("tpot_s", "mean"), ("tpot_s", "p50"), ("tpot_s", "p90"),
           ("tpot_s", "p99"), ("e2e_s", "mean"), ("e2e_s", "p50"), ("e2e_s", "p99")]


def testbed(args: list[str], timeout: float, log: Path) -> dict:
    """Run a `testbed` command with --format json; its summary (RuntimeError with the log's tail on failure)."""
    cmd = [sys.executable, "-m", "testbed.cli", *args, "--format", "json"]
    with open(log, "w") as err:
        try:
            out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:g} s: {shlex.join(cmd)} (log: {log})") from None
    if out.returncode != 0:
        raise RuntimeError(f"exit code {out.returncode}: {shlex.join(cmd)}\n{log.read_text()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def replay_on_one_engine(flags: list[str], trace: str, jobs: list[tuple[float, int, str]], log: str) -> None:
    """Child process: build one engine from `testbed replay` flags and replay (rate, limit, run dir) jobs on it
    in order, the loaded model reused; its output goes to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from testbed.cli_args import add_engine_args, add_model_args, engine_config
    from testbed.entrypoints.replay import run_replay
    from testbed.worker.executor import create_executor
    p = argparse.ArgumentParser()
    add_engine_args(p, None)
    add_model_args(p)
    a = p.parse_args(flags)
    cfg = engine_config(a)
    t0 = time.perf_counter()
    executor = create_executor(a.model, cfg, a.load_format, a.dtype, a.device)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s: {executor.num_gpu_blocks} KV blocks", flush=True)
    try:
        for rate, limit, out in jobs:
            t = time.perf_counter()
            _, s = run_replay(trace, cfg, model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device,
                              request_rate=rate, limit=limit, output=out, executor=executor)
            print(f"{out}: {s['num_finished']} finished in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        executor.shutdown()


RUN_FLAGS = {"model": str, "load_format": str, "sim_model": str, "tp": int, "policy": str, "engine_args": str,
             "num_prompts": int, "trace": str, "gpus": int, "replicas_per_gpu": int, "utilization": float}


def take_run_flags(args: argparse.Namespace, earlier: Path) -> list[dict]:
    """--resimulate: the flags that shaped an earlier benchmark's real runs replace this call's, so the simulations
    see the same requests and engine flags; a trace recorded at another path is this checkout's of that name.
    Returns the earlier benchmark's run entries."""
    path = earlier / "dp_results.json"
    if not path.is_file():
        raise SystemExit(f"--resimulate {earlier}: no dp_results.json there; give the --out of an earlier dp.py run")
    recorded = json.loads(path.read_text())
    for k, conv in RUN_FLAGS.items():
        v = recorded["args"][k]
        setattr(args, k, None if v == "None" else conv(v))
    if not Path(args.trace).is_file():
        args.trace = str(ROOT / "traces" / Path(args.trace).name)
    return recorded["runs"]


def earlier_runs(earlier: Path, entries: list[dict]) -> list[dict]:
    """--resimulate: the finished real runs among an earlier benchmark's `entries`, read again from their run
    directories under `earlier`/runs (wherever they were written)."""
    from testbed.runs.rundir import read_run
    return [{k: r[k] for k in ("layout", "dp", "utilization", "rate")}
            | real_entry(read_run(earlier / "runs" / Path(r["real_dir"]).name)) for r in entries if "real" in r]


def run_in_child(target, args: tuple, timeout: float) -> None:
    """target(*args) in a spawned process (its GPU memory is freed when it exits); RuntimeError on failure."""
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise RuntimeError(f"timed out after {timeout:g} s (log: {args[-1]})")
    if proc.exitcode != 0:
        raise RuntimeError(f"exit code {proc.exitcode} (log: {args[-1]}):\n{Path(args[-1]).read_text()[-3000:]}")


def value(summary: dict, key: str, q: str | None) -> float | None:
    v = summary[key] if q is None else summary[key][q]
    return None if v is None else float(v)


def relative_error(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


def real_entry(run) -> dict:
    """A real run's part of its benchmark entry: where it is, its summary, DP timings, capacity and manifest."""
    return {"real_dir": str(run.path), "real": run.summary, "dp_timings": dp_timings(run), "capacity": capacity(run),
            "manifest": run.manifest}


def capacity(run) -> dict | None:
    """The run's throughput while saturated: output tokens emitted (decode tokens of the steps that ended, first
    tokens) from the first step until the first replica's waiting queue emptied for good, over that window. A
    finite trace ends with a drain (the last requests decode at ever smaller batches) that takes about as long
    whatever the layout, so the whole run's throughput understates what more replicas sustain; this is what the
    layout sustains while it has work queued. It includes the ramp (batches filling as requests arrive), and the
    window covers another part of the trace in each layout (a shorter, earlier one with more replicas), so it
    compares layouts fairly only when the window is long beside the ramp. None when no replica ever had a
    request waiting."""
    steps = run.steps(["replica", "start", "duration", "num_decode_tokens", "num_waiting"])
    ends = [g["start"].to_numpy()[np.nonzero(g["num_waiting"].to_numpy() > 0)[0][-1]]
            for _, g in steps.sort_values("start").groupby("replica") if (g["num_waiting"] > 0).any()]
    if len(ends) < steps["replica"].nunique():
        return None
    t0, t1 = float(steps["start"].min()), float(min(ends))
    done = steps[steps["start"] + steps["duration"] <= t1]
    first = run.requests(["first_token"])["first_token"]
    tokens = int(done["num_decode_tokens"].sum() + (first <= t1).sum())
    return {"saturated_s": t1 - t0, "saturated_tokens": tokens,
            "saturated_output_throughput": tokens / (t1 - t0) if t1 > t0 else None}


def idle_admissions(routes, requests) -> np.ndarray:
    """Arrival -> admission of each request routed to a replica that held no unfinished request then (none admitted
    before the routing had finished by it): the hops alone, with no step of the replica to wait for. What the
    simulator's --dp-routing-delay stands for (it models the wait for a busy replica's step itself)."""
    ends = routes.set_index("request_id")["added"].to_frame().join(requests.set_index("request_id")["finish"])
    idle = []
    for r, group in routes.dropna(subset=["added"]).groupby("replica"):
        mine = ends.loc[group["request_id"]].dropna()
        added, finish = np.sort(mine["added"].to_numpy()), np.sort(mine["finish"].to_numpy())
        t = group["routed"].to_numpy()
        live = np.searchsorted(added, t, side="right") - np.searchsorted(finish, t, side="right")
        idle.append((group["added"] - group["arrival"]).to_numpy()[live == 0])
    return np.concatenate(idle) if idle else np.empty(0)


def dp_timings(run) -> dict | None:
    """Measured latencies of the DP stack in a real run: API server -> coordinator (routing hop),
    coordinator -> admission by the replica, replica -> coordinator (stats report transit), and arrival ->
    admission at idle replicas (idle_admissions; `idle_admission_samples_s` keeps them for a pooled median)."""
    routes, pubs = run.dp_table("routes"), run.dp_table("publications")
    if routes is None or pubs is None:
        return None
    hop = (routes["routed"] - routes["sent"]).to_numpy()
    admit = (routes["added"] - routes["routed"]).dropna().to_numpy()
    transit = (pubs["received"] - pubs["sampled"]).to_numpy()
    idle = idle_admissions(routes, run.requests())

    def q(x, p):
        return float(np.percentile(x, p)) if len(x) else None
    return {"routing_hop_s": {"p50": q(hop, 50), "p99": q(hop, 99)},
            "route_to_admission_s": {"p50": q(admit, 50), "p99": q(admit, 99)},
            "report_transit_s": {"p50": q(transit, 50), "p99": q(transit, 99)},
            "idle_admission_s": {"p50": q(idle, 50), "p99": q(idle, 99), "n": len(idle)},
            "idle_admission_samples_s": idle.tolist()}


def measured_routing_delay(runs: list[dict]) -> float | None:
    """The median arrival -> admission at an idle replica over every DP run of the benchmark (this host's DP stack,
    as a profile is the GPU's), or None where no DP run admitted a request to an idle replica."""
    samples = [x for r in runs for x in (r.get("dp_timings") or {}).get("idle_admission_samples_s", [])]
    return float(np.median(samples)) if samples else None


def parse_layout(text: str) -> tuple[int, int]:
    """(GPUs, replicas per GPU) of a --layouts entry such as 2x1."""
    try:
        g, r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--layouts {text!r}: expected GxR, e.g. 2x1 (2 GPUs, 1 replica each)") from None
    if g < 1 or r < 1:
        raise SystemExit(f"--layouts {text!r}: G and R must be >= 1")
    return g, r


def visible_gpus() -> list[str]:
    """This host's GPUs in CUDA_VISIBLE_DEVICES order (empty without CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def simulator_gpu(name: str | None, real_manifest: dict) -> str:
    """The simulator's GPU preset: --gpu-name, else the GPU of the real runs (H200 for a CPU smoke run)."""
    from testbed.specs.hardware import get_gpu_spec
    if name:
        return name
    try:
        return get_gpu_spec(real_manifest["hardware"]["name"]).name
    except ValueError:
        return "H200"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to use (CUDA_VISIBLE_DEVICES order)")
    ap.add_argument("--replicas-per-gpu", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=None, metavar="GxR",
                    help="layouts to run instead of the two of --gpus/--replicas-per-gpu: G GPUs (the first G "
                         "visible) with R replicas each, e.g. 1x1 2x1 (DP=1 on one GPU against DP=2 on two)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of each replica")
    ap.add_argument("--model", default="Llama-3.2-1B", help="model folder, or a preset with --load-format dummy")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--sim-model", default=None, help="the simulator's model preset (default: --model)")
    ap.add_argument("--gpu-name", default=None,
                    help="the simulator's GPU preset (default: the GPU of the real runs; H200 on CPU)")
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--rates", type=float, nargs="+", default=[16.0, 32.0, 64.0], help="req/s")
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per run (the trace's first N)")
    ap.add_argument("--warmup", type=int, default=16, help="requests of the discarded warm-up replay")
    ap.add_argument("--policy", default="least_loaded", help="--dp-policy of the multi-replica runs")
    ap.add_argument("--utilization", type=float, default=0.9, help="--gpu-memory-utilization of one GPU in all")
    ap.add_argument("--cost-model", default="auto",
                    help="auto (the shipped profile of the model and GPU, else the roofline), profile (measure one "
                         "with `testbed profile` first), roofline or a profile JSON")
    ap.add_argument("--smoke-profile", action="store_true", help="testbed profile --smoke (a tiny sweep: a smoke test)")
    ap.add_argument("--engine-args", default="--max-model-len 4096",
                    help="more engine flags for every run, real and simulated (one string)")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds one real run may take")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no real run starts after this many seconds")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="simulations run at once")
    ap.add_argument("--dp-routing-delay", default="default", metavar="default|measured|SECONDS",
                    help="the simulations' --dp-routing-delay: 'default' (the simulator's own), 'measured' (the real DP "
                         "runs' median arrival -> admission at an idle replica, dp_timings), or seconds")
    ap.add_argument("--resimulate", type=Path, metavar="EARLIER_OUT",
                    help="no real run: simulate the real runs of an earlier benchmark's --out again (on a CPU), with "
                         "its run flags (model, trace, requests, engine flags, layouts) and this call's --cost-model "
                         "and --gpu-name")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.gpus < 1 or args.replicas_per_gpu < 2 or args.tp < 1 or args.jobs < 1:
        ap.error("--gpus, --tp and --jobs must be >= 1 and --replicas-per-gpu >= 2")
    if args.resimulate is not None:
        if args.cost_model == "profile":
            ap.error("--cost-model profile measures on the GPU; --resimulate takes auto, roofline or a profile JSON")
        earlier_entries = take_run_flags(args, args.resimulate)
    t_start = time.perf_counter()
    runs = args.out / "runs"
    if runs.exists() and any(runs.iterdir()):
        ap.error(f"--out {args.out}: holds the runs of an earlier benchmark; give a new folder")
    runs.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.engine_args)
    model = ["--model", args.model, "--load-format", args.load_format, *(["--device", args.device] if args.device else [])]
    layouts = [("1/gpu", args.gpus, args.utilization, args.gpus), (f"{args.replicas_per_gpu}/gpu",
               args.gpus * args.replicas_per_gpu, args.utilization / args.replicas_per_gpu, args.gpus)]
    if args.layouts:
        layouts = [(f"{g}x{r}", g * r, args.utilization / r, g) for g, r in (parse_layout(x) for x in args.layouts)]
    visible = visible_gpus() if args.device != "cpu" else []
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": [], "phases_s": {}}
    results_path = args.out / "dp_results.json"

    def save() -> None:
        results_path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")

    def engine(dp: int, util: float) -> list[str]:
        return ["-dp", str(dp), "-tp", str(args.tp), "--dp-policy", args.policy, "--gpu-memory-utilization",
                f"{util:.4f}", *extra]

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    # ---- real runs --------------------------------------------------------------------------------
    from testbed.runs.rundir import RunDirError, read_run
    if args.resimulate is not None:
        results["runs"] = earlier_runs(args.resimulate, earlier_entries)
    else:
        warmed = False
        for name, dp, util, gpus in layouts:
            tag = name.replace("/", "per")
            if visible:  # the layout's GPUs: the replicas (and a single engine) see only these
                if len(visible) < gpus:
                    raise SystemExit(f"layout {name} needs {gpus} GPUs; {len(visible)} visible")
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:gpus])
            t0 = time.perf_counter()
            todo = [(rate, runs / f"real-{tag}-rate{rate:g}") for rate in args.rates]
            failure = None
            try:
                if over_budget():
                    pass
                elif dp == 1:  # one engine: built once, warmed up, every rate on it
                    jobs = [] if warmed else [(max(args.rates), args.warmup, str(runs / f"warmup-{tag}"))]
                    jobs += [(r, args.num_prompts, str(d)) for r, d in todo]
                    warmed = True
                    run_in_child(replay_on_one_engine, ([*model, *engine(1, util)], args.trace, jobs,
                                                        str(runs / f"{tag}.log")), args.run_timeout * len(jobs))
                else:  # a DP stack per run (its records are complete once it stopped)
                    if not warmed:
                        testbed(["replay", args.trace, "--limit", str(args.warmup), "--request-rate", str(max(args.rates)),
                                 *model, *engine(dp, util), "-o", str(runs / f"warmup-{tag}")], args.run_timeout,
                                runs / f"warmup-{tag}.log")
                        warmed = True
                    for rate, d in todo:
                        if over_budget():
                            break
                        testbed(["replay", args.trace, "--limit", str(args.num_prompts), "--request-rate", str(rate),
                                 *model, *engine(dp, util), "-o", str(d)], args.run_timeout, d.with_suffix(".log"))
            except RuntimeError as e:  # the runs written before it stand
                failure = str(e)
                print(f"# {name}: {failure}", file=sys.stderr, flush=True)
            for rate, d in todo:
                entry = {"layout": name, "dp": dp, "utilization": util, "rate": rate, "real_dir": str(d)}
                try:
                    run = read_run(d)
                except RunDirError:
                    entry["skipped"] = failure or f"--budget-s {args.budget_s:g} spent"
                else:
                    entry |= real_entry(run)
                    print(f"# {name} rate {rate:g}: {run.summary['output_throughput']:.1f} tok/s, "
                          f"{run.summary['num_finished']} finished", file=sys.stderr, flush=True)
                results["runs"].append(entry)
            results["phases_s"][f"real {name}"] = time.perf_counter() - t0
            print(f"# {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            save()
    measured = [r for r in results["runs"] if "real" in r]
    if not measured:
        raise SystemExit(f"no real run finished within --budget-s {args.budget_s:g}" if args.resimulate is None
                         else f"--resimulate {args.resimulate}: it holds no finished real run")

    # ---- the cost model ---------------------------------------------------------------------------
    cost_model = args.cost_model
    gpu = simulator_gpu(args.gpu_name, measured[0]["manifest"])
    if cost_model == "profile":  # the step times of one replica owning the GPU, measured on it
        t0 = time.perf_counter()
        cost_model = str(args.out / "profile.json")
        cmd = [sys.executable, "-m", "testbed.cli", "profile", *model, "-tp", str(args.tp), "--gpu-memory-utilization",
               str(args.utilization), *extra, "-o", cost_model, "--no-progress", *(["--smoke"] if args.smoke_profile else [])]
        with open(args.out / "profile.log", "w") as log:
            subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.run_timeout * 4, stdout=log, stderr=subprocess.STDOUT)
        results["phases_s"]["profile"] = time.perf_counter() - t0
    results["cost_model"], results["sim_gpu"] = cost_model, gpu
    delay = {"measured": measured_routing_delay(measured), "default": None}.get(args.dp_routing_delay)
    if args.dp_routing_delay not in ("measured", "default"):
        try:
            delay = float(args.dp_routing_delay)
        except ValueError:
            ap.error(f"--dp-routing-delay {args.dp_routing_delay!r}: give 'measured', 'default' or seconds")
    results["dp_routing_delay_s"] = delay  # None: the simulator's default

    # ---- simulations of the same runs ---------------------------------------------------------------
    t0 = time.perf_counter()

    def simulate(r: dict) -> None:
        m = r["manifest"]
        sim = ["simulate", args.trace, "--limit", str(args.num_prompts), "--request-rate", str(r["rate"]),
               "--model", args.sim_model or args.model, "--gpu", gpu, *engine(r["dp"], r["utilization"]),
               "--num-gpu-blocks", str(m["num_gpu_blocks"]), "--max-model-len", str(m["max_model_len"]),
               "--no-progress", *(["--dp-routing-delay", f"{delay:.9f}"] if delay is not None and r["dp"] > 1 else [])]
        tag = Path(r["real_dir"]).name.replace("real-", "")
        r["sim_dir"] = str(runs / f"sim-{tag}")
        try:
            r["sim"] = testbed([*sim, "--cost-model", cost_model, "-o", r["sim_dir"]], args.run_timeout,
                               runs / f"sim-{tag}.log")
        except RuntimeError as e:
            r["skipped"] = f"simulation failed: {str(e)[-400:]}"
            print(f"# {r['layout']} rate {r['rate']:g}: {r['skipped']}", file=sys.stderr, flush=True)
            return
        r["sim_cost_model"] = read_run(r["sim_dir"]).manifest.get("cost_model")
        r["errors"] = {f"{k} {q}" if q else k: relative_error(value(r["sim"], k, q), value(r["real"], k, q))
                       for k, q in METRICS}
        try:  # decision parity: the run's own timings must reproduce its routing and batches
            testbed([*sim, "--cost-model", f"recorded:{r['real_dir']}", "-o", str(runs / f"recorded-{tag}")],
                    args.run_timeout, runs / f"recorded-{tag}.log")
            r["decision_parity"] = "exact"
        except RuntimeError as e:
            r["decision_parity"] = f"diverged: {str(e)[-400:]}"

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(simulate, measured))
    results["phases_s"]["simulate"] = time.perf_counter() - t0
    results["phases_s"]["total"] = time.perf_counter() - t_start
    save()
    tables = render_tables(results)
    (args.out / "dp_tables.md").write_text(tables)
    print(tables, end="")
    return 0


def fmt(v: float | None, err: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1%}" if err else f"{v:.4g}"


def _times(v: float, ref: float | None) -> str:
    return f"{v / ref:.2f}x" if ref else "-"


def render_tables(results: dict) -> str:
    cols = [("output_throughput", None), ("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99")]
    head = " | ".join(f"{k.removesuffix('_s')}{' ' + q if q else ''} real | sim | err" for k, q in cols)
    used = sorted({str(r.get("sim_cost_model") or results["cost_model"]) for r in results["runs"] if "sim" in r})
    delay = results.get("dp_routing_delay_s")
    lines = [f"cost model: {results['cost_model']} ({', '.join(used)}), simulated GPU {results['sim_gpu']}, "
             + (f"--dp-routing-delay {delay * 1e3:.3f} ms (measured: idle replicas' arrival -> admission); "
                if delay is not None else "the simulator's default --dp-routing-delay; ")
             + ", ".join(f"{k} {v:.0f} s" for k, v in results["phases_s"].items()), "",
             f"| layout | rate | {head} | parity |", "|---|---|" + "---|---|---|" * len(cols) + "---|"]
    for r in results["runs"]:
        if "sim" not in r:
            lines.append(f"| {r['layout']} | {r['rate']:g} | " + " | ".join(["-"] * 3 * len(cols))
                         + f" | {r.get('skipped', 'not simulated').splitlines()[0]} |")
            continue
        cells = " | ".join(f"{fmt(value(r['real'], k, q))} | {fmt(value(r['sim'], k, q))} | "
                           f"{fmt(r['errors'][f'{k} {q}' if q else k], err=True)}" for k, q in cols)
        lines.append(f"| {r['layout']} | {r['rate']:g} | {cells} | {r['decision_parity'].split(':')[0]} |")
    sat = [r for r in results["runs"] if (r.get("capacity") or {}).get("saturated_output_throughput")]
    if sat:
        base = {r["rate"]: r for r in results["runs"] if r.get("dp") == 1 and "real" in r}
        lines += ["", "| layout | rate | output tok/s, whole run | x DP=1 | saturated window (s) | output tok/s while "
                      "saturated | x DP=1 |", "|---|---|---|---|---|---|---|"]
        for r in sat:
            b = base.get(r["rate"])
            whole, capa = r["real"]["output_throughput"], r["capacity"]["saturated_output_throughput"]
            b_whole = b["real"]["output_throughput"] if b else None
            b_capa = ((b or {}).get("capacity") or {}).get("saturated_output_throughput")
            lines.append(f"| {r['layout']} | {r['rate']:g} | {whole:.0f} | {_times(whole, b_whole)} | "
                         f"{r['capacity']['saturated_s']:.2f} | {capa:.0f} | {_times(capa, b_capa)} |")
    timed = [r for r in results["runs"] if r.get("dp_timings")]
    if timed:
        lines += ["", "| layout | rate | routing hop p50 / p99 (ms) | route -> admission p50 / p99 (ms) | "
                      "report transit p50 / p99 (ms) | arrival -> admission at an idle replica p50 (ms, requests) |",
                  "|---|---|---|---|---|---|"]
        for r in timed:
            t = r["dp_timings"]
            idle = t.get("idle_admission_s") or {}
            lines.append(f"| {r['layout']} | {r['rate']:g} | " + " | ".join(
                f"{t[k]['p50'] * 1e3:.3f} / {t[k]['p99'] * 1e3:.3f}"
                for k in ("routing_hop_s", "route_to_admission_s", "report_transit_s"))
                + (f" | {idle['p50'] * 1e3:.3f} ({idle['n']}) |" if idle.get("n") else " | - |"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
