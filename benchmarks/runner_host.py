"""Host cost of building one step's flat inputs (ModelRunner.prepare) for a decode batch, on the CPU.

  python benchmarks/runner_host.py [--batch 256] [--context 600]
This is the Python work between two GPU steps that the MBU profile (RESULTS.md) pointed at.
"""
from __future__ import annotations

import argparse
import time

import torch

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput
from testbed.engine.request import Request, SamplingParams
from testbed.worker.model_runner import ModelRunner


class _Fixed:
    """A 10 ms step that samples token 0 for every caught-up request (drives the engine without a model)."""

    def execute(self, so):
        return ModelRunnerOutput([0 if r.num_computed_tokens >= r.num_tokens else -1 for r in so.requests], 0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    args = ap.parse_args()
    cfg = EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(16384, args.batch))
    core = EngineCore(cfg, num_gpu_blocks=args.batch * (args.context // 16 + 64), max_model_len=1 << 16,
                      stream_outputs=False)
    for i in range(args.batch):
        core.add_request(Request(str(i), list(range(1000 + i, 1000 + i + args.context)),
                                 SamplingParams(max_tokens=10_000, ignore_eos=True), 0.0), 0.0)
    while True:  # run the prefills, then stop at a pure decode step
        so = core.schedule(0.0)
        if all(n == 1 for n in so.num_new_tokens):
            break
        core.update(so, _Fixed().execute(so), 0.0)
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs only the block size and the device
    runner.block_size, runner.device = cfg.block_size, torch.device("cpu")
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        runner.prepare(so)
    print(f"decode batch {len(so.requests)}, {len(so.block_ids[0])} blocks/seq: "
          f"prepare {(time.perf_counter() - t) / n * 1e3:.3f} ms/step")


if __name__ == "__main__":
    main()
