"""The EngineCore's own host work per step on this machine (no model): part of a profile, since a serving
step's cycle includes the scheduler and the update as well as the executor."""
from __future__ import annotations

import statistics
import time

import numpy as np

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request


def engine_host_costs(config: EngineConfig, max_model_len: int, batches: list[int], admit_tokens: list[int]) -> dict:
    """Seconds of the EngineCore's own work per step on this host (no model): schedule + update of a decode
    batch, and of a step admitting one prompt (with and without prefix caching)."""
    def timed_steps(core: EngineCore, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            so = core.schedule(0.0)
            core.update(so, ModelRunnerOutput([7 if r.num_computed_tokens >= r.num_tokens else -1
                                               for r in so.requests]), 0.0)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    bs = config.block_size

    def admitted(core: EngineCore, req: Request) -> Request:
        if core.add_request(req, 0.0) is not None:
            raise RuntimeError(f"engine host sweep: request {req.request_id} was rejected ({req.stop_reason})")
        return req

    decode = []
    for b in batches:
        core = EngineCore(EngineConfig(**{**config.to_dict(), "max_num_seqs": max(b, config.max_num_seqs),
                                          "max_num_batched_tokens": max(config.max_num_batched_tokens, 16 * b)}),
                          num_gpu_blocks=b * -(-(16 + 64) // bs) + 8, max_model_len=max_model_len)
        for i in range(b):
            admitted(core, Request(f"h{i}", rng.integers(1000, 30000, 16, dtype=np.int32), params, 0.0))
        timed_steps(core, 1)  # the prefills
        decode.append(timed_steps(core, 30))
    admit = {}
    for caching in (False, True):
        cfg = EngineConfig(**{**config.to_dict(), "enable_prefix_caching": caching})
        times = []
        for n in admit_tokens:
            samples = []
            for k in range(5):
                core = EngineCore(cfg, num_gpu_blocks=-(-(n + 64) // bs) + 8, max_model_len=max(max_model_len, n + 65))
                admitted(core, Request(f"a{k}", rng.integers(1000, 30000, n, dtype=np.int32), params, 0.0))
                samples.append(timed_steps(core, 1))
            times.append(statistics.median(samples))
        admit["prefix_caching" if caching else "plain"] = times
    return {"decode_batch": batches, "decode_step_s": decode,
            "admit_tokens": admit_tokens, "admit_step_s": admit}
