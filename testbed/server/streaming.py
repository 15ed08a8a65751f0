"""HTTP plumbing of generation responses: SSE framing, and client-disconnect handling.

A streaming response closes its generator however it ends, so the generator's `finally` aborts
the unfinished core requests; a non-streaming one races the generation against the client's
disconnect and cancels the generation (which aborts) when the client leaves first.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from testbed.server.schemas import APIError
from testbed.server.serving import GenerationRun

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class EventFramer:
    """The SSE events of one stream, `data: {**head, "choices": [choice]}`: byte for byte what sse() gives, with
    the constant head (id, object, created, model) encoded once per stream instead of once per event."""

    def __init__(self, head: dict[str, Any]) -> None:
        whole = msgspec.json.encode({**head, "choices": []})  # ...,"choices":[]}
        self.prefix = b"data: " + whole[:-2]

    def event(self, choice: dict[str, Any]) -> bytes:
        return self.prefix + msgspec.json.encode(choice) + b"]}\n\n"


async def wakeup_chunks(run: GenerationRun, head: dict[str, Any], usage: bool,
                        events_of: Callable[[Any], list[bytes]]) -> AsyncIterator[bytes]:
    """A stream's chunks, one per wakeup: the events `events_of` makes for each choice that moved in the outputs
    applied at once (a token, text or its end), and the usage event (`usage`) once the run is done, in one write."""
    while not run.done:
        events: list[bytes] = []
        for c in await run.next():
            if c.delta_ids or c.delta_text or c.finished:
                events += events_of(c)
        if run.done and usage:
            events.append(sse({**head, "choices": [], "usage": run.usage()}))
        if events:
            yield b"".join(events)


class LastChunk(bytes):
    """A stream's final bytes: SSEResponse ends the HTTP body with them, in one write."""


class SSEResponse(StreamingResponse):
    """text/event-stream whose body generator is always closed (its cleanup runs on disconnect too).

    One write per chunk as it comes (a chunk is whatever a stream had ready at one wakeup: no event waits for
    another); the LastChunk ends the body in the same write. The body streams in a task of its own, beside a task
    that waits for the client's disconnect and then cancels it: each token then resumes only the stream's few
    frames, not the request's whole ASGI middleware stack, and plain asyncio tasks cost less than Starlette's
    anyio task group."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> None:
        """`on_close` runs however the response ends, even if the stream was cancelled before it began (a
        generator that never started runs no `finally`)."""
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def until_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(until_disconnect())
        try:
            await asyncio.wait((streaming, watcher), return_when=asyncio.FIRST_COMPLETED)
            if streaming.done():
                streaming.result()  # raises what the stream raised
        finally:
            watcher.cancel()
            if not streaming.done():  # the client left (or this request was cancelled): stop the stream
                streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
            await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()

    async def stream_response(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                last = isinstance(chunk, LastChunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone (ASGI servers of spec 2.4 raise it from send)


async def event_stream(run: GenerationRun, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Frame a generator of chunks: an error becomes an error event; [DONE] ends every stream that
    was not cancelled; the run is aborted whatever happens. Chunks that come once the run is done (its
    last events, usage) need no more waiting: they go out with [DONE] as one LastChunk."""
    try:
        tail: list[bytes] = []
        try:
            async for chunk in chunks:
                if run.done:
                    tail.append(chunk)
                else:
                    yield chunk
            tail.append(DONE)
        except APIError as e:
            tail += [sse(e.body()), DONE]
        yield LastChunk(b"".join(tail))
    finally:
        run.abort()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(run: GenerationRun, request: Request) -> bool:
    """Run to the end unless the client disconnects first (then abort); False when it did."""
    gen = asyncio.ensure_future(run.run_to_end())
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((gen, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gen.done():
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
    if gen.cancelled():
        return False
    gen.result()  # raises the generation's APIError
    return True


def client_closed_response() -> Response:
    return Response(status_code=499)
