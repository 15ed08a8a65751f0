"""An engine process's record log (`--log-steps DIR`): the core's step, request and other records appended as JSON
lines to DIR/{kind}{suffix}.jsonl.

The loop hands records over between steps (`take`: the core gets a fresh Recorder, the filled one waits here) and
writes them while the device runs the next step (`write`, EngineStepper.while_device_runs), so the encoding and
the file writes sit neither between one step's update and the next schedule nor on another thread: a thread's
Python work takes the GIL from the loop at every torch call of its step (each releases and retakes it), which
made a data-parallel replica's GPU steps 5-12% longer than a single engine's (benchmarks/RESULTS.md, "Data
parallelism").

Formats: a row a line (`steps`, `requests`, `adds`, `reports`, `grammars`, `loras`: [request id, adapter]); `itl`
is one line a step, the step's inter-token latencies as a list (readers extend by each line's values).
Invariants: rows of one kind are written in the order they were handed over; `close()` writes and flushes
everything handed over; files are flushed at least every `flush_interval_s` of writes (a killed process loses
at most that much).
"""
from __future__ import annotations

import time
from pathlib import Path

import msgspec

from testbed.engine.metrics import Recorder

_encode = msgspec.json.Encoder().encode


class RecordLog:
    """Appends rows of `kinds` to DIR/{kind}{suffix}.jsonl, in `write` calls; a Recorder handed over by `take`
    gives its steps, requests, itl, grammars and loras, each written where this log has that kind."""

    def __init__(self, directory: str, suffix: str = "", kinds: tuple[str, ...] = ("steps", "requests"),
                 flush_interval_s: float = 0.1) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.files = {k: open(d / f"{k}{suffix}.jsonl", "ab") for k in kinds}
        self.flush_interval_s = flush_interval_s
        self._pending: list[tuple[str, object]] = []
        self._flushed = time.monotonic()

    def append(self, kind: str, rows: list) -> None:
        """Queue `rows` (a list the caller no longer changes) for DIR/{kind}."""
        if rows:
            self._pending.append((kind, rows))

    def take(self, core) -> None:
        """Hand the core's records over; the core records on into a fresh Recorder."""
        rec = core.records
        if rec.steps or rec.requests or rec.itl or rec.grammars:
            core.records = Recorder(step_extra=rec.step_extra)
            self._pending.append(("records", rec))

    def write(self, flush: bool = False) -> None:
        """Write what was handed over (a step's worth: a few encodes of whole lists, no per-row Python loop for
        the itl samples); flush when `flush`, or once `flush_interval_s` passed since the last flush."""
        pending, self._pending = self._pending, []
        for kind, rows in pending:
            if kind == "records":
                self._write_records(rows)
            else:
                self._write(kind, rows)
        if flush or (pending and time.monotonic() - self._flushed >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        for f in self.files.values():
            f.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        """Write and flush everything handed over, then close the files."""
        try:
            self.write(flush=True)
        finally:
            for f in self.files.values():
                f.close()

    def _write_records(self, rec: Recorder) -> None:
        self._write("steps", rec.steps)
        self._write("requests", rec.requests)
        f = self.files.get("itl")
        if f is not None and rec.itl:
            f.write(_encode(list(rec.itl)) + b"\n")
        self._write("grammars", rec.grammars)
        self._write("loras", list(rec.loras.items()))

    def _write(self, kind: str, rows) -> None:
        f = self.files.get(kind)
        if f is not None and rows:
            f.write(b"\n".join(map(_encode, rows)) + b"\n")


def hand_over(core, log: RecordLog | None) -> None:
    """After a step of an engine process: the core's records go to `log` (written while the device runs the next
    step, or before the loop waits idle), or are dropped where nothing logs them (a server runs for days: the core
    keeps no history)."""
    if log is not None:
        log.take(core)
    rec = core.records
    for rows in (rec.steps, rec.requests, rec.itl, rec.grammars, rec.loras):
        rows.clear()
