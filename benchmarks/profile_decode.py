"""Where a decode step's time goes (host vs GPU): cProfile of the engine loop and torch.profiler GPU totals.

  python benchmarks/profile_decode.py --model Llama-3.2-1B --batch 1 [--async-scheduling] [--enforce-eager]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from testbed import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.2-1B")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: the profiler then names every kernel")
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096,
              gpu_memory_utilization=0.6, async_scheduling=args.async_scheduling, enforce_eager=args.enforce_eager)
    for b in args.batch:
        prompts = [[1000 + i + j for j in range(128)] for i in range(b)]
        for r, p in enumerate(prompts):
            llm.add_request(f"b{b}-{r}", p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        for _ in range(5):
            llm.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            llm.step()
        pr.disable()
        torch.cuda.synchronize()
        print(f"batch {b}: {(time.perf_counter() - t) / 50 * 1e3:.2f} ms/step (under cProfile)")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(s.getvalue()[-3500:])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                llm.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows)[-200 * args.rows:])
        t = time.perf_counter()
        for _ in range(50):
            llm.step()
        torch.cuda.synchronize()
        print(f"batch {b}: {(time.perf_counter() - t) / 50 * 1e3:.2f} ms/step (plain)")
        llm.stepper.drain()
        for rid in list(llm.engine.requests):
            llm.engine.abort(rid, llm.now())


if __name__ == "__main__":
    main()
