"""testbed: one scheduler, block manager and DP coordinator, run in simulation or on real workers."""

__version__ = "0.1.0"
COMMAND_ENV = "TESTBED_COMMAND"  # the running `testbed` command, which the processes it starts inherit


def warn(message: str) -> None:
    """One warning line on stderr, prefixed by the running command (`testbed serve: warning: ...`, also from
    the engine process a server started): the CLI names its command in TESTBED_COMMAND."""
    import os
    import sys
    print(f"{os.environ.get(COMMAND_ENV) or 'testbed'}: warning: {message}", file=sys.stderr, flush=True)

# vLLM's top-level names (and testbed's sweep), imported on first use (the simulator needs no torch)
_LAZY = {"LLM": "testbed.entrypoints.llm", "SamplingParams": "testbed.engine.params", "PoolingParams": "testbed.engine.params",
         "BeamSearchParams": "testbed.engine.params", "BeamSearchOutput": "testbed.outputs",
         "BeamSearchSequence": "testbed.outputs",
         "RequestOutput": "testbed.outputs", "CompletionOutput": "testbed.outputs", "RequestMetrics": "testbed.outputs",
         "Logprob": "testbed.outputs", "EmbeddingOutput": "testbed.outputs", "EmbeddingRequestOutput": "testbed.outputs",
         "LoRARequest": "testbed.engine.lora", "sweep": "testbed.sim.sweeps"}


def __getattr__(name: str):
    # `from testbed import LLM, SamplingParams, RequestOutput` without importing torch for sim-only users.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
