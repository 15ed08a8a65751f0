"""LoRA adapters in the API server (vLLM's interface): `--lora-modules name=path ...` at start, then
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` ({"lora_name", "lora_path"}); each adapter is one
more model of /v1/models, chosen by a request's `model` field. An adapter's folder is checked when it is
registered (400 with the reason: too high a rank, other target modules, no such folder); its weights are read
by the worker on first use. Ids are never reused, so an adapter unloaded and loaded again under its name is a
new adapter to the engine's caches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.engine.lora import LoRARequest
from testbed.server.schemas import APIError, bad_request
from testbed.worker.lora_config import LoRAError, read_adapter_config


@dataclass
class LoRARegistry:
    """The adapters this server serves, by name. `enabled` False: the engine runs without --enable-lora."""

    enabled: bool = False
    max_lora_rank: int = 16
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    next_id: int = 1

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter (APIError 400 when LoRA is off, the name is taken or the folder is refused)."""
        if not self.enabled:
            raise bad_request("LoRA adapters need a server started with --enable-lora", "lora_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad_request("give lora_name and lora_path, both non-empty strings", "lora_name")
        if name in self.adapters:
            raise bad_request(f"The lora adapter '{name}' has already been loaded; unload it first", "lora_name")
        try:
            read_adapter_config(path, self.max_lora_rank, name)
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        lora = LoRARequest(name, self.next_id, path, base_model_name)
        self.next_id += 1
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        del self.adapters[name]
