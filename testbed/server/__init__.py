"""`testbed serve`: the OpenAI-compatible HTTP layer (FastAPI + uvicorn) over the engine processes of
testbed/runtime/. HTTP only: no ZMQ here.

api.py (routes; bodies.py validates large request bodies off the event loop) -> completions.py / chat.py /
embeddings.py (request shapes; params.py turns a body into SamplingParams) -> serving.py (GenerationRun:
choices, detokenizer, stop strings, metrics.py) -> the engine client of testbed/runtime/ (client.py, or
dp_client.py with data parallelism). serve.py launches it all; the `testbed bench serve` client is testbed/bench/.
"""


def run_event_loop(main):
    """Run a coroutine on uvloop when it is installed (as vLLM's server does), else on asyncio's loop:
    the API server and the bench client do Python work per streamed event, and uvloop halves the
    loop's share of it."""
    try:
        from uvloop import run
    except ImportError:
        from asyncio import run
    return run(main)
