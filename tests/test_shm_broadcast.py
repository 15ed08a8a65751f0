"""The shared-memory command ring of tensor parallelism (worker/shm_broadcast.py) between real processes:
every reader gets every message intact and in order, messages larger than a slot cross in several slots, the
writer never overwrites a slot a reader has not read (a ring of 2 slots, a slow reader), and a reader whose
writer is gone stops waiting."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from testbed.worker.shm_broadcast import ShmBroadcast

pytestmark = pytest.mark.timeout(120)


def _reader(spec, rank: int, n: int, delay: float, out) -> None:
    ring = ShmBroadcast.attach(spec)
    got = []
    for _ in range(n):
        msg = ring.recv(rank)
        got.append((len(msg), int(np.frombuffer(msg, dtype=np.uint8).astype(np.int64).sum())))
        time.sleep(delay)
    out.put((rank, got))


def _messages(sizes: list[int], seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in sizes]


def _broadcast(sizes: list[int], num_slots: int, slot_bytes: int, delays: tuple[float, ...], seed: int = 0) -> None:
    ctx = mp.get_context("spawn")
    ring = ShmBroadcast.create(len(delays), num_slots, slot_bytes)
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(ring.spec, r, len(sizes), d, out)) for r, d in enumerate(delays)]
    for p in procs:
        p.start()
    try:
        msgs = _messages(sizes, seed)
        for m in msgs:
            ring.send(m, check=lambda: None)
        want = [(len(m), int(np.frombuffer(m, dtype=np.uint8).astype(np.int64).sum())) for m in msgs]
        results = dict(out.get(timeout=60) for _ in procs)
        assert results == {r: want for r in range(len(delays))}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        ring.unlink()


@settings(max_examples=5, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=12), st.integers(2, 4))
def test_every_reader_gets_every_message_in_order(sizes, num_slots):
    """Sizes up to 5x the slot: multi-slot messages, and more messages than slots (the ring wraps)."""
    _broadcast(sizes, num_slots, slot_bytes=1024, delays=(0.0, 0.0))


def test_a_slow_reader_is_never_overrun():
    """Two slots, 20 messages, one reader sleeping after each: the writer waits for it instead of overwriting."""
    _broadcast([3000] * 10 + [10] * 10, num_slots=2, slot_bytes=1024, delays=(0.0, 0.02), seed=1)


def test_writer_waiting_on_a_full_ring_runs_its_check():
    ring = ShmBroadcast.create(1, num_slots=2, slot_bytes=64)
    try:
        calls = []

        def check() -> None:
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("reader died")

        ring.send(b"a", check=check)
        ring.send(b"b", check=check)
        with pytest.raises(RuntimeError, match="reader died"):
            ring.send(b"c", check=check)  # nobody reads: the ring stays full
    finally:
        ring.unlink()


def test_reader_stops_when_the_writer_is_gone():
    ring = ShmBroadcast.create(1, num_slots=2, slot_bytes=64)
    reader = ShmBroadcast.attach(ring.spec)
    ring.unlink()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="writer"):
        reader.recv(0, alive=lambda: time.monotonic() - start < 1.5)
    assert time.monotonic() - start < 5
    assert not os.path.exists(ring.path)
