"""Simulator speed: the whole Azure conv hour on one replica, and at 8x the rate on 8 replicas.

Usage: python benchmarks/sim_speed.py [--trace PATH] [--repeat 3] [--json out.json]
Reports wall time (best of --repeat) of the simulation itself and of the whole pipeline (load
trace + simulate + summarize), and simulated time / wall time. Llama-3.1-8B on H100-SXM, roofline.
Also times the scheduler per step against batch size (it should grow linearly: O(batch)).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path

from testbed.engine.config import EngineConfig
from testbed.engine.metrics import summarize
from testbed.specs.presets import get_model_spec
from testbed.sim.cluster import simulate
from testbed.sim.cost_model import RooflineCostModel, num_gpu_blocks
from testbed.specs.hardware import get_gpu_spec
from testbed.sim.run import load_cost_model
from testbed.workload.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"


def run_case(trace_path: Path, rate_scale: float, dp: int, repeat: int, cost_model: str = "auto") -> dict:
    model, gpu = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H100-SXM")
    cfg = EngineConfig(data_parallel_size=dp, dp_policy="least_loaded")
    blocks = num_gpu_blocks(model, gpu, cfg.block_size, cfg.gpu_memory_utilization)
    cm, cm_desc = load_cost_model(cost_model, model, gpu, cfg)
    best_sim = best_total = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        trace = load_trace(trace_path)
        if rate_scale != 1.0:
            trace = [replace(r, arrival_s=r.arrival_s / rate_scale) for r in trace]
        t1 = time.perf_counter()
        res = simulate(trace, cfg, cm, blocks, model.max_position_embeddings, model.vocab_size)
        t2 = time.perf_counter()
        rec = res.records
        summary = summarize(rec.request_columns(), rec.step_columns(), rec.itl)
        t3 = time.perf_counter()
        best_sim, best_total = min(best_sim, t2 - t1), min(best_total, t3 - t0)
    return {"case": f"{rate_scale:g}x rate, {dp} replica(s)", "cost_model": cm_desc, "requests": len(trace),
            "replicas": dp,
            "simulated_s": res.sim_time, "steps": summary["num_steps"], "wall_sim_s": best_sim,
            "wall_total_s": best_total, "speedup_sim": res.sim_time / best_sim,
            "speedup_total": res.sim_time / best_total, "finished": summary["num_finished"],
            "mean_batch": summary["mean_batch_size"], "us_per_step": best_sim / summary["num_steps"] * 1e6}


def per_step_cost(batch: int, steps: int = 2000) -> dict:
    """Engine cost of a steady decode step (schedule + sim executor + update) at a given batch size."""
    from testbed.engine.core import EngineCore
    from testbed.engine.request import Request, SamplingParams
    from testbed.sim.executor import SimExecutor
    model, gpu = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H100-SXM")
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch))
    core = EngineCore(cfg, num_gpu_blocks=batch * 400, max_model_len=1 << 20, stream_outputs=False)
    ex = SimExecutor(RooflineCostModel(model, gpu))
    for i in range(batch):
        core.add_request(Request(str(i), range(16), SamplingParams(max_tokens=steps * 4, ignore_eos=True), 0.0), 0.0)
    now = 0.0
    for _ in range(3):  # prefill and warm-up
        so, _ = core.step(now, ex)
        now += 0.01
    t = time.perf_counter()
    for _ in range(steps):
        so = core.schedule(now)
        out = ex.execute(so)
        core.update(so, out, now + out.duration)
        now += out.duration
    us = (time.perf_counter() - t) / steps * 1e6
    return {"batch": batch, "us_per_step": us, "us_per_request": us / batch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [run_case(args.trace, 1.0, 1, args.repeat), run_case(args.trace, 8.0, 8, args.repeat)]
    env = {"python": platform.python_version(), "simpy": metadata.version("simpy"), "cpu": platform.processor()
           or platform.machine(), "date": time.strftime("%Y-%m-%d")}
    print("| case | requests | simulated (s) | steps | wall sim (s) | wall total (s) | sim/wall | µs/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['requests']} | {r['simulated_s']:.0f} | {r['steps']} | {r['wall_sim_s']:.2f} | "
              f"{r['wall_total_s']:.2f} | {r['speedup_total']:.0f}x | {r['us_per_step']:.1f} |")
    print("\n| decode batch | µs/step | µs/request |\n|---|---|---|")
    scaling = [per_step_cost(b) for b in (8, 32, 128, 512)]
    for r in scaling:
        print(f"| {r['batch']} | {r['us_per_step']:.1f} | {r['us_per_request']:.2f} |")
    print(env)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows, "per_step": scaling}, indent=2))


if __name__ == "__main__":
    main()
