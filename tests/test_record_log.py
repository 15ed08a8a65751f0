"""The engine processes' record log: records handed over on the loop reach the files whole and in order, written
by the log's own thread, and the core records on into a fresh Recorder."""
from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.runtime.record_log import RecordLog

KINDS = ("steps", "requests", "itl", "adds", "loras")


def _core() -> EngineCore:
    return EngineCore(EngineConfig(max_model_len=256, num_gpu_blocks=64, block_size=16))


def _read(directory: Path, kind: str, suffix: str) -> list:
    path = directory / f"{kind}{suffix}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.booleans(), st.booleans()), max_size=30))
def test_every_handed_over_row_is_written_in_order(tmp_path_factory, waves):
    """Waves of (steps, itl samples, a finished request) taken from the core, interleaved with direct appends and
    writes (as the loop writes while the device runs): after close, each file holds exactly the rows handed over,
    in the order they were; itl one line a step, its samples in order; the dp reader gets them back."""
    from testbed.entrypoints.dp_llm import read_dp_logs
    directory = tmp_path_factory.mktemp("log")
    core, log = _core(), RecordLog(str(directory), ".0", KINDS)
    want: dict[str, list] = {k: [] for k in KINDS}
    for w, (steps, samples, request, write) in enumerate(waves):
        taken = core.records
        for s in range(steps):
            row = [0, w + s / 10, 0.001, s, 0, s, 0, 0, 1, 64, 0, s, 0, 0, 0, 0, 0, 0]
            taken.steps.append(tuple(row))
            want["steps"].append(row)
        if samples:
            taken.itl.extend([w + s / 100 for s in range(samples)])
            want["itl"].append([w + s / 100 for s in range(samples)])
        if request:
            row = [f"r{w}", 0, 0, w, w, w, w, 3, 2, 0, 0, "length", w]
            taken.requests.append(tuple(row))
            taken.loras[f"r{w}"] = "sql"
            want["requests"].append(row)
            want["loras"].append([f"r{w}", "sql"])
        log.append("adds", [[f"r{w}", float(w)]])
        want["adds"].append([f"r{w}", float(w)])
        log.take(core)
        if steps or samples or request:
            assert core.records is not taken and not core.records.steps and not core.records.itl
        else:
            assert core.records is taken  # nothing to hand over: the loop keeps its Recorder
        if write:
            log.write()
    log.close()
    for kind in KINDS:
        assert _read(directory, kind, ".0") == want[kind], kind
    rec = read_dp_logs(directory, 1, 0.0, {})
    assert list(rec.itl) == [x for line in want["itl"] for x in line]
    assert [list(r) for r in rec.steps] == want["steps"]


def test_an_idle_write_flushes_and_a_step_write_flushes_at_most_every_interval(tmp_path):
    """What a reader sees on disk: a step's write is buffered until flush_interval_s passed since the last flush; a
    write with flush (the loop's, before it waits idle) puts everything on disk."""
    core, log = _core(), RecordLog(str(tmp_path), "", ("steps", "requests"), flush_interval_s=3600.0)
    core.records.steps.append((0, 0.0, 0.5))
    log.take(core)
    log.write()
    assert _read(tmp_path, "steps", "") == []  # in the file's buffer
    log.write(flush=True)
    assert _read(tmp_path, "steps", "") == [[0, 0.0, 0.5]]
    log.close()
