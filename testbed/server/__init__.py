"""`testbed serve`: an OpenAI-compatible API server (FastAPI + uvicorn) over an engine-core process.

api.py (routes) -> completions.py / chat.py (request shapes) -> serving.py (GenerationRun: choices,
detokenizer.py, stop strings, metrics.py) -> client.py (ZMQ client, per-request queues) ==ZMQ +
msgspec (protocol.py)==> engine_proc.py (EngineCore + executor loop). serve.py launches both;
bench.py is the `testbed bench serve` client.
"""
