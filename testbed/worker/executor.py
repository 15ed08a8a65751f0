"""Real-mode executors: build the model and its KV cache, then run SchedulerOutputs on it.

`create_executor` picks the in-process executor for tensor_parallel_size 1 and the multi-process
one (one worker per rank over torch.distributed) otherwise. Every executor exposes the numbers the
EngineCore needs before it starts: num_gpu_blocks, max_model_len, eos_token_id, vocab_size.
"""
from __future__ import annotations

import torch

from testbed.engine.config import EngineConfig
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput

DEFAULT_MODEL_NAMES = ("", "default", "smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def resolve_model(model: str | None, load_format: str = "auto") -> str:
    """The bundled SmolLM2 folder for an empty/default name (real weights), else `model` unchanged."""
    if load_format != "dummy" and (model is None or model.lower() in DEFAULT_MODEL_NAMES):
        from testbed.worker.smollm2 import default_model_dir
        return str(default_model_dir())
    return model or "SmolLM2-135M"


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on a GPU and fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def model_limits(hf_config: dict, config: EngineConfig) -> tuple[int, int | None, int]:
    """(max_model_len, eos_token_id, vocab_size) from the checkpoint's config and the flags."""
    max_pos = int(hf_config.get("max_position_embeddings") or 2048)
    max_model_len = config.max_model_len or max_pos
    if max_model_len > max_pos:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({max_pos})")
    eos = hf_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return max_model_len, eos, int(hf_config["vocab_size"])


class UniprocExecutor:
    """tensor_parallel_size == 1: the model runner lives in this process."""

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto", dtype: str = "auto",
                 device: str | None = None, enforce_eager: bool = False) -> None:
        from testbed.worker.loader import load_model
        from testbed.worker.model_runner import ModelRunner
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        self.model_path = model
        net, hf_config = load_model(model, load_format, dt, dev, seed=config.seed)
        self.hf_config = hf_config
        self.max_model_len, self.eos_token_id, self.vocab_size = model_limits(hf_config, config)
        self.runner = ModelRunner(net, config, self.max_model_len, dev, dt)
        self.num_gpu_blocks = config.num_gpu_blocks or self.runner.profile_num_blocks()
        self.runner.allocate_kv_cache(self.num_gpu_blocks)
        if dev.type == "cuda" and not enforce_eager:
            self.runner.capture_cuda_graphs()
        self.device = dev

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def execute_async(self, so: SchedulerOutput):
        """Launch the step; returns a function that waits for it (see ModelRunner.execute_async)."""
        return self.runner.execute_async(so)

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]


def create_executor(model: str | None, engine_config: EngineConfig, load_format: str = "auto",
                    dtype: str = "auto", device: str | None = None, enforce_eager: bool = False):
    """The executor for these flags (model None = the bundled SmolLM2). CUDA graphs capture the
    decode step on a GPU unless enforce_eager; tensor-parallel ranks run eager (capturing NCCL
    collectives in lockstep on every rank hung on 2 H200s and is not enabled)."""
    model = resolve_model(model, load_format)
    if engine_config.tensor_parallel_size > 1:
        from testbed.worker.multiproc import MultiprocExecutor
        return MultiprocExecutor(model, engine_config, load_format, dtype, device)
    return UniprocExecutor(model, engine_config, load_format, dtype, device, enforce_eager)
