"""Real-mode worker side: Llama-family model on tensor-parallel layers, weight loader, bundled SmolLM2.

Names are imported lazily so that `import testbed.worker.smollm2` (and sim-only users) need no torch.
"""

_EXPORTS = {
    "LlamaForCausalLM": "testbed.worker.model", "ModelConfig": "testbed.worker.model",
    "SUPPORTED_ARCHITECTURES": "testbed.worker.model",
    "load_model": "testbed.worker.loader", "load_tokenizer": "testbed.worker.loader",
    "default_model_dir": "testbed.worker.smollm2",
    "get_context": "testbed.worker.context", "set_context": "testbed.worker.context",
    "reset_context": "testbed.worker.context",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'testbed.worker' has no attribute {name!r}")
