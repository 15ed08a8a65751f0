"""Real-mode executors: build the model and its KV cache, then run SchedulerOutputs on it.

`create_executor` picks the in-process executor for one rank (tensor_parallel_size x pipeline_parallel_size
1) and the multi-process one (one worker per rank over torch.distributed) otherwise. Every executor exposes the
numbers the EngineCore needs before it starts: num_gpu_blocks, num_cpu_blocks (the swap pool, `--swap-space` GiB
of blocks per rank in swap mode), max_model_len, eos_token_id, vocab_size; and
`grammars`, rank 0's grammar backend (worker/grammar.py GrammarStates), which compiles on its own threads.
"""
from __future__ import annotations

from testbed.engine.config import EngineConfig
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.worker.hub import resolve_model
from testbed.worker.resolve import memory_in_use, model_limits, resolve_device, resolve_dtype

class UniprocExecutor:
    """tensor_parallel_size == 1: the model runner lives in this process."""

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto", dtype: str = "auto",
                 device: str | None = None, enforce_eager: bool = False) -> None:
        from functools import partial

        from testbed.worker.loader import load_model, load_tokenizer
        from testbed.worker.model_runner import ModelRunner
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        self.model_path = model
        in_use = memory_in_use(dev)
        net, hf_config = load_model(model, load_format, dt, dev, seed=config.seed)
        self.hf_config = hf_config
        self.max_model_len, self.eos_token_id, self.vocab_size = model_limits(hf_config, config)
        self.runner = ModelRunner(net, config, self.max_model_len, dev, dt, partial(load_tokenizer, model))
        self.runner.memory_baseline = in_use
        self.num_gpu_blocks = config.num_gpu_blocks or self.runner.profile_num_blocks()
        self.num_cpu_blocks = config.cpu_blocks(self.runner.block_bytes)
        self.runner.allocate_kv_cache(self.num_gpu_blocks, self.num_cpu_blocks)
        if dev.type == "cuda" and not enforce_eager:
            self.runner.capture_cuda_graphs()
        self.device = dev
        self.grammars = self.runner.sampler.processors.grammars  # compiles off the step loop (EngineStepper)

    def set_swap_space(self, num_cpu_blocks: int) -> None:
        """A CPU swap pool of `num_cpu_blocks` for the engine reusing this executor (its old one is dropped)."""
        if num_cpu_blocks != self.num_cpu_blocks:
            from testbed.worker.cache_engine import CacheEngine
            self.runner.cache_engine = CacheEngine(self.runner.kv_caches, num_cpu_blocks)
            self.num_cpu_blocks = num_cpu_blocks

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def execute_async(self, so: SchedulerOutput):
        """Launch the step; returns a function that waits for it (see ModelRunner.execute_async)."""
        return self.runner.execute_async(so)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.runner = None  # type: ignore[assignment]


def create_executor(model: str | None, engine_config: EngineConfig, load_format: str = "auto",
                    dtype: str = "auto", device: str | None = None, enforce_eager: bool = False):
    """The executor for these flags (model None = the bundled SmolLM2). On a GPU every step up to the
    largest capture size replays a CUDA graph (worker/cuda_graphs.py) unless enforce_eager, on every
    tensor-parallel rank too (captured in lockstep, the symmetric-memory all-reduces inside the graphs) and on each
    pipeline stage of one GPU (its own layers); pipeline stages with TP inside run eager."""
    model = resolve_model(model, load_format)
    if engine_config.tensor_parallel_size * engine_config.pipeline_parallel_size > 1:
        from testbed.worker.multiproc import MultiprocExecutor
        return MultiprocExecutor(model, engine_config, load_format, dtype, device, enforce_eager)
    return UniprocExecutor(model, engine_config, load_format, dtype, device, enforce_eager)
