"""Rank 0's commands to the other tensor-parallel ranks, through a ring of slots in shared host memory.

Rank 0 writes each command (a few integers and a byte payload: a step's packed inputs) once; every other rank
reads it on the host, so a rank prepares step k+1 while its GPU still runs step k and no device sync or
collective stands between the scheduler and a rank's launch (vLLM's shared-memory message queue works the same
way). A message larger than a slot takes consecutive slots.

Layout of the mapped file: one 64-byte line per reader holding the last sequence number it has read, then
`num_slots` slots of [sequence number, payload bytes, payload]. Invariants: the writer fills the slot of
message q only after every reader has read message q - num_slots (so it never overwrites an unread slot), and
stores the slot's sequence number after its payload, so a reader that sees number q sees the whole payload
(stores are not reordered on x86-64, the platform the GPUs run on; Python issues the two stores as separate
statements).
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from typing import Callable

import numpy as np

LINE = 64
SLOT_HEADER = 16
SPIN_S = 1e-4  # readers spin this long before they start yielding and then sleeping


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class ShmBroadcast:
    """One writer (rank 0, `create`) and `num_readers` readers (ranks 1.., `attach`)."""

    def __init__(self, path: str, num_readers: int, num_slots: int, slot_bytes: int, create: bool) -> None:
        self.path, self.num_readers, self.num_slots, self.slot_bytes = path, num_readers, num_slots, slot_bytes
        self.size = LINE * num_readers + num_slots * (SLOT_HEADER + slot_bytes)
        if create:
            with open(path, "wb") as f:
                f.truncate(self.size)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), self.size)
        buf = np.frombuffer(self._map, dtype=np.uint8)
        self._acks = [buf[LINE * r: LINE * r + 8].view(np.int64) for r in range(num_readers)]
        base = LINE * num_readers
        step = SLOT_HEADER + slot_bytes
        self._seqs = [buf[base + i * step: base + i * step + 8].view(np.int64) for i in range(num_slots)]
        self._lens = [buf[base + i * step + 8: base + i * step + 16].view(np.int64) for i in range(num_slots)]
        self._data = [buf[base + i * step + SLOT_HEADER: base + (i + 1) * step] for i in range(num_slots)]
        self._next = 1  # sequence number of the next message written (writer) or read (reader)

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> "ShmBroadcast":
        fd, path = tempfile.mkstemp(prefix="testbed-tp-", dir=_shm_dir())
        os.close(fd)
        return cls(path, num_readers, num_slots, slot_bytes, create=True)

    @classmethod
    def attach(cls, spec: tuple[str, int, int, int]) -> "ShmBroadcast":
        path, num_readers, num_slots, slot_bytes = spec
        return cls(path, num_readers, num_slots, slot_bytes, create=False)

    @property
    def spec(self) -> tuple[str, int, int, int]:
        """What a reader needs to attach."""
        return self.path, self.num_readers, self.num_slots, self.slot_bytes

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid): once every reader has attached, or at shutdown."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---- writer ----------------------------------------------------------------------------------
    def send(self, payload: bytes | memoryview | np.ndarray, check: Callable[[], None] | None = None) -> None:
        """Write one message (taking as many slots as it needs); `check` runs every 10 ms while a slot is
        still unread (it raises when a reader died, so the writer never waits forever)."""
        data = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload.view(np.uint8)
        total = data.size
        chunks = max(1, -(-total // self.slot_bytes))
        for c in range(chunks):
            seq = self._next
            slot = seq % self.num_slots
            self._wait_free(seq, check)
            part = data[c * self.slot_bytes: (c + 1) * self.slot_bytes]
            self._data[slot][:part.size] = part
            self._lens[slot][0] = total if c == 0 else part.size
            self._seqs[slot][0] = seq
            self._next += 1

    def _wait_free(self, seq: int, check: Callable[[], None] | None) -> None:
        oldest = seq - self.num_slots
        if oldest < 1:
            return
        next_check = time.monotonic() + 0.01
        while min(int(a[0]) for a in self._acks) < oldest:
            if check is not None and time.monotonic() >= next_check:
                check()
                next_check = time.monotonic() + 0.01
            time.sleep(0)

    # ---- readers ---------------------------------------------------------------------------------
    def recv(self, reader: int, alive: Callable[[], bool] | None = None) -> bytes:
        """The next message, waited for: spinning first, then yielding, then sleeping up to 2 ms; `alive` is
        asked about once a second while idle and ends the wait (RuntimeError) when it says no."""
        first, total = self._read_slot(reader, alive)
        parts = [first]
        got = len(first)
        while got < total:
            part, _ = self._read_slot(reader, alive)
            parts.append(part)
            got += len(part)
        return first if len(parts) == 1 else b"".join(parts)

    def _read_slot(self, reader: int, alive: Callable[[], bool] | None) -> tuple[bytes, int]:
        """(this slot's bytes, the length its header gives: the whole message's in a first slot)."""
        seq = self._next
        slot = seq % self.num_slots
        start = time.monotonic()
        next_alive = start + 1.0
        while int(self._seqs[slot][0]) != seq:
            now = time.monotonic()
            idle = now - start
            if idle > SPIN_S:
                time.sleep(0 if idle < 0.05 else min(0.002, idle / 100))
            if alive is not None and now >= next_alive:
                if not alive():
                    raise RuntimeError("the tensor-parallel writer (rank 0) is gone")
                next_alive = now + 1.0
        declared = int(self._lens[slot][0])
        out = self._data[slot][:min(declared, self.slot_bytes)].tobytes()
        self._acks[reader][0] = seq
        self._next += 1
        return out, declared
