"""A data-parallel replica's host term per step, fitted from a DP run's own records (`testbed calibrate`).

A DP replica is its own engine process: between two steps it publishes the step's outputs to the API server,
polls its input thread's queue and sends stats reports to the coordinator, host work a single engine does not
do (the profile's `dp_replica_host`, charged per replica step by ProfiledCostModel). A real run records each
step's schedule time and the time its update began (steps.parquet: start, duration), so the time between two
steps, its gap, holds the update and that loop work. Over the decode-only steps that ran back to back,

    gap  =  u x engine term (the profile's schedule + update at the step's batch)  +  a

where `a`, the part that does not grow with the batch, is the DP term (a single engine's runs give a near 0:
0.004-0.026 ms on the 2026-11-26 H100 runs, against 0.10-0.18 ms for their DP replicas). `u` is fitted too
(the update's share of the engine term, and the loop's per-row work), held towards 1 by a ridge penalty of
RIDGE x n x (mean engine term)^2, so that a run of one narrow batch range, where u and a cannot be told apart,
gives a ~ the mean gap less one engine term; a run over many batch sizes decides u itself. A per-row part of
the DP term cannot be told from the host scale in one run, so the fit gives none (row_s 0).

A replica also pays for each request the coordinator routes to it: its input thread decodes the message and the
loop adds it to the engine before the schedule of the step that first schedules it, and after that step's update
the loop tells the API server when it was scheduled and reports its changed stats. Over every step that ran back
to back with the next,

    gap  =  c  +  u' x engine term  +  m x (the step has a prefill chunk)
            +  p x (requests the step scheduled for the first time)  +  q x (those of the next step)

by least squares, and request_s = max(0, p + q): what a request adds around the step that first schedules it,
where the simulator charges it (ProfiledCostModel.dp_admit). The gaps, not the whole cycles: a longer step lets
more requests arrive during it, all admitted by the next step when no queue holds them, so a cycle grows with the
next step's admissions whatever the intake costs. On the committed DP runs of 4 H100s (2026-11-27) request_s is
0.055-0.073 ms a request, where the same fit to a single engine's replay gives 0.000-0.015 ms (on an H100 host's Xeon a
700-token request's frame decodes in 0.076 ms, on the replica's input thread beside the step, and its add to an
engine, which a single engine pays too, takes 0.089 ms: benchmarks/dp_intake.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from testbed.sim.step_terms import DECODE_SYNC

RIDGE = 0.1  # chosen on the 2026-11-26 H100 runs: 0.03-0.3 give DP=1 runs a < 0.05 ms, DP runs 0.09-0.2 ms


@dataclasses.dataclass(frozen=True)
class DPHostFit:
    """The fitted DP term in the run's seconds (`step_s`), the gap's slope on the engine term, and the steps used."""

    step_s: float
    update_scale: float
    steps: int
    request_s: float = 0.0  # per request taken in (fit_dp_admit)
    requests: int = 0       # the requests it was fitted over

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit_dp_host(gaps: list[float], engine: list[float]) -> DPHostFit:
    """The ridge fit of the module docstring to the gaps of decode steps and their engine terms (seconds);
    ValueError when there is no gap to fit."""
    g, e = np.asarray(gaps, dtype=float), np.asarray(engine, dtype=float)
    n = len(g)
    if n == 0:
        raise ValueError("no decode step that ran back to back with the next one: the run's records hold no gap to "
                         "fit a data-parallel replica's host term to")
    w = RIDGE * n * float(e.mean()) ** 2
    A = np.array([[e @ e + w, e.sum()], [e.sum(), n]])
    u, a = np.linalg.solve(A, np.array([e @ g + w, g.sum()])) if np.linalg.det(A) > 0 else (1.0, g.mean() - e.mean())
    if a < 0.0:  # the constraint a >= 0 binds: the slope alone
        a, u = 0.0, (e @ g + w) / (e @ e + w) if e @ e + w > 0 else 0.0
    if u < 0.0:
        u, a = 0.0, max(0.0, float(g.mean()))
    return DPHostFit(float(a), float(u), n)


def with_dp_term(samples: list, step_s: float, row_s: float = 0.0, request_s: float = 0.0) -> list:
    """The StepSamples (rescale.py) with the DP term added to each step's engine term (the first of every kind's
    terms), as ProfiledCostModel adds it for a DP replica: request_s for each request the step admits."""
    if not step_s and not row_s and not request_s:
        return samples
    return [dataclasses.replace(s, terms=(s.terms[0] + step_s + row_s * s.rows + request_s * s.admitted,
                                          *s.terms[1:])) for s in samples]


def fit_dp_admit(samples: list) -> float:
    """request_s (the run's seconds) of the module docstring, fitted to the gaps of the steps that ran back to back
    with the next (in a replica's order: `admitted_next` is its next step's `admitted`); 0.0 when no step took a
    request in, or the fit's sum is negative."""
    used = [s for s in samples if s.gap is not None]
    own = np.array([s.admitted for s in used], dtype=float)
    nxt = np.array([s.admitted_next for s in used], dtype=float)
    if not len(used) or not (np.ptp(own) > 0 or np.ptp(nxt) > 0):
        return 0.0
    X = np.c_[np.ones(len(used)), [s.terms[0] for s in used], [s.kind != DECODE_SYNC for s in used], own, nxt]
    coef = np.linalg.lstsq(X, np.array([s.gap for s in used]), rcond=None)[0]
    return max(0.0, float(coef[3] + coef[4]))


def gap_samples(samples: list) -> tuple[list[float], list[float]]:
    """(gaps, engine terms) of the decode-only steps among `samples` that ran back to back with the next step."""
    pairs = [(s.gap, s.terms[0]) for s in samples if s.kind == DECODE_SYNC and s.gap is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]
