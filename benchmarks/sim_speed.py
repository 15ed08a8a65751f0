"""Simulator speed: `testbed simulate` as a user runs it, against BLIS on the same trace when one is given.

Usage: python benchmarks/sim_speed.py [--trace PATH] [--blis PATH/TO/blis] [--repeat 5]
                                      [--dp-requests 1000000] [--against OLD_CHECKOUT] [--json out.json]

1. Start-up: `testbed simulate` of a one-request trace, whole process, median of --repeat.
2. The trace (default: the Azure conversation hour), Llama-3.1-8B on H100-SXM, the default cost model
   (the shipped profile) and vLLM's default limits: the whole `testbed simulate` process (start-up,
   loading, simulating, summarising, writing the run directory), wall and CPU time, and steps per second.
   With --blis, BLIS (benchmarks/blis_peer.py) replays the same requests with the same limits, the two
   processes alternating A B A B; each pair gives a ratio, and the median ratio is reported.
3. --dp-requests synthetic requests (lengths drawn from the trace, Poisson arrivals at --dp-rate requests/s
   per replica) on --dp-replicas replicas, for each --dp-policy: the simulation alone, in this process.
With --against ROOT (a checkout of another commit, e.g. `git worktree add --detach ROOT <commit>`), every timed
run alternates with the same run of ROOT's code (this, ROOT, BLIS, this, ROOT, ...): whole processes with
PYTHONPATH set to each checkout, and the data-parallel case in a child process per run on each side (--repeat
pairs), so each pair gives a ratio (this / ROOT).
Every timed checkout's package is compiled to bytecode first, as Python leaves an installed copy after its first
run: a process that imports the sources without it (PYTHONDONTWRITEBYTECODE set, a fresh checkout) compiles them
again each time, 0.2 s more at start-up on 2 cores of an AMD EPYC (a one-request trace: 0.80 against 0.57 s, medians
of 10 paired whole processes, afff654, Python 3.11.7, 2026-11-27).
Wall times on a shared machine are inflated by its load; the paired ratios are what compares.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blis_peer import replay_command, write_trace  # noqa: E402

from testbed.engine.config import EngineConfig  # noqa: E402
from testbed.sim.cluster import simulate  # noqa: E402
from testbed.sim.cost_model import num_gpu_blocks  # noqa: E402
from testbed.sim.factory import load_cost_model  # noqa: E402
from testbed.specs.hardware import get_gpu_spec  # noqa: E402
from testbed.specs.presets import get_model_spec  # noqa: E402
from testbed.workload.trace import TraceRequest, gamma_arrivals, load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"


def timed(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s of the process and its children, stdout) of one run; RuntimeError if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def tree_env(root: Path) -> dict:
    """The environment of a process that runs the code of the checkout at `root`."""
    return dict(os.environ, PYTHONPATH=str(root))


def testbed_run(trace: Path, out: Path, root: Path = ROOT) -> dict:
    """One `testbed simulate` process of the checkout at `root` on `trace`: wall, CPU, and the steps and times its
    run recorded."""
    wall, cpu, stdout = timed([sys.executable, "-m", "testbed.cli", "simulate", str(trace), "-o", str(out),
                               "--no-progress", "--format", "json"], env=tree_env(root))
    summary, manifest = json.loads(stdout), json.loads((out / "manifest.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "steps": summary["num_steps"], "simulated_s": manifest["simulated_time_s"],
            "simulate_s": manifest["wall_time_s"], "finished": summary["num_finished"]}


def against_side(runs: list[dict], old: list[dict], keys: tuple[str, ...]) -> dict:
    """The other checkout's runs: their medians, and this / other per pair, for each of `keys`."""
    return {**{k: statistics.median(r[k] for r in old) for k in keys}, "runs": old,
            **{f"ratio_{k}": [a[k] / b[k] for a, b in zip(runs, old)] for k in keys}}


def startup(repeat: int, tmp: Path, against: Path | None = None) -> dict:
    trace = tmp / "one.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 100, "output_tokens": 10}\n')
    runs, old = [], []
    for _ in range(repeat):
        runs.append(testbed_run(trace, tmp / "one"))
        if against is not None:
            old.append(testbed_run(trace, tmp / "one", against))
    out = {"wall_s": statistics.median(r["wall_s"] for r in runs), "cpu_s": statistics.median(r["cpu_s"] for r in runs)}
    if old:
        out["against"] = against_side(runs, old, ("wall_s", "cpu_s"))
    return out


