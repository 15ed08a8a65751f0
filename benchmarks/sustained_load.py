"""Does a step take longer once the GPU has been busy for a while? A step timed as the profiler times it (after an
idle pause, a few reps) against the same step run back to back for --seconds, with nvidia-smi sampling the SM
clock, power and temperature every 100 ms.

  python benchmarks/sustained_load.py --model Llama-3.1-8B [--seconds 8] [--max-model-len 16384] [--json OUT]

Per shape it prints the "cold" times (3 reps after a 2 s pause, the profiler's regime), the median of the first
10 and of the last 50 back-to-back runs ("hot"), 3 reps right after, and the mean SM clock, the peak power and
temperature over the cold window and over the last 30% of the hot one. Shapes: one prefill chunk of 8192 and of
2048 tokens (no cached context), a 256-token chunk beside 64 decode rows at context 1024, and a decode batch of
128 at context 1024 (on a CPU: a 64-token chunk and a decode batch of 4, for a smoke run; no clock there).
Dummy weights, the executor a serving run uses (CUDA graphs where the step fits one).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

from testbed.engine.config import EngineConfig
from testbed.profiling.synthetic_steps import StepFactory, decode_rows
from testbed.worker.executor import create_executor

GPU_SHAPES = {"chunk8192": [(0, 8192, False)], "chunk2048": [(0, 2048, False)],
              "chunk256+64dec": [(0, 256, False)] + decode_rows(64, 1024), "dec128": decode_rows(128, 1024)}
CPU_SHAPES = {"chunk64": [(0, 64, False)], "dec4": decode_rows(4, 64)}
PAUSE_S = 2.0  # idle before the cold reps, as the profiler's points follow smaller ones


class Sampler:
    """nvidia-smi's SM clock (MHz), power (W) and temperature (C) of GPU 0 every 100 ms, stamped with
    time.perf_counter() as each line arrives; nothing on a machine without a GPU."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, float]] = []
        self._proc = None
        if torch.cuda.is_available():
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                           "--format=csv,noheader,nounits", "-lms", "100", "-i", "0"],
                                          stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            parts = line.strip().split(", ")
            try:
                self.samples.append((time.perf_counter(), *map(float, parts)))
            except ValueError:  # a header or an "[N/A]"
                continue

    def window(self, t0: float, t1: float) -> dict | None:
        v = [s for s in self.samples if t0 <= s[0] <= t1]
        if not v:
            return None
        return {"sm_clock_mhz_mean": statistics.mean(s[1] for s in v), "power_w_max": max(s[2] for s in v),
                "temperature_c_max": max(s[3] for s in v), "samples": len(v)}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()


def timed(executor, so, n: int) -> list[float]:
    """Seconds per run of `so`, each run synchronised (execute returns after the step's readback)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        executor.execute(so)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a preset with dummy weights (default: the bundled SmolLM2)")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long each shape runs back to back")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = EngineConfig(max_model_len=a.max_model_len)
    ex = create_executor(a.model, cfg, "dummy")
    f = StepFactory(ex.num_gpu_blocks, cfg.block_size, ex.vocab_size, 0)
    smi = Sampler()
    res: dict = {"model": a.model, "seconds": a.seconds, "device": torch.cuda.get_device_name() if
                 torch.cuda.is_available() else "cpu", "shapes": {}}
    try:
        for name, rows in (GPU_SHAPES if torch.cuda.is_available() else CPU_SHAPES).items():
            so = f.step(rows)
            timed(ex, so, 2)  # untimed: first-call work
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            cold = timed(ex, so, 3)
            t1 = time.perf_counter()
            hot: list[float] = []
            while time.perf_counter() - t1 < a.seconds:
                hot += timed(ex, so, 5)
            t2 = time.perf_counter()
            after = timed(ex, so, 3)
            r = {"cold_ms": [x * 1e3 for x in cold], "hot_first10_ms": statistics.median(hot[:10]) * 1e3,
                 "hot_last50_ms": statistics.median(hot[-50:]) * 1e3, "hot_runs": len(hot),
                 "after_ms": [x * 1e3 for x in after], "gpu_cold": smi.window(t0 - 0.3, t1),
                 "gpu_hot": smi.window(t1 + 0.7 * (t2 - t1), t2)}
            r["hot_over_cold"] = r["hot_last50_ms"] / statistics.median(r["cold_ms"])
            res["shapes"][name] = r
            print(name, json.dumps(r), flush=True)
            time.sleep(PAUSE_S)
    finally:
        smi.stop()
        ex.shutdown()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
