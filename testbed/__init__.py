"""testbed: one scheduler, block manager and DP coordinator, run in simulation or on real workers."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from testbed import LLM, SamplingParams` without importing torch for sim-only users.
    if name == "SamplingParams":
        from testbed.engine.request import SamplingParams
        return SamplingParams
    if name == "sweep":
        from testbed.sweeps import sweep
        return sweep
    if name == "LLM":
        from testbed.llm import LLM
        return LLM
    raise AttributeError(name)
