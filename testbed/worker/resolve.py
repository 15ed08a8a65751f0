"""Flags to concrete values for the executors: the torch device, the dtype, and the checkpoint's limits.

Shared by the in-process executor (executor.py) and the tensor-parallel one (multiproc.py), so neither
imports the other.
"""
from __future__ import annotations

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
