"""Flags to concrete values for the executors: the torch device, the dtype, the checkpoint's limits, and
the memory of a GPU's other tenants.

Shared by the in-process executor (executor.py) and the tensor-parallel one (multiproc.py), so neither
imports the other.
"""
from __future__ import annotations

import os

import torch

from testbed.engine.config import EngineConfig

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


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


SHARED_GPU_ENV = "TESTBED_SHARED_GPU"


def memory_in_use(device: torch.device) -> int:
    """Bytes in use on `device` when this rank starts, if data-parallel replicas share its GPU
    (TESTBED_SHARED_GPU=1, set by their launcher, which starts them one at a time): the KV cache is then
    sized as if that memory were another tenant's, so --gpu-memory-utilization is this replica's share
    of the GPU, as in vLLM. 0 otherwise (the utilization bounds everything on the GPU)."""
    if device.type != "cuda" or os.environ.get(SHARED_GPU_ENV) != "1":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free
