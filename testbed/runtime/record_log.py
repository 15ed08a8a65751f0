"""An engine process's record log (`--log-steps DIR`): the core's step, request and other records appended as JSON
lines to DIR/{kind}{suffix}.jsonl, encoded and written on a thread of its own.

The engine loop only hands records over (`take`: the core gets a fresh Recorder, the filled one goes to the
writer), so neither the encoding nor the file writes sit between one step's update and the next schedule. Under
data parallelism that gap is every replica's, on the critical path of every step: encoding a batch's rows on the
loop cost a replica 0.1-0.3 ms a step at batch 256 (benchmarks/RESULTS.md, "Data parallelism").

Invariants: rows of one kind are written in the order they were handed over; `close()` returns once every row
handed over before it is on disk (a replica's records are read back after it exits); the writer never touches
a Recorder the loop still fills.
"""
from __future__ import annotations

import queue
import sys
import threading
from pathlib import Path

import msgspec

from testbed.engine.metrics import Recorder

_encode = msgspec.json.Encoder().encode


def _lines(rows) -> bytes:
    return b"".join([_encode(r) + b"\n" for r in rows])


class RecordLog:
    """Appends rows of `kinds` to DIR/{kind}{suffix}.jsonl from a writer thread. A Recorder handed over by `take`
    gives its steps, requests, itl (one `[seconds]` row a sample), grammars and loras (`[request id, adapter]`
    rows), each written where this log has that kind."""

    def __init__(self, directory: str, suffix: str = "", kinds: tuple[str, ...] = ("steps", "requests")) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.files = {k: open(d / f"{k}{suffix}.jsonl", "ab") for k in kinds}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, name="record-log", daemon=True)
        self._thread.start()

    def append(self, kind: str, rows: list) -> None:
        """Queue `rows` (a list the caller no longer changes) for DIR/{kind}."""
        if rows:
            self._queue.put((kind, rows))

    def take(self, core) -> None:
        """Hand the core's records over to the writer; the core records on into a fresh Recorder."""
        rec = core.records
        if rec.steps or rec.requests or rec.itl or rec.grammars:
            core.records = Recorder(step_extra=rec.step_extra)
            self._queue.put(("records", rec))

    def close(self) -> None:
        """Write everything handed over, then close the files; raises what the writer met, if anything."""
        self._queue.put(None)
        self._thread.join()
        for f in self.files.values():
            f.close()
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # a disk error stops the log, never the engine; close() reports it
            try:
                kind, rows = item
                if kind == "records":
                    self._write_records(rows)
                else:
                    self._write(kind, rows)
            except BaseException as e:  # noqa: BLE001 - kept for close()
                self._error = e
                print(f"record log: writing {item[0]} failed, nothing more is logged: {e!r}", file=sys.stderr, flush=True)

    def _write_records(self, rec: Recorder) -> None:
        self._write("steps", rec.steps)
        self._write("requests", rec.requests)
        self._write("itl", [[x] for x in rec.itl])
        self._write("grammars", rec.grammars)
        self._write("loras", list(rec.loras.items()))

    def _write(self, kind: str, rows) -> None:
        f = self.files.get(kind)
        if f is not None and rows:
            f.write(_lines(rows))
            f.flush()
