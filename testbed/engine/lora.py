"""LoRA adapters in the engine: the request's adapter (LoRARequest, vLLM's names) and where adapters live.

The engine decides, in both modes alike, which adapter sits in which of the `max_loras` device slots and
which adapters the host keeps (an LRU of `max_cpu_loras`), so the simulator charges exactly the loads real
mode performs. `AdapterSlots.assign` runs once per scheduled step; its invariants: every adapter of the step
holds a slot; a slot changes hands only when no row of the step uses its adapter; the host cache never holds
more than `max_cpu_loras` adapters (the least recently used leaves first).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter a request runs with, as vLLM names it: `lora_name` (what clients call it), `lora_int_id`
    (a positive integer unique per adapter: two requests with the same id share one slot) and `lora_path`
    (a PEFT folder: adapter_config.json + adapter_model.safetensors). In the simulator the path may be empty."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1 (0 is the base "
                             f"model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a string, got {self.lora_path!r}")

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """An adapter the worker puts into device slot `slot` before the step runs; `from_disk`: the host cache
    does not hold it (read its folder first), else it is copied from the host."""

    slot: int
    lora: LoRARequest
    from_disk: bool


class AdapterSlots:
    """The device slots and host LRU of one engine (see the module docstring)."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot
        self.lru: OrderedDict[int, None] = OrderedDict()  # adapters in slots, least recently used first
        self.host: OrderedDict[int, None] = OrderedDict()  # adapters in the host cache, least recently used first
        self.num_loads = self.num_disk_loads = 0

    def assign(self, loras: list[LoRARequest | None]) -> tuple[list[int], list[LoRALoad], list[int]]:
        """(slot per row, -1 for base rows; the loads this step needs; adapter ids the host cache drops) for a
        step whose rows run these adapters. ValueError when the step has more than max_loras adapters (the
        scheduler never forms one)."""
        step: dict[int, LoRARequest] = {}
        for lr in loras:
            if lr is not None and lr.lora_int_id not in step:
                step[lr.lora_int_id] = lr
        if len(step) > self.max_loras:
            raise ValueError(f"a step with {len(step)} adapters exceeds max_loras={self.max_loras}")
        loads: list[LoRALoad] = []
        dropped: list[int] = []
        for aid, lr in step.items():
            if aid in self.slot_of:
                self.lru.move_to_end(aid)
                if aid in self.host:  # an adapter in use is the last the host cache drops
                    self.host.move_to_end(aid)
                continue
            if len(self.slot_of) < self.max_loras:
                slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
            else:  # the least recently used slot whose adapter this step does not run (one exists: see above)
                victim = next(a for a in self.lru if a not in step)
                slot = self.slot_of.pop(victim)
                del self.lru[victim]
            self.slot_of[aid] = slot
            self.lru[aid] = None
            from_disk = aid not in self.host
            if from_disk:
                self.host[aid] = None
                while len(self.host) > self.max_cpu_loras:
                    dropped.append(self.host.popitem(last=False)[0])
                self.num_disk_loads += 1
            else:
                self.host.move_to_end(aid)
            self.num_loads += 1
            loads.append(LoRALoad(slot, lr, from_disk))
        slots = [-1 if lr is None else self.slot_of[lr.lora_int_id] for lr in loras]
        return slots, loads, dropped
