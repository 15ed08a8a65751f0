"""The worker's LoRA adapters: PEFT folders read into a host cache, copied into the device slots every LoRA-enabled
linear layer holds (kernels/lora.py's layout), sharded across tensor-parallel ranks like the base weights.

The engine decides which adapter goes into which slot and when the host cache drops one (engine/lora.py); this
module carries the decisions out. Invariant: after `apply(so)`, the slot every row of the step names holds that
row's adapter (a slot found holding another is loaded again: the engine's word is checked, not trusted).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from testbed.engine.config import EngineConfig
from testbed.engine.lora import LoRARequest
from testbed.engine.outputs import SchedulerOutput
from testbed.worker.layers import LinearBase, RowParallelLinear
from testbed.worker.lora_config import WEIGHTS_FILE, AdapterConfig, LoRAError, read_adapter_config

_NAME = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# checkpoint projection -> (the model's layer holding it, its slice there)
_TARGET = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", None)}


class Adapter:
    """One adapter on the host: its config and (layer index, projection) -> (A [r, in], B [out, r] x scaling)."""

    def __init__(self, lora: LoRARequest, config: AdapterConfig, weights: dict[tuple[int, str], tuple]) -> None:
        self.lora, self.config, self.weights = lora, config, weights


def read_adapter(lora: LoRARequest, max_lora_rank: int, num_layers: int) -> Adapter:
    """Read and check a PEFT folder (LoRAError naming the adapter and the problem)."""
    from safetensors.torch import load_file
    cfg = read_adapter_config(lora.lora_path, max_lora_rank, lora.lora_name)
    who = f"LoRA adapter {lora.lora_name!r}"
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in load_file(str(Path(lora.lora_path).expanduser() / WEIGHTS_FILE)).items():
        m = _NAME.search(name)
        if m is None or m.group(3) not in _TARGET:
            raise LoRAError(f"{who}: tensor {name!r} is not a LoRA A/B matrix of a supported projection "
                            f"({', '.join(_TARGET)})")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if layer >= num_layers:
            raise LoRAError(f"{who}: tensor {name!r} is for layer {layer}, but the model has {num_layers} layers")
        if module not in cfg.target_modules:
            raise LoRAError(f"{who}: tensor {name!r} is for {module}, which adapter_config.json's target_modules "
                            f"{list(cfg.target_modules)} leave out")
        parts.setdefault((layer, module), {})[which] = t
    weights = {}
    for key, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{who}: layer {key[0]} {key[1]} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != cfg.rank or b.shape[1] != cfg.rank:
            raise LoRAError(f"{who}: layer {key[0]} {key[1]}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                            f"not have the rank r={cfg.rank} of adapter_config.json")
        weights[key] = (a.float(), b.float() * cfg.scaling)
    if not weights:
        raise LoRAError(f"{who}: {WEIGHTS_FILE} holds no LoRA matrices")
    return Adapter(lora, cfg, weights)


def _layer_modules(model) -> list[dict[str, LinearBase]]:
    """Per decoder layer: the model's projection layers by name."""
    return [{"qkv_proj": l.self_attn.qkv_proj, "o_proj": l.self_attn.o_proj, "gate_up_proj": l.mlp.gate_up_proj,
             "down_proj": l.mlp.down_proj} for l in model.model.layers]


