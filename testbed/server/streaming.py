"""HTTP plumbing of generation responses: SSE framing, and client-disconnect handling.

A streaming response closes its generator however it ends, so the generator's `finally` aborts
the unfinished core requests; a non-streaming one races the generation against the client's
disconnect and cancels the generation (which aborts) when the client leaves first.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from testbed.server.schemas import APIError
from testbed.server.serving import GenerationRun

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """text/event-stream whose body generator is always closed (its cleanup runs on disconnect too)."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


async def event_stream(run: GenerationRun, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Frame a generator of chunks: an error becomes an error event; [DONE] ends every stream that
    was not cancelled; the run is aborted whatever happens."""
    try:
        async for chunk in chunks:
            yield chunk
        yield DONE
    except APIError as e:
        yield sse(e.body())
        yield DONE
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
