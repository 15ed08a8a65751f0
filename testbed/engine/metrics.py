"""Per-request and per-step records (one schema for sim and real mode) and their aggregation.

Definitions follow vLLM's benchmark: TTFT = first token - arrival; ITL = gaps between successive
tokens of a request; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = finish - arrival;
throughput = output tokens / makespan; goodput = requests meeting every SLO / makespan.
"""
from __future__ import annotations

import math

import numpy as np
from dataclasses import dataclass, field
from typing import Any

from testbed.engine.record_parts import Samples, StepRows
from testbed.engine.request import Request

BASE_REQUEST_COLUMNS = ("request_id", "replica", "priority", "arrival", "first_scheduled", "first_token", "finish",
                        "input_tokens", "output_tokens", "cached_tokens", "preemptions", "finish_reason")
# seq: the order the engine (a replica, under DP) received its requests, 0 up: requests that arrive at the same
# instant are queued, and replayed, in this order (rows are written as requests end). Runs written before it lack it.
REQUEST_COLUMNS = BASE_REQUEST_COLUMNS + ("seq",)
FINISH = REQUEST_COLUMNS.index("finish")
BASE_STEP_COLUMNS = ("replica", "start", "duration", "num_reqs", "num_prefill_tokens", "num_decode_tokens",
                     "sum_context_tokens", "sum_attn_pairs", "kv_blocks_used", "kv_blocks_total", "num_waiting",
                     "num_running", "num_preempted")
# KV block moves (swap preemption, copy-on-write of beams): requests in the swapped queue when the step was
# scheduled, preempted requests it swapped out (the rest of num_preempted recomputed), blocks it copied out to
# the CPU pool, back in, and within the GPU. Run directories written before these existed lack them (read as 0).
BLOCK_STEP_COLUMNS = ("num_swapped", "num_swapped_out", "blocks_swapped_out", "blocks_swapped_in", "blocks_copied")
STEP_COLUMNS = BASE_STEP_COLUMNS + BLOCK_STEP_COLUMNS
# Pipeline-parallel runs only (after STEP_COLUMNS): the batch-queue slot a step took (its sequence number modulo
# pipeline_parallel_size, vLLM's virtual engine) and the batches in flight once it was launched, itself included.
PIPELINE_STEP_COLUMNS = ("microbatch", "num_in_flight")
# Async-scheduling runs only (after STEP_COLUMNS): the `now` of the schedule call that formed the step. Its `start` is
# when it began on the device (the update of the step before, if that came later), so a step scheduled while the one
# before was in flight shows only here when it was scheduled, which arrivals it saw: what a recorded replay needs.
ASYNC_STEP_COLUMNS = ("scheduled",)
STEP_FLOAT_COLUMNS = ("start", "duration", "scheduled")
# Data-parallel runs only: the coordinator's decisions and the stats they used. `seq` numbers the
# coordinator's events (routes and stats receipts share it), so the two tables replay its order.
ROUTE_COLUMNS = ("seq", "request_id", "replica", "arrival", "sent", "routed", "added")
PUBLICATION_COLUMNS = ("seq", "replica", "steps", "sampled", "received", "num_waiting", "num_running", "kv_usage",
                       "num_free_blocks", "num_blocks", "num_waiting_tokens", "num_added")
# Runs with structured outputs: when each request's grammar outcome reached the scheduler (the `now` of the
# step it was marked before), with the reason when it failed (None: ready). A simulation replays these.
GRAMMAR_COLUMNS = ("request_id", "replica", "ready", "error")
PERCENTILES = (50, 90, 95, 99)


def logged_step_extra(row: tuple | list) -> tuple[str, ...]:
    """The columns after STEP_COLUMNS that a step row logged by an engine process carries, from its length: none,
    an async run's schedule time, or a pipeline's microbatch and in-flight count (ValueError otherwise)."""
    extra = len(row) - len(STEP_COLUMNS)
    for names in ((), ASYNC_STEP_COLUMNS, PIPELINE_STEP_COLUMNS):
        if extra == len(names):
            return names
    raise ValueError(f"a logged step row of {len(row)} values: expected {len(STEP_COLUMNS)}, "
                     f"{len(STEP_COLUMNS) + len(ASYNC_STEP_COLUMNS)} or {len(STEP_COLUMNS) + len(PIPELINE_STEP_COLUMNS)} "
                     "(was the log written by another version?)")


