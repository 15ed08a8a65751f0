"""The engine keyword arguments of `LLM(...)`: this engine's EngineConfig fields, and vLLM's common engine
arguments. Each vLLM argument is honoured (under its own name, or renamed to this engine's), accepted at the
one value this engine has, or refused with a ValueError that says why and what to do; so is an argument
neither engine knows. Nothing is accepted and then ignored."""
from __future__ import annotations

import dataclasses
from typing import Any

from testbed.engine.config import EngineConfig

RENAMED = {"scheduling_policy": "policy", "num_gpu_blocks_override": "num_gpu_blocks",
           "num_cpu_blocks_override": "num_cpu_blocks"}

# vLLM arguments with one answer here: the values accepted, and why no other is
FIXED: dict[str, tuple[tuple, str]] = {
    "quantization": ((None,), "weights load unquantized (safetensors, or GGUF dequantized)"),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model's dtype"),
    "speculative_config": ((None,), "there is no speculative decoding"),
    "cpu_offload_gb": ((0, None), "weights are not offloaded to the CPU"),
    "tokenizer_mode": (("auto", "hf"), "the Hugging Face tokenizer of the model is used"),
    "distributed_executor_backend": ((None, "mp"), "tensor-parallel workers are processes; Ray places "
                                                   "data-parallel replicas only (testbed serve "
                                                   "--data-parallel-backend ray)"),
    "max_logprobs": ((20, None), "up to 20 logprobs per token are returned, as OpenAI's bound"),
    "disable_log_stats": ((True, None), "no stats are logged periodically (read LLM.records() instead)"),
    "hf_token": ((None,), "nothing is downloaded (a hub id is read from the local Hugging Face cache)"),
    "runner": (("auto", "generate", "pooling"), "every model both generates and embeds"),
    "convert": (("auto", "none", "embed"), "every model both generates and embeds"),
    "task": (("auto", "generate", "embed"), "every model both generates and embeds"),
}

# LLM's own keyword arguments (the rest go to EngineConfig)
OWN = ("tokenizer", "load_format", "dtype", "device", "skip_tokenizer_init", "enforce_eager", "executor",
       "pooler_config", "trust_remote_code", "revision", "tokenizer_revision", "download_dir")


def engine_config(args: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of `LLM(**args)`'s engine arguments (those not in OWN), after checking each one."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    config: dict[str, Any] = {}
    for name, value in args.items():
        if name in FIXED:
            accepted, why = FIXED[name]
            if value not in accepted:
                raise ValueError(f"LLM({name}={value!r}): not supported here: {why}; leave it out "
                                 f"(accepted: {', '.join(repr(a) for a in accepted)})")
        elif RENAMED.get(name, name) in fields:
            config[RENAMED.get(name, name)] = value
        else:
            known = sorted(fields | set(RENAMED) | set(FIXED) | set(OWN))
            raise ValueError(f"LLM({name}=...): not an engine argument of this LLM; it takes {', '.join(known)}")
    return EngineConfig(**config)
