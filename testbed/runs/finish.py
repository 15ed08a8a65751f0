"""The envelope every run shares, whichever mode made it (`testbed simulate`, `testbed replay`): its arguments
checked before any work starts (start_run), then its summary computed from its records and its run directory
written with the manifest (finish_run). Invariant: a run that fails its checks has done no work, and a summary
printed is the summary written."""
from __future__ import annotations

from pathlib import Path

from testbed.engine.metrics import Recorder, check_slos, summarize
from testbed.runs.rundir import check_output, environment_info, write_run


def start_run(output: str | Path | None, slo_ttft: float | None, slo_tpot: float | None) -> None:
    """ValueError for a bad SLO or an output path that cannot take a run directory, before anything runs."""
    check_slos(slo_ttft, slo_tpot)
    if output is not None:
        check_output(output)


def trace_record(path, fmt: str, num_requests: int, request_rate: float | None, burstiness: float,
                 limit: int | None) -> dict:
    """The manifest's `trace` entry: where the requests came from and how they were drawn."""
    return {"path": str(path), "format": fmt, "num_requests": num_requests, "request_rate": request_rate,
            "burstiness": burstiness, "limit": limit}


def finish_run(records: Recorder, output: str | Path | None, manifest: dict, slo_ttft: float | None,
               slo_tpot: float | None, prefix: tuple[int, int] = (0, 0), summary_extra: dict | None = None,
               columns: tuple[dict, dict] | None = None) -> tuple[Path | None, dict]:
    """(run directory or None, summary): the run's summary from its records (`prefix`: prefix-cache queries and
    hits; `summary_extra` added to it), and, with an `output`, the run directory with `manifest` and the
    environment (host, versions, git sha). `columns`: the records' (request, step) columns where the caller has
    them already."""
    req_cols, step_cols = columns or (records.request_columns(), records.step_columns())

    def summary() -> dict:
        return {**summarize(req_cols, step_cols, records.itl_array(), slo_ttft, slo_tpot, *prefix), **(summary_extra or {})}
    if output is None:
        return None, summary()
    return write_run(output, {**manifest, **environment_info()}, records, summary, (req_cols, step_cols))
