"""LoRA adapters named by a workload, in both modes: a trace's `lora` field names each request's adapter; here the
names become the engine's LoRARequests (ids 1, 2, ... in order of first appearance, so a simulation and a replay
of one trace give every adapter the same id), with folders from `--lora-modules name=path` where real weights
are needed."""
from __future__ import annotations

import json

from testbed.engine.config import EngineConfig
from testbed.engine.lora import LoRARequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """(name, path, base model name) of each --lora-modules value: name=path, or vLLM's JSON form
    {"name": ..., "path": ..., "base_model_name": ...}; ValueError naming the bad one."""
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
                out.append((d["name"], d["path"], d.get("base_model_name")))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {v!r} must be name=path or JSON with name and path") from None
        else:
            name, eq, path = v.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--lora-modules: {v!r} must be name=path (e.g. sql-lora=/adapters/sql)")
            out.append((name, path, None))
    return out


def trace_loras(names: list[str | None], config: EngineConfig, paths: dict[str, str] | None = None
                ) -> dict[str, LoRARequest]:
    """The LoRARequest of every adapter name in `names` (a trace's `lora` fields, None for base requests).
    ValueError when the trace names adapters and LoRA is off, or when `paths` (real mode) lacks a folder for one."""
    loras: dict[str, LoRARequest] = {}
    for name in names:
        if name is not None and name not in loras:
            if not config.enable_lora:
                raise ValueError(f"the trace names LoRA adapter {name!r} but LoRA is off; pass --enable-lora (and "
                                 "--max-loras N)")
            if paths is not None and name not in paths:
                raise ValueError(f"the trace names LoRA adapter {name!r}, which --lora-modules does not map to a "
                                 f"folder; add --lora-modules {name}=PATH")
            loras[name] = LoRARequest(name, len(loras) + 1, "" if paths is None else paths[name])
    return loras
