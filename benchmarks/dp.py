"""Data parallelism on one host, real and simulated: R replicas per GPU against one.

  python benchmarks/dp.py --gpus 1 --model Llama-3.2-1B --load-format dummy --out OUT
  CPU smoke run (a short trace of short requests): python benchmarks/dp.py --device cpu --model SmolLM2-135M \\
      --load-format dummy --quick-profile --trace SHORT.jsonl --rates 2 4 --num-prompts 12 --warmup 4 \\
      --engine-args "--max-model-len 512 --num-gpu-blocks 256" --out OUT

Layouts: `--gpus` G GPUs with 1 replica each (--gpu-memory-utilization 0.9, the baseline; G = 1
is a single engine) and with `--replicas-per-gpu` R each (0.9 / R: R replicas share a GPU, each
sizing its KV cache from its share). For each layout and each `--rates` value, `testbed replay`
runs the Azure conv trace re-timed at that rate through the real engine (the DP coordinator and
its replica processes when there are several), one run directory each. Then `testbed simulate`
runs the same requests on the same KV-cache size twice: predicted with a cost model (default:
`profile`, a step-time profile `testbed profile` measures first with one replica owning the GPU;
or `auto`, `roofline` or a profile JSON), and replayed from the run's own recorded timings
(decision parity: every routing and batch must match). A warm-up replay per layout (discarded)
compiles the kernels first. The simulator does not model replicas contending for one GPU: the
prediction error of the shared layout measures what that leaves out.

Prints markdown tables (throughput and TTFT/TPOT percentiles, real vs predicted and the relative
error; decision parity; the DP stack's measured routing hop and stats-report transit, whose
doubled median is the simulator's --dp-routing-delay) and writes OUT/dp_results.json and the run
directories under OUT/runs/. Every run is a subprocess with a time limit; nothing waits forever.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's testbed, as the `python -m testbed.cli` subprocesses (cwd ROOT) use
TRACE = ROOT / "traces" / "azure_conv_10min.jsonl"
METRICS = [("output_throughput", None), ("request_throughput", None), ("ttft_s", "p50"), ("ttft_s", "p90"),
           ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p90"), ("tpot_s", "p99"), ("e2e_s", "p50"),
           ("e2e_s", "p99")]


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


def value(summary: dict, key: str, q: str | None) -> float | None:
    v = summary[key] if q is None else summary[key][q]
    return None if v is None else float(v)


def relative_error(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


def dp_timings(run_dir: Path) -> dict | None:
    """Measured latencies of the DP stack in a real run: API server -> coordinator (routing hop),
    coordinator -> admission by the replica, replica -> coordinator (stats report transit)."""
    from testbed.rundir import read_run
    run = read_run(run_dir)
    routes, pubs = run.dp_table("routes"), run.dp_table("publications")
    if routes is None or pubs is None:
        return None
    hop = (routes["routed"] - routes["sent"]).to_numpy()
    admit = (routes["added"] - routes["routed"]).dropna().to_numpy()
    transit = (pubs["received"] - pubs["sampled"]).to_numpy()

    def q(x, p):
        return float(np.percentile(x, p)) if len(x) else None
    return {"routing_hop_s": {"p50": q(hop, 50), "p99": q(hop, 99)},
            "route_to_admission_s": {"p50": q(admit, 50), "p99": q(admit, 99)},
            "report_transit_s": {"p50": q(transit, 50), "p99": q(transit, 99)},
            "suggested_dp_routing_delay_s": 2 * q(hop, 50) if len(hop) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to use (CUDA_VISIBLE_DEVICES order)")
    ap.add_argument("--replicas-per-gpu", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of each replica")
    ap.add_argument("--model", default="Llama-3.2-1B", help="model folder, or a preset with --load-format dummy")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--sim-model", default=None, help="the simulator's model preset (default: --model)")
    ap.add_argument("--gpu-name", default="H200", help="the simulator's GPU preset (roofline, KV sizing)")
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 16.0, 32.0], help="req/s")
    ap.add_argument("--num-prompts", type=int, default=300, help="requests per run (the trace's first N)")
    ap.add_argument("--warmup", type=int, default=32, help="requests of the discarded warm-up run per layout")
    ap.add_argument("--policy", default="least_loaded", help="--dp-policy of the multi-replica runs")
    ap.add_argument("--utilization", type=float, default=0.9, help="--gpu-memory-utilization of one GPU in all")
    ap.add_argument("--cost-model", default="profile",
                    help="profile (measure one with `testbed profile` first), auto, roofline or a profile JSON")
    ap.add_argument("--quick-profile", action="store_true", help="testbed profile --quick (a smoke test)")
    ap.add_argument("--engine-args", default="--max-model-len 4096",
                    help="more engine flags for every run, real and simulated (one string)")
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one real run may take")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.gpus < 1 or args.replicas_per_gpu < 2 or args.tp < 1:
        ap.error("--gpus and --tp must be >= 1 and --replicas-per-gpu >= 2")
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.engine_args)
    model = ["--model", args.model, "--load-format", args.load_format, *(["--device", args.device] if args.device else [])]
    sim_model = args.sim_model or args.model
    layouts = [("1/gpu", args.gpus, args.utilization), (f"{args.replicas_per_gpu}/gpu",
               args.gpus * args.replicas_per_gpu, args.utilization / args.replicas_per_gpu)]
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}

    def engine(dp: int, util: float) -> list[str]:
        return ["-dp", str(dp), "-tp", str(args.tp), "--dp-policy", args.policy, "--gpu-memory-utilization",
                f"{util:.4f}", *extra]

    # ---- real runs --------------------------------------------------------------------------------
    for name, dp, util in layouts:
        tag = name.replace("/", "per")
        t0 = time.time()
        testbed(["replay", args.trace, "--limit", str(args.warmup), "--request-rate", str(max(args.rates)),
                 *model, *engine(dp, util), "-o", str(runs / f"warmup-{tag}")], args.run_timeout,
                runs / f"warmup-{tag}.log")
        print(f"# {name}: warm-up done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        for rate in args.rates:
            d = runs / f"real-{tag}-rate{rate:g}"
            s = testbed(["replay", args.trace, "--limit", str(args.num_prompts), "--request-rate", str(rate),
                         *model, *engine(dp, util), "-o", str(d)], args.run_timeout, runs / f"real-{tag}-rate{rate:g}.log")
            results["runs"].append({"layout": name, "dp": dp, "utilization": util, "rate": rate, "real_dir": str(d),
                                    "real": s, "dp_timings": dp_timings(d)})
            print(f"# {name} rate {rate:g}: {s['output_throughput']:.1f} tok/s, {s['num_finished']} finished",
                  file=sys.stderr, flush=True)

    # ---- the cost model ---------------------------------------------------------------------------
    cost_model = args.cost_model
    if cost_model == "profile":  # the step times of one replica owning the GPU, measured on it
        cost_model = str(args.out / "profile.json")
        cmd = [sys.executable, "-m", "testbed.cli", "profile", *model, "-tp", str(args.tp), "--gpu-memory-utilization",
               str(args.utilization), *extra, "-o", cost_model, "--no-progress", *(["--quick"] if args.quick_profile else [])]
        with open(args.out / "profile.log", "w") as log:
            subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.run_timeout * 4, stdout=log, stderr=subprocess.STDOUT)
    results["cost_model"] = cost_model

    # ---- simulations of the same runs ---------------------------------------------------------------
    from testbed.rundir import read_run
    for r in results["runs"]:
        real = read_run(r["real_dir"])
        size = ["--num-gpu-blocks", str(real.manifest["num_gpu_blocks"]), "--max-model-len",
                str(real.manifest["max_model_len"])]
        sim = ["simulate", args.trace, "--limit", str(args.num_prompts), "--request-rate", str(r["rate"]),
               "--model", sim_model, "--gpu", args.gpu_name, *engine(r["dp"], r["utilization"]), *size, "--no-progress"]
        tag = Path(r["real_dir"]).name.replace("real-", "")
        r["sim_dir"] = str(runs / f"sim-{tag}")
        r["sim"] = testbed([*sim, "--cost-model", cost_model, "-o", r["sim_dir"]], args.run_timeout,
                           runs / f"sim-{tag}.log")
        r["errors"] = {f"{k} {q}" if q else k: relative_error(value(r["sim"], k, q), value(r["real"], k, q))
                       for k, q in METRICS}
        try:  # decision parity: the run's own timings must reproduce its routing and batches
            testbed([*sim, "--cost-model", f"recorded:{r['real_dir']}", "-o", str(runs / f"recorded-{tag}")],
                    args.run_timeout, runs / f"recorded-{tag}.log")
            r["decision_parity"] = "exact"
        except RuntimeError as e:
            r["decision_parity"] = f"diverged: {str(e)[-400:]}"

    (args.out / "dp_results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print_tables(results)
    return 0


def fmt(v: float | None, err: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1%}" if err else f"{v:.4g}"


def print_tables(results: dict) -> None:
    cols = [("output_throughput", None), ("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99")]
    head = " | ".join(f"{k.removesuffix('_s')}{' ' + q if q else ''} real | sim | err" for k, q in cols)
    print(f"cost model: {results['cost_model']}\n")
    print(f"| layout | rate | {head} | parity |")
    print("|---|---|" + "---|---|---|" * len(cols) + "---|")
    for r in results["runs"]:
        cells = " | ".join(f"{fmt(value(r['real'], k, q))} | {fmt(value(r['sim'], k, q))} | "
                           f"{fmt(r['errors'][f'{k} {q}' if q else k], err=True)}" for k, q in cols)
        print(f"| {r['layout']} | {r['rate']:g} | {cells} | {r['decision_parity'].split(':')[0]} |")
    timed = [r for r in results["runs"] if r["dp_timings"]]
    if timed:
        print("\n| layout | rate | routing hop p50 / p99 (ms) | route -> admission p50 / p99 (ms) | "
              "report transit p50 / p99 (ms) |")
        print("|---|---|---|---|---|")
        for r in timed:
            t = r["dp_timings"]
            print(f"| {r['layout']} | {r['rate']:g} | " + " | ".join(
                f"{t[k]['p50'] * 1e3:.3f} / {t[k]['p99'] * 1e3:.3f}"
                for k in ("routing_hop_s", "route_to_admission_s", "report_transit_s")) + " |")


if __name__ == "__main__":
    sys.exit(main())
