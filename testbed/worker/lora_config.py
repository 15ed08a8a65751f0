"""A PEFT LoRA adapter folder's adapter_config.json, checked against the engine's LoRA limits (no torch: the
API server checks an adapter with it when one is loaded, the worker before it reads the weights)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# the projections an adapter may target (the Llama family's linear layers)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the adapter, what is wrong and how to fix it."""


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine needs of adapter_config.json: rank r, the scaling of B (lora_alpha / r, or
    lora_alpha / sqrt(r) with use_rslora) and the targeted projections."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]


def read_adapter_config(path: str | Path, max_lora_rank: int, name: str | None = None) -> AdapterConfig:
    """The checked config of the PEFT folder `path`; LoRAError when it is missing or malformed, its rank exceeds
    max_lora_rank, it targets other modules than SUPPORTED_MODULES, or the folder lacks adapter_model.safetensors."""
    folder = Path(path).expanduser()
    who = f"LoRA adapter {name or str(path)!r}"
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAError(f"{who}: {folder} has no adapter_config.json; give a PEFT adapter folder "
                        f"(adapter_config.json + {WEIGHTS_FILE})")
    if not (folder / WEIGHTS_FILE).is_file():
        raise LoRAError(f"{who}: {folder} has no {WEIGHTS_FILE} (save the adapter with safe_serialization=True)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise LoRAError(f"{who}: {cfg_file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{who}: {cfg_file} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{who}: peft_type {cfg.get('peft_type')!r} is not served; only LORA adapters are")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{who}: adapter_config.json needs a positive integer rank r, got {r!r}")
    if r > max_lora_rank:
        raise LoRAError(f"{who}: its rank {r} exceeds --max-lora-rank {max_lora_rank}; restart with "
                        f"--max-lora-rank {r} or higher")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{who}: target_modules must be a list of module names, got {cfg.get('target_modules')!r}")
    other = [t for t in targets if t not in SUPPORTED_MODULES]
    if other:
        raise LoRAError(f"{who}: targets {', '.join(map(repr, other))}, which this engine cannot apply an adapter to; "
                        f"supported target modules: {', '.join(SUPPORTED_MODULES)}")
    for key in ("modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise LoRAError(f"{who}: {key} is set ({cfg[key]!r}); adapters that replace or skip layers are not served")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{who}: bias={cfg['bias']!r}; only adapters without bias terms (bias='none') are served")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{who}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return AdapterConfig(r, float(scaling), tuple(dict.fromkeys(targets)))
