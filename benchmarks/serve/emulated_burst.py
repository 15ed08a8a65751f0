"""The API server's own cost on a burst, on any machine: `testbed serve --emulate` (the engine's steps take the
profiled H100 time, no model runs) under the serving benchmark's burst (500 random requests of 512 tokens, 128
out, sent at once and streamed), alternating this checkout's server with another checkout's (--against ROOT) and
with the offline engine (`LLM`) on the same emulated engine and the same requests (benchmarks/serve/offline.py
--emulate): served / offline output tok/s is the CPU proxy of the GPU's API-overhead ratio (target 90%).

    python benchmarks/serve/emulated_burst.py [--against ROOT] [--rounds 3] [--with-tokenizer] [--out FILE]

By default the server loads no tokenizer (--skip-tokenizer-init), as the GPU run's dummy-weight preset has none:
every token is then an SSE event of its own. --with-tokenizer serves with the bundled SmolLM2 tokenizer (text is
detokenized; a stream that fell behind gets its tokens merged into one event); the offline leg has no tokenizer
either way.

Per run (a fresh server each; one warm-up pass of the burst, then the measured one): output tok/s and makespan as
the client sees them, and from the server's step log what the engine did: `head` from the first request's
send to the engine's first step, `tail` from its last step's end to the last response's arrival at the client,
`engine` the steps' summed time, and `server_cpu_s` / `client_cpu_s` the API server's / the client's CPU time
in the measured pass. On a GPU the engine's steps match the offline engine's pace (RESULTS, "Serving"), so head
and tail are the served path's loss; here the client, the API server and the engine share the machine's cores,
so compare runs of one call, pair by pair (the CPU times are the least disturbed by other processes).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE / "benchmarks"))
from server_proc import free_port, wait_healthy  # noqa: E402
BURST = ["--dataset", "random", "--num-prompts", "500", "--random-input-len", "512", "--random-output-len", "128"]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, s) process `pid` has used so far (Linux /proc; NaN elsewhere): the API server's own
    work, less sensitive than wall time to other processes sharing the cores."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU time (user + system, s) of this process's ended children (the benchmark client's runs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def no_tokenizer_flags(root: Path, work: Path) -> list[str]:
    """`testbed serve` flags for no tokenizer: --skip-tokenizer-init, or, for a checkout older than that flag, a
    tokenizer folder with no tokenizer in it (the server then warns and serves token ids, the same state)."""
    if "--skip-tokenizer-init" in (root / "testbed" / "server" / "serve.py").read_text():
        return ["--skip-tokenizer-init"]
    (work / "no-tokenizer").mkdir(exist_ok=True)
    return ["--tokenizer", str(work / "no-tokenizer")]


def one_run(root: Path, work: Path, with_tokenizer: bool) -> dict:
    """A fresh emulated server from checkout `root`, the burst twice (warm-up, measured) by this checkout's client."""
    import pandas as pd
    port, steps = free_port(), work / "steps"
    env = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen([sys.executable, "-m", "testbed.cli", "serve", "Llama-3.2-1B", "--emulate", "--gpu",
                               "H100-SXM", "--max-model-len", "4096", "--async-scheduling", "--host", "127.0.0.1",
                               "--port", str(port), "--log-steps", str(steps), "--disable-uvicorn-access-log",
                               *([] if with_tokenizer else no_tokenizer_flags(root, work))], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(server, port, 120, f"the server of {root}")
        client = [sys.executable, "-m", "testbed.cli", "bench", "serve", "--url", f"http://127.0.0.1:{port}", *BURST,
                  "--disable-tqdm"]
        cenv = {**os.environ, "PYTHONPATH": str(HERE)}
        subprocess.run([*client, "--seed", "1", "-o", str(work / "warm")], check=True, cwd=HERE, env=cenv,
                       stdout=subprocess.DEVNULL)
        cpu, client_cpu = cpu_seconds(server.pid), children_cpu_seconds()
        subprocess.run([*client, "--seed", "0", "--server-log-steps", str(steps), "-o", str(work / "run")],
                       check=True, cwd=HERE, env=cenv, stdout=subprocess.DEVNULL)
        cpu, client_cpu = cpu_seconds(server.pid) - cpu, children_cpu_seconds() - client_cpu
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    summary = json.loads((work / "run" / "summary.json").read_text())
    st = pd.read_parquet(work / "run" / "steps.parquet")
    rq = pd.read_parquet(work / "run" / "requests.parquet")
    return {"output_tok_s": summary["output_throughput"], "makespan_s": summary["makespan_s"],
            "head_s": float(st.start.min() - rq.arrival.min()),
            "tail_s": float(rq.finish.max() - (st.start + st.duration).max()),
            "engine_s": float(st.duration.sum()), "ttft_p50_s": summary["ttft_s"]["p50"], "server_cpu_s": cpu,
            "client_cpu_s": client_cpu}


def offline_run() -> float:
    """This checkout's offline engine on the same emulated engine and requests: the measured pass's output tok/s."""
    out = subprocess.run([sys.executable, str(HERE / "benchmarks" / "serve" / "offline.py"), "500", "512", "128",
                          "--async-scheduling", "--emulate", "H100-SXM"], cwd=HERE,
                         env={**os.environ, "PYTHONPATH": str(HERE)}, check=True, capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("OFFLINE (measured)"))
    return float(re.search(r"([0-9.]+) tok/s", line).group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, default=None, help="another checkout's root (its server alternates)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--with-tokenizer", action="store_true",
                    help="serve with the bundled SmolLM2 tokenizer (default: none, as the GPU run)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sides = {"this": HERE} | ({"other": a.against.resolve()} if a.against else {})
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    offline: list[float] = []
    for r in range(a.rounds):
        for name, root in sides.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(one_run(root, Path(tmp), a.with_tokenizer))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[name][-1].items()), flush=True)
        offline.append(offline_run())
        print(f"round {r + 1} offline: output_tok_s {offline[-1]:.1f}", flush=True)
    result = {"runs": runs, "offline_output_tok_s": offline,
              "median": {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in runs.items()},
              "with_tokenizer": a.with_tokenizer}
    # each round's served runs over that round's offline run (the same call, one after the other)
    result["served_over_offline"] = {n: [x["output_tok_s"] / o for x, o in zip(rs, offline)] for n, rs in runs.items()}
    if a.against:
        result["paired_throughput_ratio"] = [t["output_tok_s"] / o["output_tok_s"]
                                             for t, o in zip(runs["this"], runs["other"])]
        result["against"] = str(a.against)
    print(json.dumps(result["median"], indent=1))
    print(f"offline output tok/s: {[round(x) for x in offline]}")
    for n, ratios in result["served_over_offline"].items():
        print(f"{n}: served / offline output tok/s, round by round: {[round(x, 3) for x in ratios]}")
    if "paired_throughput_ratio" in result:
        print("this / other output tok/s, pair by pair:", [round(x, 3) for x in result["paired_throughput_ratio"]])
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
