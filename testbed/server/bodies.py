"""Request bodies validated without stalling the event loop: ThreadedBodyRoute (a route whose JSON body is
validated from its bytes, on a thread when it is large) and LargeBodies (the one thread of bodies over
LARGE_BODY, and the garbage collector's pause while any such body is alive).

pydantic holds the GIL for the whole of a body's build, and nothing else in the process runs meanwhile.
A body of hundreds of thousands of small items (messages, id lists, logit_bias entries) takes about 0.3-0.5 s
to build on a 2-core x86 machine and a fifth of that to free; the cyclic collector walks its objects once or
more while they are young, each walk costing about as much as the freeing. Done beside each other (two bodies
at once, a collection over one while another is built, the event loop freeing one) these added up to three
bodies' build time without an answer to /health. Invariant kept here: while large bodies arrive, the event
loop waits at most about one body's build (or free) at a time.
"""
from __future__ import annotations

import asyncio
import gc
import json
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

LARGE_BODY = 1 << 20  # bytes: a request body validated on LargeBodies' thread
SMALL_BODY = 32 << 10  # bytes: a request body validated on the event loop (tens of microseconds, no thread hop)
T = TypeVar("T")


class LargeBodies:
    """One thread that builds the request bodies over LARGE_BODY one at a time and frees them again once their
    request's endpoint is done, with the cyclic garbage collector off from the first one's build until the last
    one is freed. Freed by reference counting on that thread, their objects never reach a collection, and
    neither the build nor the free runs beside another one or on the event loop. Only this thread turns the
    collector off and on (`alive` is its own): the collector is back on (if it was) whenever no large body is
    alive; reference cycles made meanwhile elsewhere are collected then."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="large-body")
        self.alive = 0  # bodies built and not yet freed
        self.collector_was_on = False

    async def build(self, validate: Callable[[bytes], Any], body: bytes) -> list:
        """[validate(body)], built on the thread: a one-item list for `serve`, which empties it there."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._build, validate, body)

    async def serve(self, held: list, endpoint: Callable[[Any], Awaitable[T]]) -> T:
        """await endpoint(the built body); then `held` is emptied on the thread, raised or not, after an error's
        frames let go of the body (drop_locals), so its objects are freed there."""
        try:
            return await endpoint(held[0])
        except BaseException as e:
            drop_locals(e)
            raise
        finally:
            self.pool.submit(self._free, held)

    def _build(self, validate: Callable[[bytes], Any], body: bytes) -> list:
        if self.alive == 0:
            self.collector_was_on = gc.isenabled()
            gc.disable()
        self.alive += 1
        try:
            return [validate(body)]
        except BaseException:
            self._gone()  # what pydantic had built is freed already
            raise

    def _free(self, held: list) -> None:
        held.clear()
        self._gone()

    def _gone(self) -> None:
        self.alive -= 1
        if self.alive == 0 and self.collector_was_on:
            gc.enable()


def drop_locals(error: BaseException, seen: set[int] | None = None) -> None:
    """Clears the local variables of the finished frames in `error`'s traceback (and its causes' and contexts'),
    keeping their code and line numbers: the request body an endpoint's frames held is then no longer
    reachable from an error that the app's handlers drop on the event loop."""
    seen = set() if seen is None else seen
    seen.add(id(error))
    traceback.clear_frames(error.__traceback__)
    for linked in (error.__cause__, error.__context__):
        if linked is not None and id(linked) not in seen:
            drop_locals(linked, seen)


class ThreadedBodyRoute(APIRoute):
    """A route whose JSON body (up to --max-request-bytes) is parsed and validated straight from its bytes
    (pydantic-core's model_validate_json), then handed to the endpoint as (model, request): on the event loop up
    to SMALL_BODY (an ordinary request: tens of microseconds, cheaper than a thread hop under a burst), on a
    thread above it, and above LARGE_BODY on LargeBodies' one thread (see there), which frees the body again when
    the endpoint has returned or raised. The signature, and so the OpenAPI document and its request schemas, stay
    FastAPI's; an invalid body is the same RequestValidationError (a 400)."""

    def get_route_handler(self):
        model, endpoint = self.body_field.field_info.annotation, self.endpoint

        def validate(body: bytes):
            try:
                return model.model_validate_json(body)
            except ValidationError as e:
                if not any(err["type"] == "json_invalid" for err in e.errors(include_input=False)):
                    raise
                error = e
            try:  # Python's parser takes what pydantic's refuses (lone surrogates): the model then names the field
                data = json.loads(body)
            except (ValueError, RecursionError):
                raise error from None
            return model.model_validate(data)

        async def handler(request: Request) -> Response:
            body = await request.body()
            bodies: LargeBodies | None = request.app.state.server.large_bodies if len(body) > LARGE_BODY else None
            try:
                if bodies is not None:
                    held = await bodies.build(validate, body)
                elif len(body) > SMALL_BODY:
                    req = await asyncio.to_thread(validate, body)
                else:  # a burst of ordinary requests reaches the engine without a thread hop each
                    req = validate(body)
            except ValidationError as e:
                raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                              for err in e.errors(include_input=False)]) from None
            if bodies is not None:
                return await bodies.serve(held, lambda built: endpoint(built, request))
            return await endpoint(req, request)
        return handler
