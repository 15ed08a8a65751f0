"""The offline entrypoints: the LLM class (llm.py, vLLM's offline API; dp_llm.py runs its replicas as engine
processes through runtime/; llm_args.py maps its keyword arguments to the engine config) and `testbed replay`
(replay.py: a trace through the real engine, written as a run directory). `from testbed import LLM` imports it
lazily. The HTTP server (testbed/server/) is the other entrypoint; neither imports the other."""
