"""`testbed profile --enable-lora`: what multi-LoRA costs on this GPU, measured on the real executor.

- compute: the same synthetic step (decode batches; prefill chunks at context 0) timed with every row on an
  adapter (one device slot of random weights at --max-lora-rank) and on the base model; the difference of their
  device forward times is LoRA's cost at that token count (the kernels compute the slot's full rank, so one rank
  stands for the adapters it can hold);
- loads: writing a random adapter of --max-lora-rank on every projection into a slot, from its folder (read and
  parsed first: a host-cache miss) and again from the host cache.
The simulator charges them through sim/lora_cost.py (MeasuredLoRACost) in place of the roofline terms.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from testbed.engine.lora import LoRARequest
from testbed.profiling.synthetic_steps import StepFactory, decode_rows

PROFILE_LORA = LoRARequest("profile", 1 << 30, "")  # the adapter the profile's steps run (its own id)


PEFT_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # projection -> its parent module


def write_random_adapter(config, folder: Path, rank: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                         targets: Sequence[str] = tuple(PEFT_MODULES), alpha: float | None = None,
                         std: float = 0.01) -> str:
    """A PEFT folder with a random adapter of `rank` on the `targets` projections of every layer of a model of
    this config (a HF config, its dict, or a ModelConfig; full checkpoint shapes, A and B both N(0, std), so it
    changes the outputs; lora_alpha `alpha`, default the rank)."""
    from safetensors.torch import save_file

    from testbed.worker.model import ModelConfig
    cfg = config if isinstance(config, ModelConfig) else ModelConfig(config)
    hd, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for m in targets:
            inp, out = dims[m]
            key = f"base_model.model.model.layers.{i}.{PEFT_MODULES[m]}.{m}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * std).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * std).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank,
                                                           "lora_alpha": rank if alpha is None else alpha,
                                                           "target_modules": list(targets), "bias": "none"}))
    return str(folder)


def _on_adapter(so, slot: int) -> None:
    for r in so.requests:
        r.lora_request = PROFILE_LORA
    so.lora_slots = [slot] * len(so.requests)
    so.num_lora_tokens, so.num_loras = so.total_num_scheduled_tokens, 1


def measure_lora(m, f: StepFactory, runner, batches: list[int], chunks: list[int], capacity: int, reps: int,
                 tick: Callable[[], None]) -> dict:
    """The LoRA tables of the module docstring for the runner's slots (runner.lora: built with enable_lora)."""
    lora = runner.lora
    rank = lora.max_lora_rank
    with torch.no_grad():
        g = torch.Generator(device=runner.device).manual_seed(0)
        for modules in lora.layers:
            for lin in modules.values():
                lin.lora_a[0].normal_(0, 0.01, generator=g)
                lin.lora_b[0].normal_(0, 0.01, generator=g)
    lora.slot_ids[0] = PROFILE_LORA.lora_int_id

    def extra(rows) -> float | None:
        tick()
        if sum(c + n for c, n, _ in rows) > capacity:
            return None
        base = m.sync(f.step(rows))["forward_s"]
        so = f.step(rows)
        _on_adapter(so, 0)
        return m.sync(so)["forward_s"] - base

    out = {"max_lora_rank": rank,
           "decode": {"tokens": batches, "extra_s": [extra(decode_rows(b, 16)) for b in batches]},
           "chunk": {"tokens": chunks, "extra_s": [extra([(0, n, False)]) for n in chunks]}}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = LoRARequest("profile-load", (1 << 30) + 1, write_random_adapter(runner.model.config, Path(tmp), rank))
        disk, host = [], []
        for _ in range(max(reps, 3)):
            for times in (disk, host):  # a miss (the host copy dropped first), then a hit
                if times is disk:
                    lora.host.pop(adapter.lora_int_id, None)
                sync()
                t0 = time.perf_counter()
                lora.load(0, adapter)
                sync()
                times.append(time.perf_counter() - t0)
        lora.host.pop(adapter.lora_int_id, None)
    lora.slot_ids[0] = None
    out["load_disk_s"], out["load_host_s"] = float(np.median(disk)), float(np.median(host))
    return out
