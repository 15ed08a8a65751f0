"""The streamed response's framing without a server: a stream's events are one write per wakeup (a reader that fell
behind gets every queued token's event at once, still one event per token without a tokenizer), the last events
go out with [DONE] as the body's end, the per-stream event head is byte for byte sse()'s, and the inter-token
latency histogram observed in bulk shows what per-value observes show."""
import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from testbed.engine.params import SamplingParams
from testbed.runtime.protocol import CoreOutput
from testbed.server.completions import _stream
from testbed.server.metrics import TOKEN_LATENCY_BUCKETS, BatchedHistogram, ServerMetrics
from testbed.server.schemas import APIError, CompletionRequest
from testbed.server.serving import GenerationRun
from testbed.server.state import ServerState
from testbed.server.streaming import DONE, EventFramer, LastChunk, SSEResponse, event_stream, sse
from testbed.text.detokenizer import TokenTexts


class _Client:
    """Just what GenerationRun.abort calls on its engine client."""

    def abort(self, request_ids: list[str]) -> None:
        pass


def _run() -> GenerationRun:
    state = ServerState(client=_Client(), tokenizer=None, served_model_name="m", model_path="m",
                        metrics=ServerMetrics("m"), max_model_len=64, vocab_size=100, num_gpu_blocks=64,
                        block_size=16, token_texts=TokenTexts(None))
    run = GenerationRun(state, "cmpl-x", [[1, 2, 3]], SamplingParams(max_tokens=4))
    run.stream.engines.update((c.request_id, 0) for c in run.choices)
    return run


def _events(chunk: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in chunk.split(b"\n\n") if e]


def test_a_stream_that_fell_behind_gets_its_queued_tokens_in_one_write_and_ends_with_done():
    async def scenario() -> list[bytes]:
        run = _run()
        rid = run.choices[0].request_id
        req = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=4, stream=True,
                                stream_options={"include_usage": True})
        head = {"id": run.request_id, "object": "text_completion", "created": 1, "model": "m"}
        for out in (CoreOutput(rid, [5]), CoreOutput(rid, [6]), CoreOutput(rid, [7])):
            run.stream.put(out)
        chunks = event_stream(run, _stream(run, req, head, [""]))
        first = await chunks.__anext__()
        run.stream.put(CoreOutput(rid, [8], True, "length"))
        return [first] + [c async for c in chunks]

    first, last = asyncio.run(scenario())
    assert len(_events(first)) == 3 and not isinstance(first, LastChunk)  # three tokens, three events, one write
    assert isinstance(last, LastChunk)  # the final token, usage and [DONE]: the body's last write
    final, usage, done = _events(last)
    assert b'"finish_reason":"length"' in final and b'"completion_tokens":4' in usage and done == DONE


def test_an_error_goes_out_with_done_as_the_last_chunk():
    async def failing():
        yield b"data: 1\n\n"
        raise APIError(503, "engine core is dead", None, "engine_dead")

    async def scenario() -> list[bytes]:
        return [c async for c in event_stream(_run(), failing())]

    first, last = asyncio.run(scenario())
    assert first == b"data: 1\n\n" and isinstance(last, LastChunk)
    error, done = _events(last)
    assert b"engine_dead" in error and done == DONE


def test_the_response_ends_its_body_with_the_last_chunk():
    async def chunks():
        yield b"data: a\n\n"
        yield LastChunk(b"data: b\n\n" + DONE)

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    closed: list[bool] = []
    asyncio.run(SSEResponse(chunks(), lambda: closed.append(True))({"type": "http"}, receive, send))
    assert closed == [True]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [m["more_body"] for m in sent[1:]] == [True, False] and sent[2]["body"].endswith(DONE)


def test_a_disconnect_cancels_the_stream_and_closes_its_generator():
    closed = asyncio.Event()

    async def forever():
        try:
            yield b"data: a\n\n"
            await asyncio.sleep(3600)
        finally:
            closed.set()

    async def receive() -> dict:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    async def scenario() -> None:
        on_close: list[bool] = []
        await asyncio.wait_for(SSEResponse(forever(), lambda: on_close.append(True))({"type": "http"}, receive, send),
                               10)
        assert closed.is_set() and on_close == [True]

    asyncio.run(scenario())


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(head=st.dictionaries(st.text().filter(lambda k: k != "choices"), _json, max_size=4),
       choice=st.dictionaries(st.text(), _json, max_size=4))
def test_the_framers_events_are_sses_bytes(head, choice):
    assert EventFramer(head).event(choice) == sse({**head, "choices": [choice]})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False) | st.sampled_from(TOKEN_LATENCY_BUCKETS), max_size=50))
def test_bulk_observes_show_what_per_value_observes_show(values):
    one, bulk = CollectorRegistry(), CollectorRegistry()
    each = Histogram("h", "", registry=one, buckets=TOKEN_LATENCY_BUCKETS)
    batched = BatchedHistogram(Histogram("h", "", registry=bulk, buckets=TOKEN_LATENCY_BUCKETS))
    for v in values:
        each.observe(v)
        batched.observe(v)
    batched.flush()
    assert one.get_sample_value("h_count") == bulk.get_sample_value("h_count")
    assert one.get_sample_value("h_sum") == bulk.get_sample_value("h_sum")
    for le in (*TOKEN_LATENCY_BUCKETS, float("inf")):
        bound = str(float(le)) if le != float("inf") else "+Inf"
        assert one.get_sample_value("h_bucket", {"le": bound}) == bulk.get_sample_value("h_bucket", {"le": bound})