class WorkerLoRA:
    """The device slots of one rank's model and the host cache of adapters read so far."""

    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.max_lora_rank, self.num_slots = config.max_lora_rank, config.max_loras
        self.layers = _layer_modules(model)
        R = self.max_lora_rank
        for modules in self.layers:
            for lin in modules.values():
                n_slices = len(lin.lora_slices)
                out_local, in_local = lin.weight.shape
                lin.lora_a = torch.zeros(self.num_slots, n_slices * R, in_local, dtype=dtype, device=device)
                lin.lora_b = torch.zeros(self.num_slots, out_local, R, dtype=dtype, device=device)
        self.host: dict[int, Adapter] = {}
        self.slot_ids: list[int | None] = [None] * self.num_slots  # adapter id each slot holds
        self.broadcast = None  # set by the tensor-parallel executor: sends the loads to the other ranks

    def apply(self, so: SchedulerOutput) -> None:
        """Carry out the step's loads and host-cache drops, then make sure every row's slot holds its adapter."""
        loads = [(ld.slot, ld.lora) for ld in so.lora_loads]
        for slot, lr in zip(so.lora_slots, (r.lora_request for r in so.requests)):
            if lr is not None and self.slot_ids[slot] != lr.lora_int_id and (slot, lr) not in loads:
                loads.append((slot, lr))
        for slot, lr in loads:
            self.load(slot, lr)
        for aid in so.lora_dropped:
            self.host.pop(aid, None)
        if loads and self.broadcast is not None:
            self.broadcast([(slot, lr.lora_name, lr.lora_int_id, lr.lora_path) for slot, lr in loads], so.lora_dropped)

    def adapter(self, lora: LoRARequest) -> Adapter:
        """The host copy of an adapter, read from its folder on first use."""
        a = self.host.get(lora.lora_int_id)
        if a is None or a.lora.lora_path != lora.lora_path:
            a = self.host[lora.lora_int_id] = read_adapter(lora, self.max_lora_rank, len(self.layers))
        return a

    @torch.inference_mode()
    def load(self, slot: int, lora: LoRARequest) -> None:
        """Write an adapter into `slot` of every layer (the slot is cleared first: untargeted projections add 0)."""
        if not 0 <= slot < self.num_slots:
            raise LoRAError(f"LoRA slot {slot} is outside [0, {self.num_slots}) (max_loras)")
        adapter = self.adapter(lora)
        self.slot_ids[slot] = None  # until the copy is complete
        R = self.max_lora_rank
        for modules in self.layers:
            for lin in modules.values():
                lin.lora_a[slot].zero_()
                lin.lora_b[slot].zero_()
        for (i, module), (a, b) in adapter.weights.items():
            name, shard = _TARGET[module]
            lin = self.layers[i][name]
            try:
                _write(lin, slot, shard, a, b, R)
            except ValueError as e:
                raise LoRAError(f"LoRA adapter {lora.lora_name!r}: layer {i} {module} does not fit the model ({e})") from None
        self.slot_ids[slot] = lora.lora_int_id


def _write(lin: LinearBase, slot: int, shard, a: torch.Tensor, b: torch.Tensor, R: int) -> None:
    """A [r, in] and B [out, r] (full checkpoint shapes) into `lin`'s slot, this rank's shards only: column-parallel
    layers keep all of A and their rows of B (the base weight's loader cuts them), row-parallel ones their columns
    of A and all of B."""
    r = a.shape[0]
    dt = lin.lora_a.dtype
    if not isinstance(lin, RowParallelLinear):
        i = [s for s, _ in lin.lora_slices].index(shard)
        dst = lin.lora_a[slot, i * R:i * R + r]
        if a.shape[1] != dst.shape[1]:
            raise ValueError(f"lora_A has {a.shape[1]} input columns, the layer {dst.shape[1]}")
        dst.copy_(a.to(dt))
        padded = torch.zeros(b.shape[0], R, dtype=dt)
        padded[:, :r] = b.to(dt)
        lin.weight_loader(lin.lora_b[slot], padded, shard)
    else:
        padded = torch.zeros(R, a.shape[1], dtype=dt)
        padded[:r] = a.to(dt)
        lin.weight_loader(lin.lora_a[slot], padded)
        dst = lin.lora_b[slot, :, :r]
        if b.shape[0] != dst.shape[0]:
            raise ValueError(f"lora_B has {b.shape[0]} output rows, the layer {dst.shape[0]}")
        dst.copy_(b.to(dt))
