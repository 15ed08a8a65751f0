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
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request
from testbed.specs.presets import get_model_spec
from testbed.sim.cost_model import RooflineCostModel
from testbed.sim.executor import SimExecutor
from testbed.specs.hardware import get_gpu_spec
from testbed.worker.loader import load_model
from testbed.worker.model_runner import ModelRunner


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
    sim = SimExecutor(RooflineCostModel(get_model_spec("Llama-3.2-1B"), get_gpu_spec("H200")))  # drives the engine
    while True:  # run the prefills, then stop at a pure decode step
        so = core.schedule(0.0)
        if all(n == 1 for n in so.num_new_tokens):
            break
        core.update(so, sim.execute(so), 0.0)
    cpu = torch.device("cpu")
    runner = ModelRunner(load_model("SmolLM2-135M", "dummy", torch.float32, cpu)[0], cfg, 1 << 16, cpu, torch.float32)
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        runner.prepare(so)
    print(f"decode batch {len(so.requests)}, {len(so.block_ids[0])} blocks/seq: "
          f"prepare {(time.perf_counter() - t) / n * 1e3:.3f} ms/step")


if __name__ == "__main__":
    main()
