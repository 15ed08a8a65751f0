"""Recompute against swap preemption on the real engine (CPU, the bundled SmolLM2-135M, fp32), under KV pressure.

  python benchmarks/swap.py --out DIR [--blocks 20 40 96] [--requests 12] [--threads 1]
  python benchmarks/swap.py --moves MODEL   # only the worker's block moves on this machine's device (GPU or CPU)

Writes DIR/trace.jsonl (Poisson arrivals, prompts of 48-128 tokens, 32 output tokens each, seed 0) and one run
directory per (preemption mode, KV cache size): DIR/{recompute,swap}_b{N}, each from `testbed replay` of that
trace with `--num-gpu-blocks N` (blocks of 16 tokens) and, for swap, a CPU pool of 256 blocks. Prints one line
per run: finished requests, preemptions (swapped), blocks swapped out, goodput under the SLOs, TTFT p99.
Experiment 06 reads these runs beside its simulated curves. `--moves MODEL` instead times the worker's KV block
moves for MODEL (dummy weights): 64 scattered blocks swapped out, back in and copied on write, medians of 10, as
`testbed profile` records them (host_device) for the simulator to price swaps with.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

SLO = ["--slo-ttft", "5", "--slo-tpot", "0.5"]


def block_moves(model: str) -> dict:
    """testbed profile's host_device measurement for `model` (dummy weights) on this machine's device."""
    from testbed.engine.config import EngineConfig
    from testbed.profiling.sweep import measure_block_moves
    from testbed.worker.executor import create_executor
    executor = create_executor(model, EngineConfig(max_model_len=2048, num_gpu_blocks=512), load_format="dummy")
    return measure_block_moves(executor.runner, 10)


def write_trace(path: Path, n: int, rate: float, seed: int = 0) -> None:
    g = random.Random(seed)
    t = 0.0
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "arrival_s": round(t, 6), "input_tokens": g.randrange(48, 129),
                                "output_tokens": 32}) + "\n")
            t += g.expovariate(rate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--moves", metavar="MODEL", help="only time the worker's KV block moves for MODEL and print them")
    ap.add_argument("--blocks", type=int, nargs="+", default=[20, 40, 96])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.moves:
        import torch
        torch.set_num_threads(a.threads)
        print(json.dumps(block_moves(a.moves)))
        return 0
    if a.out is None:
        ap.error("--out DIR is needed for the runs (or --moves MODEL)")
    a.out.mkdir(parents=True, exist_ok=True)
    trace = a.out / "trace.jsonl"
    write_trace(trace, a.requests, a.rate)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    for blocks in a.blocks:
        for mode in ("recompute", "swap"):
            run = a.out / f"{mode}_b{blocks}"
            cmd = [sys.executable, "-m", "testbed.cli", "replay", str(trace), "--max-model-len", "512",
                   "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--num-gpu-blocks", str(blocks),
                   "--preemption-mode", mode, "--num-cpu-blocks", "256" if mode == "swap" else "0",
                   "--dtype", "float32", "--format", "json", "-o", str(run), *SLO]
            s = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
            print(f"{run.name}: {s['num_finished']}/{s['num_requests']} finished, {s['num_preemptions']} preemptions "
                  f"({s['num_swap_preemptions']} swapped), {s['num_blocks_swapped_out']} blocks out, goodput "
                  f"{s['goodput']:.3f} req/s, TTFT p99 {s['ttft_s']['p99']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