def paired(trace_path: Path, blis: Path | None, repeat: int, tmp: Path, against: Path | None = None) -> dict:
    """testbed (and the other checkout's, and BLIS, alternating) on the trace; medians and per-pair ratios."""
    trace = load_trace(trace_path)
    if blis is not None:
        header, data = write_trace(trace, tmp / "blis_trace")
    runs, old, peer = [], [], []
    for _ in range(repeat):
        runs.append(testbed_run(trace_path, tmp / "run"))
        if against is not None:
            old.append(testbed_run(trace_path, tmp / "run", against))
        if blis is not None:
            wall, cpu, _ = timed(replay_command(blis, header, data, tmp), cwd=blis.resolve().parent)
            peer.append({"wall_s": wall, "cpu_s": cpu})
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "simulate_s")}
    out = {"requests": len(trace), "steps": runs[0]["steps"], "simulated_s": runs[0]["simulated_s"],
           "finished": runs[0]["finished"], **med, "steps_per_s": runs[0]["steps"] / med["wall_s"], "runs": runs}
    if old:
        out["against"] = against_side(runs, old, ("wall_s", "cpu_s", "simulate_s"))
    if peer:
        out["blis"] = {"wall_s": statistics.median(p["wall_s"] for p in peer),
                       "cpu_s": statistics.median(p["cpu_s"] for p in peer), "runs": peer}
        out["ratio_wall"] = [r["wall_s"] / p["wall_s"] for r, p in zip(runs, peer)]
        out["ratio_cpu"] = [r["cpu_s"] / p["cpu_s"] for r, p in zip(runs, peer)]
    return out


