"""testbed: one scheduler, block manager and DP coordinator, run in simulation or on real workers."""

__version__ = "0.1.0"

# vLLM's top-level names (and testbed's sweep), imported on first use (the simulator needs no torch)
_LAZY = {"LLM": "testbed.llm", "SamplingParams": "testbed.engine.request", "PoolingParams": "testbed.engine.request",
         "RequestOutput": "testbed.outputs", "CompletionOutput": "testbed.outputs", "RequestMetrics": "testbed.outputs",
         "Logprob": "testbed.outputs", "EmbeddingOutput": "testbed.outputs", "EmbeddingRequestOutput": "testbed.outputs",
         "sweep": "testbed.sweeps"}


def __getattr__(name: str):
    # `from testbed import LLM, SamplingParams, RequestOutput` without importing torch for sim-only users.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
