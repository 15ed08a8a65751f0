"""Does a decode step slow down when its KV blocks are scattered over the cache? Contiguous against scattered.

`testbed profile` times its steps on rows whose blocks are runs of consecutive ids; a long-running engine's
free list hands out blocks in no order. This times the same decode steps (B rows at one context) both ways on
one executor, alternating A B A B, through the profiler's own step measurement (median of --reps runs after
--warmup), and prints each layout's median step time and the scattered / contiguous ratio per shape.

  python benchmarks/kv_layout.py --model Llama-3.2-1B --batch 64 256 --context 1024 2048 [--rounds 5] [--out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def measure(executor, block_size: int, shapes: list[tuple[int, int]], rounds: int, reps: int, warmup: int,
            seed: int = 0) -> list[dict]:
    """Per (batch, context): the median over `rounds` alternating rounds of each layout's step wall time (s)."""
    from testbed.profiling.step_measure import StepMeasurer
    from testbed.profiling.synthetic_steps import StepFactory, decode_rows
    measurer = StepMeasurer(executor, reps, warmup)
    factories = {name: StepFactory(executor.num_gpu_blocks, block_size, executor.vocab_size, seed, scattered=s)
                 for name, s in (("contiguous", False), ("scattered", True))}
    rows = []
    for batch, context in shapes:
        times: dict[str, list[float]] = {name: [] for name in factories}
        for _ in range(rounds):
            for name, f in factories.items():  # A B A B: the machine's drift falls on both
                times[name].append(measurer.sync(f.step(decode_rows(batch, context)))["wall_s"])
        c, s = (statistics.median(times[n]) for n in ("contiguous", "scattered"))
        rows.append({"batch": batch, "context": context, "contiguous_s": c, "scattered_s": s, "ratio": s / c,
                     "rounds": rounds})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Llama-3.2-1B")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON of the rows and the machine")
    a = ap.parse_args()
    import torch

    from testbed.engine.config import EngineConfig
    from testbed.worker.executor import create_executor
    config = EngineConfig(max_model_len=a.max_model_len)
    executor = create_executor(a.model, config, "dummy")
    try:
        shapes = [(b, c) for b in a.batch for c in a.context]
        rows = measure(executor, config.block_size, shapes, a.rounds, a.reps, a.warmup, config.seed)
    finally:
        executor.shutdown()
    print("| batch | context | contiguous ms | scattered ms | scattered / contiguous |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['contiguous_s'] * 1e3:.3f} | {r['scattered_s'] * 1e3:.3f} | "
              f"{r['ratio']:.3f} |")
    if a.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        a.out.write_text(json.dumps({"model": a.model, "device": device, "num_gpu_blocks": executor.num_gpu_blocks,
                                     "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