def shifted_step_row(row: tuple | list, t0: float) -> tuple:
    """A logged step row with its times made relative to `t0`: its start, and an async row's schedule time."""
    if logged_step_extra(row) == ASYNC_STEP_COLUMNS:
        return (row[0], row[1] - t0, *row[2:-1], row[-1] - t0)
    return (row[0], row[1] - t0, *row[2:])


@dataclass
class Recorder:
    """Column store of a run's records; appends only, so recording stays O(1) per event. `steps` and `itl` read as
    lists and also take fast-forwarded stretches as columns (record_parts.py)."""

    requests: list[tuple] = field(default_factory=list)  # rows in REQUEST_COLUMNS order
    steps: StepRows = field(default_factory=StepRows)    # rows in STEP_COLUMNS (+ step_extra) order
    itl: Samples = field(default_factory=Samples)
    routes: list[tuple] = field(default_factory=list)        # ROUTE_COLUMNS rows (DP runs)
    publications: list[tuple] = field(default_factory=list)  # PUBLICATION_COLUMNS rows (DP runs)
    loras: dict[str, str] = field(default_factory=dict)  # request id -> its LoRA adapter's name (LoRA runs only)
    step_extra: tuple[str, ...] = ()  # columns after STEP_COLUMNS in every step row (PIPELINE_ or ASYNC_STEP_COLUMNS)
    grammars: list[tuple] = field(default_factory=list)  # GRAMMAR_COLUMNS rows (grammars compiled off the loop)

    def record_request(self, req: Request) -> None:
        """Add the ended request's row. Rows stay in the order their requests ended (finish_time; ties in the
        order they were recorded), as stepping records them: a fast-forwarded stretch records its finishes when it
        is priced, so a rejection at an admission inside its last step (which ends after it) goes before them."""
        rows = self.requests
        rows.append((
            req.request_id, req.replica, req.priority, req.arrival_time, req.first_scheduled_time,
            req.first_token_time, req.finish_time, req.num_prompt_tokens, len(req.output_token_ids),
            max(req.num_cached_tokens, 0), req.num_preemptions, req.status.finish_reason, req.seq))
        end, i = req.finish_time, len(rows) - 1
        while i and rows[i - 1][FINISH] > end:
            i -= 1
        if i < len(rows) - 1:
            rows.insert(i, rows.pop())
        if req.lora_request is not None:
            self.loras[req.request_id] = req.lora_request.lora_name

    def extend(self, other: "Recorder") -> None:
        self.step_extra = self.step_extra or other.step_extra
        self.requests.extend(other.requests)
        self.steps.merge(other.steps)
        self.itl.merge(other.itl)
        self.routes.extend(other.routes)
        self.loras.update(other.loras)
        self.publications.extend(other.publications)
        self.grammars.extend(other.grammars)

    def request_columns(self) -> dict[str, list]:
        return _columns(self.requests, REQUEST_COLUMNS)

    def itl_array(self) -> np.ndarray:
        """The ITL samples as a float64 array, the stretches flattened once for them and the step columns."""
        return self.itl.array(self.steps)

    def step_columns(self) -> dict[str, np.ndarray]:
        """Step columns as numpy arrays (float64 for times, int64 otherwise)."""
        names = STEP_COLUMNS + self.step_extra
        return dict(zip(names, self.steps.columns(len(names), tuple(i for i, c in enumerate(names)
                                                                    if c in STEP_FLOAT_COLUMNS))))


def _columns(rows: list[tuple], names: tuple[str, ...]) -> dict[str, list]:
    cols = list(zip(*rows)) if rows else [()] * len(names)
    return {name: list(col) for name, col in zip(names, cols)}


def _stats(values) -> dict[str, float | None]:
    """mean and percentiles (numpy's linear interpolation, as vLLM's benchmark); None when empty."""
    if isinstance(values, np.ndarray):  # the caller's: partitioned in a copy
        xs = np.array(values, dtype=np.float64)
    else:
        xs = values.array() if isinstance(values, Samples) else np.fromiter(values, dtype=np.float64, count=len(values))
    if xs.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    mean = float(xs.mean())
    qs = np.percentile(xs, PERCENTILES, overwrite_input=True)  # xs is ours: partitioned in place, not copied
    return {"mean": mean, **{f"p{p}": float(q) for p, q in zip(PERCENTILES, qs)}}


