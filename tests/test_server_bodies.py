"""LargeBodies and drop_locals (testbed/server/bodies.py): a large request body is freed on its own thread once
its endpoint is done, raised or not, and the garbage collector is off exactly while such a body is alive."""
from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from testbed.server.bodies import LargeBodies, drop_locals


class Item:
    """A body's object that notes the thread that frees it."""
    freed: list[str] = []

    def __del__(self) -> None:
        Item.freed.append(threading.current_thread().name)


def build(_: bytes) -> list[Item]:
    return [Item() for _ in range(100)]


async def refusing_endpoint(body: list[Item]) -> None:
    items = body  # a frame of the endpoint holds the body when it raises, as a handler's would
    raise ValueError(f"refused: {len(items)} items")


async def handle(bodies: LargeBodies, endpoint, release: asyncio.Event | None = None):
    """ThreadedBodyRoute's path for a large body: built, then served to `endpoint` (after `release`, if given)."""
    held = await bodies.build(build, b"{}")

    async def call(body: list[Item]):
        if release is not None:
            await release.wait()
        return await endpoint(body)
    return await bodies.serve(held, call)


def test_a_refused_large_body_is_freed_on_its_thread_and_the_collector_is_back_on() -> None:
    Item.freed.clear()
    bodies = LargeBodies()
    assert gc.isenabled()

    async def scenario() -> None:
        with pytest.raises(ValueError, match="refused: 100 items") as e:
            await handle(bodies, refusing_endpoint)
        # the thread empties its list while the error is still held here: only drop_locals makes that list the
        # body's last reference; the error (its traceback) then goes away on this thread, as the app drops it
        await asyncio.get_running_loop().run_in_executor(bodies.pool, lambda: None)
        del e
    asyncio.run(scenario())
    bodies.pool.submit(lambda: None).result()
    assert Item.freed == ["large-body_0"] * 100
    assert gc.isenabled() and bodies.alive == 0


def test_the_collector_stays_off_until_the_last_of_two_bodies_is_freed() -> None:
    Item.freed.clear()
    bodies = LargeBodies()

    async def accept(body: list[Item]) -> int:
        return len(body)

    async def scenario() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(handle(bodies, accept, first))
        b = asyncio.ensure_future(handle(bodies, accept, second))
        while bodies.alive < 2:
            await asyncio.sleep(0.001)
        assert not gc.isenabled()
        first.set()
        await a
        await asyncio.get_running_loop().run_in_executor(bodies.pool, lambda: None)
        assert not gc.isenabled() and bodies.alive == 1 and len(Item.freed) == 100
        second.set()
        await b
    asyncio.run(scenario())
    bodies.pool.submit(lambda: None).result()
    assert gc.isenabled() and bodies.alive == 0
    assert Item.freed == ["large-body_0"] * 200


def test_a_body_that_fails_to_build_turns_the_collector_back_on() -> None:
    bodies = LargeBodies()

    def invalid(_: bytes):
        raise ValueError("not JSON")

    with pytest.raises(ValueError, match="not JSON"):
        asyncio.run(bodies.build(invalid, b"{"))
    assert gc.isenabled() and bodies.alive == 0


def test_drop_locals_keeps_the_traceback_lines() -> None:
    import traceback

    def inner(body):
        raise KeyError("x") from ValueError("cause")
    try:
        inner([Item()])
    except KeyError as e:
        drop_locals(e)
        text = "".join(traceback.format_exception(e))
        assert "inner" in text and "cause" in text
        assert e.__traceback__.tb_next.tb_frame.f_locals == {}
