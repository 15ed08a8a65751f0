"""The engine's host work per decode step, timed the three ways profiling/host_costs.py knows, on one machine.

A profile prices the EngineCore's own host work per step (`engine_host`). Timed alone, back to back without a
model (isolated), schedule + update ran shorter than the same code between real steps (in_loop); a stepper's
cycle outside the model runner (cycle, what profiles record now) also counts the executor's call and the stepper.
This runs the three on one executor (a tiny random Llama on the CPU, or a preset with dummy weights on a GPU),
alternating per batch size, and prints each median and the ratios to isolated.

  python benchmarks/engine_host.py [--model PRESET] [--batch 16 64 128] [--rounds 3] [--out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a preset with dummy weights (default: a tiny random Llama, CPU)")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from testbed.engine.config import EngineConfig
    from testbed.profiling.host_costs import engine_host_costs
    from testbed.worker.executor import create_executor
    if a.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from llm_helpers import save_tiny_llama
        folder = tempfile.mkdtemp()
        save_tiny_llama(folder, 4, 2, seed=5)
        cfg = EngineConfig(num_gpu_blocks=max(a.batch) * 5 + 16, max_model_len=256, max_num_seqs=max(a.batch),
                           max_num_batched_tokens=16 * max(a.batch))
        executor, model = create_executor(folder, cfg, dtype="float32"), "tiny random Llama (4 layers)"
    else:
        cfg = EngineConfig(max_model_len=4096, max_num_seqs=max(a.batch))
        executor, model = create_executor(a.model, cfg, "dummy"), a.model
    rows = []
    try:
        for b in a.batch:
            t = {"cycle": [], "in_loop": [], "isolated": []}
            for _ in range(a.rounds):
                for method in t:
                    ex = None if method == "isolated" else executor
                    t[method] += engine_host_costs(cfg, executor.max_model_len, [b], [16], ex,
                                                   method=method)["decode_step_s"]
            cycle, loop, alone = (statistics.median(t[m]) for m in ("cycle", "in_loop", "isolated"))
            rows.append({"batch": b, "cycle_s": cycle, "in_loop_s": loop, "isolated_s": alone, "ratio": loop / alone,
                         "cycle_ratio": cycle / alone})
    finally:
        executor.shutdown()
    print(f"{model}: the engine's host work per decode step")
    print("| batch | stepper cycle outside the runner, us | schedule + update in a real loop, us | alone, us | "
          "cycle / alone | in loop / alone |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['cycle_s'] * 1e6:.0f} | {r['in_loop_s'] * 1e6:.0f} | {r['isolated_s'] * 1e6:.0f} | "
              f"{r['cycle_ratio']:.2f} | {r['ratio']:.2f} |")
    if a.out:
        a.out.write_text(json.dumps({"model": model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