def _block_moves(steps: dict) -> dict[str, int]:
    """Totals of the block-move columns (0 for records written before they existed)."""
    return {"num_swap_preemptions": int(np.sum(steps.get("num_swapped_out", 0))),
            "num_blocks_swapped_out": int(np.sum(steps.get("blocks_swapped_out", 0))),
            "num_blocks_swapped_in": int(np.sum(steps.get("blocks_swapped_in", 0))),
            "num_blocks_copied": int(np.sum(steps.get("blocks_copied", 0)))}


def check_slos(slo_ttft: float | None, slo_tpot: float | None) -> None:
    """SLOs are finite positive seconds (a negative or NaN one would make every request miss or meet it)."""
    for flag, v in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot)):
        if v is not None and not 0 < v < math.inf:
            raise ValueError(f"{flag} must be a finite number of seconds > 0, got {v}")


def _covered(replicas, starts, durations) -> float:
    """The time some step was in flight, summed over replicas: a pipeline-parallel run's steps overlap (each spans
    its batch's way through the stages), so their durations add up to more than the time the engine was busy."""
    total = 0.0
    order = np.lexsort((np.asarray(starts, dtype=np.float64), np.asarray(replicas)))
    rep, end = None, -np.inf
    for i in order:
        a, b = float(starts[i]), float(starts[i]) + float(durations[i])
        if replicas[i] != rep:
            rep, end = replicas[i], -np.inf
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(requests: dict[str, list], steps: dict[str, list], itl: list[float] | np.ndarray,
              slo_ttft: float | None = None, slo_tpot: float | None = None,
              prefix_queries: int = 0, prefix_hits: int = 0) -> dict[str, Any]:
    """Headline metrics of a run from its records (columns as in REQUEST_COLUMNS / STEP_COLUMNS)."""
    check_slos(slo_ttft, slo_tpot)
    reasons = requests["finish_reason"]
    done = [i for i, r in enumerate(reasons) if r in ("stop", "length")]
    arrival, first, finish = requests["arrival"], requests["first_token"], requests["finish"]
    out_tok, in_tok = requests["output_tokens"], requests["input_tokens"]
    ttft = [first[i] - arrival[i] for i in done if first[i] is not None]
    e2e = [finish[i] - arrival[i] for i in done]
    tpot_by_req = {i: (finish[i] - first[i]) / (out_tok[i] - 1) for i in done if out_tok[i] > 1}
    start = min(arrival) if arrival else 0.0
    end = max((finish[i] for i in done), default=start)
    makespan = end - start
    total_out = sum(out_tok[i] for i in done)
    total_in = sum(in_tok[i] for i in done)

    good = 0
    for i in done:
        ok = slo_ttft is None or (first[i] - arrival[i]) <= slo_ttft
        ok = ok and (slo_tpot is None or tpot_by_req.get(i, 0.0) <= slo_tpot)
        good += ok

    dur = np.asarray(steps["duration"], dtype=np.float64)
    busy = float(dur.sum()) if "num_in_flight" not in steps else _covered(steps["replica"], steps["start"], dur)
    used = np.asarray(steps["kv_blocks_used"], dtype=np.float64)
    total = np.asarray(steps["kv_blocks_total"], dtype=np.float64)
    kv = used / np.where(total > 0, total, 1.0)
    kv_mean = float((kv * dur).sum() / busy) if busy > 0 else (float(kv.mean()) if kv.size else 0.0)
    num_reqs = np.asarray(steps["num_reqs"], dtype=np.float64)
    per_s = (lambda x: x / makespan) if makespan > 0 else (lambda x: 0.0)
    return {
        "num_requests": len(reasons),
        "num_finished": len(done),
        "num_rejected": sum(r == "rejected" for r in reasons),
        "num_aborted": sum(r == "abort" for r in reasons),
        "makespan_s": makespan,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_out + total_in),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "goodput": per_s(good),
        "num_good_requests": good,
        "ttft_s": _stats(ttft),
        "tpot_s": _stats(list(tpot_by_req.values())),
        "itl_s": _stats(itl),
        "e2e_s": _stats(e2e),
        "kv_util_mean": kv_mean,
        "kv_util_max": float(kv.max()) if kv.size else 0.0,
        "num_preemptions": int(np.sum(steps["num_preempted"])),
        **_block_moves(steps),
        "prefix_cache_hit_rate": prefix_hits / prefix_queries if prefix_queries else 0.0,
        "mean_batch_size": float(num_reqs.mean()) if num_reqs.size else 0.0,
        "num_steps": len(dur),
        "busy_time_s": busy,
    }
