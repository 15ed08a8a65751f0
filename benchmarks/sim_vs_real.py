"""Sim-vs-real error on a held-out real run: simulate the exact requests a real `bench serve` run served.

  python benchmarks/sim_vs_real.py [--real benchmarks/results/real_runs/serve_h200_llama3.2-1b_azure_rate8]
The real run's requests (arrival, input and output tokens) become the trace; the simulator runs
them with (a) `testbed simulate`'s default cost model (`auto`: the profile shipped for the model and GPU,
else the roofline), (b) the roofline and (c) a profile given with --profile, with the real run's cache
size and max_model_len, as `testbed simulate --like RUN_DIR` does.
Prints each headline metric and its relative error.
No GPU needed: the real runs are committed.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from testbed.engine.config import EngineConfig
from testbed.runs.rundir import read_run
from testbed.sim.like import like_config
from testbed.sim.run import run_simulation

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "benchmarks/results/real_runs/serve_h200_llama3.2-1b_azure_rate8"
METRICS = [("request_throughput", None), ("output_throughput", None), ("ttft_s", "mean"), ("ttft_s", "p50"),
           ("ttft_s", "p99"), ("tpot_s", "mean"), ("tpot_s", "p50"), ("tpot_s", "p99"), ("itl_s", "p50"),
           ("e2e_s", "mean"), ("e2e_s", "p50"), ("e2e_s", "p99"), ("mean_batch_size", None)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", type=Path, default=REAL)
    ap.add_argument("--profile", type=Path, default=None, help="a profile written by `testbed profile`")
    ap.add_argument("--model", default="Llama-3.2-1B")
    ap.add_argument("--gpu", default="H200")
    args = ap.parse_args()
    real = read_run(args.real)
    cfg = like_config(args.real, EngineConfig())
    sims = {name: run_simulation(str(args.real), cfg, model=args.model, gpu=args.gpu, cost_model=cm, progress=False)[1]
            for name, cm in (("default", "auto"), ("roofline", "roofline"),
                             *((("profile", str(args.profile)),) if args.profile else ()))}
    n, blocks = next(iter(sims.values()))["num_requests"], cfg.num_gpu_blocks
    rows = []
    for key, q in METRICS:
        r = real.summary[key] if q is None else real.summary[key][q]
        row = {"metric": key if q is None else f"{key} {q}", "real": r}
        for name, s in sims.items():
            v = s[key] if q is None else s[key][q]
            row[name], row[f"{name} error"] = v, (v - r) / r if r else float("nan")
        rows.append(row)
    print(f"{n} requests from {args.real.name}; cache {blocks} blocks; profile {args.profile or 'none given'}")
    names = list(sims)
    print("| metric | real | " + " | ".join(f"{m} | {m} error" for m in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    for r in rows:
        print(f"| {r['metric']} | {r['real']:.4g} | "
              + " | ".join(f"{r[m]:.4g} | {r[m + ' error']:+.1%}" for m in names) + " |")


if __name__ == "__main__":
    main()