def synthetic(trace_path: Path, n: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """n requests with (input, output) lengths drawn from the trace, Poisson arrivals at `rate` requests/s."""
    lengths = [(r.input_tokens, r.output_tokens) for r in load_trace(trace_path)]
    rng = random.Random(seed)
    arrivals = gamma_arrivals(n, rate, 1.0, seed)
    return [TraceRequest(f"syn-{i}", t, *rng.choice(lengths)) for i, t in enumerate(arrivals)]


def dp_case(trace: list[TraceRequest], replicas: int, policy: str) -> dict:
    model, gpu = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H100-SXM")
    cfg = EngineConfig(data_parallel_size=replicas, dp_policy=policy)
    blocks = num_gpu_blocks(model, gpu, cfg.block_size, cfg.gpu_memory_utilization)
    cm, _ = load_cost_model("auto", model, gpu, cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(trace, cfg, cm, blocks, model.max_position_embeddings, model.vocab_size)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = len(res.records.steps)
    return {"policy": policy, "requests": len(trace), "replicas": replicas, "wall_s": wall, "cpu_s": cpu,
            "steps": steps, "fast_forwarded_steps": res.fast_forwarded_steps, "simulated_s": res.sim_time,
            "steps_per_s": steps / wall, "finished": res.records.request_columns()["finish_reason"].count("length")}


CHILD_DP_CASE = """import json, sys
sys.path.insert(0, {bench!r})
import sim_speed as s
trace = s.synthetic(s.Path({trace!r}), {n}, {rate!r})
print(json.dumps(s.dp_case(trace, {replicas}, {policy!r})))
"""


def dp_case_of(root: Path, trace_path: Path, n: int, rate: float, replicas: int, policy: str) -> dict:
    """dp_case of the checkout at `root`, in a child process (this file's functions over that checkout's testbed)."""
    code = CHILD_DP_CASE.format(bench=str(Path(__file__).resolve().parent), trace=str(trace_path), n=n, rate=rate,
                                replicas=replicas, policy=policy)
    _, _, stdout = timed([sys.executable, "-c", code], cwd=root, env=tree_env(root))
    return json.loads(stdout.strip().splitlines()[-1])


def commit_of(root: Path) -> str:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--blis", type=Path, default=None, help="path of a BLIS binary (inference-sim) to time alongside")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each side (alternating with BLIS)")
    ap.add_argument("--dp-requests", type=int, default=1_000_000, help="0 skips the data-parallel case")
    ap.add_argument("--dp-replicas", type=int, default=64)
    ap.add_argument("--dp-rate", type=float, default=4.0, help="arrivals per second per replica")
    ap.add_argument("--dp-policy", nargs="+", default=["round_robin", "least_loaded"])
    ap.add_argument("--against", type=Path, default=None,
                    help="root of another checkout whose code every timed run alternates with (paired ratios)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.blis is not None and not args.blis.is_file():
        ap.error(f"--blis {args.blis}: no such file (give the path of the blis binary)")
    if args.against is not None and not (args.against / "testbed" / "cli.py").is_file():
        ap.error(f"--against {args.against}: not a checkout of this project (no testbed/cli.py there); make one with "
                 "`git worktree add --detach PATH COMMIT`")
    for root in (ROOT, args.against):  # the sources' bytecode, which a user's first run leaves behind
        if root is not None and not compileall.compile_dir(root / "testbed", quiet=1):
            ap.error(f"{root / 'testbed'}: does not compile")
    env = {"python": platform.python_version(), "simpy": metadata.version("simpy"), "numpy": metadata.version("numpy"),
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
           "load_avg_before": os.getloadavg(), "commit": commit_of(ROOT)}
    if args.against is not None:
        env["against"] = {"root": str(args.against), "commit": commit_of(args.against)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        start = startup(args.repeat, tmp, args.against)
        print(f"start-up (one-request trace, whole process, median of {args.repeat}): {start['wall_s']:.3f} s wall, "
              f"{start['cpu_s']:.3f} s CPU")
        if "against" in start:
            print(f"  {env['against']['commit']}: {start['against']['wall_s']:.3f} s wall; paired ratio (this / it) "
                  f"median {statistics.median(start['against']['ratio_wall_s']):.2f}")
        hour = paired(args.trace, args.blis, args.repeat, tmp, args.against)
    print(f"\n{args.trace.name}: {hour['requests']} requests, {hour['steps']} steps, {hour['simulated_s']:.0f} simulated s")
    print("| run | wall (s) | CPU (s) | steps/s |\n|---|---|---|---|")
    for i, r in enumerate(hour["runs"]):
        print(f"| testbed {i + 1} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['steps'] / r['wall_s']:,.0f} |")
        if "blis" in hour:
            p = hour["blis"]["runs"][i]
            print(f"| BLIS {i + 1} | {p['wall_s']:.2f} | {p['cpu_s']:.2f} | |")
    print(f"testbed median: {hour['wall_s']:.2f} s wall, {hour['cpu_s']:.2f} s CPU, {hour['steps_per_s']:,.0f} steps/s "
          f"(simulation alone {hour['simulate_s']:.2f} s)")
    if "blis" in hour:
        print(f"BLIS median: {hour['blis']['wall_s']:.2f} s wall, {hour['blis']['cpu_s']:.2f} s CPU; testbed / BLIS "
              f"median paired ratio: {statistics.median(hour['ratio_wall']):.2f} wall, "
              f"{statistics.median(hour['ratio_cpu']):.2f} CPU")
    if "against" in hour:
        old = hour["against"]
        print(f"{env['against']['commit']} median: {old['wall_s']:.2f} s wall (simulation alone {old['simulate_s']:.2f} s); "
              f"paired ratio (this / it) median {statistics.median(old['ratio_wall_s']):.2f} wall, "
              f"{statistics.median(old['ratio_simulate_s']):.2f} simulation alone")
    dp_rows = []
    if args.dp_requests:
        trace = synthetic(args.trace, args.dp_requests, args.dp_rate * args.dp_replicas)
        print(f"\n{args.dp_requests:,} synthetic requests on {args.dp_replicas} replicas, {args.dp_rate:g} req/s each")
        print("| policy | wall (s) | CPU (s) | steps | fast-forwarded | simulated (s) | steps/s |\n|---|---|---|---|---|---|---|")
        for policy in args.dp_policy:
            if args.against is None:
                r = dp_case(trace, args.dp_replicas, policy)
            else:  # each side in its own child process, alternating
                case = (args.trace, args.dp_requests, args.dp_rate * args.dp_replicas, args.dp_replicas, policy)
                runs, old = [], []
                for _ in range(args.repeat):
                    runs.append(dp_case_of(ROOT, *case))
                    old.append(dp_case_of(args.against, *case))
                r = {**runs[0], **{k: statistics.median(x[k] for x in runs) for k in ("wall_s", "cpu_s")}, "runs": runs,
                     "against": against_side(runs, old, ("wall_s", "cpu_s"))}
                r["steps_per_s"] = r["steps"] / r["wall_s"]
            dp_rows.append(r)
            print(f"| {policy} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['steps']:,} | {r['fast_forwarded_steps']:,} | "
                  f"{r['simulated_s']:,.0f} | {r['steps_per_s']:,.0f} |", flush=True)
            if "against" in r:
                print(f"  {env['against']['commit']}: {r['against']['wall_s']:.1f} s wall (median of {args.repeat}); paired "
                      f"ratio (this / it) median {statistics.median(r['against']['ratio_wall_s']):.2f}", flush=True)
    env["load_avg_after"] = os.getloadavg()
    print(env)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "startup": start, "trace": hour, "dp": dp_rows}, indent=2))


if __name__ == "__main__":
    main()
