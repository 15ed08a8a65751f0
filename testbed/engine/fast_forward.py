"""Exact fast-forward of decode-only stretches of one EngineCore (sim mode).

While no request arrives or is preempted and nobody can be admitted, every step of an engine is the same
batch of decodes, one token each: the scheduler's decisions follow from counters alone. Such a stretch is
advanced here in one call, with the core, scheduler, block manager and records left exactly as
`schedule` -> executor -> `update` would leave them step by step (same step rows, same ITL samples in the
same order, the same block ids allocated at the same block boundaries, in the same order).

A stretch is made of segments, each ending in the step where a request reaches its length limit; that
step ends it through the core's own `_finish`, as `update`'s stop check does, and the stretch goes on with
the smaller batch while the conditions still hold.

Preconditions of every segment (0 steps are taken otherwise): no step in flight, no pooling request, every
running request decodes (one token to compute, nothing pending, no stop tokens, its prompt done), the whole
batch fits the token budget, and the waiting queue is empty or cannot be admitted from (`max_num_seqs`
reached or no token budget left). A stretch stops before the step whose block allocations the free pool
cannot cover (stepping would preempt there), before the first step that would start at or after `until`
(the driver's next admission), and, with `stop_after_finish`, after a step that finished a request (a
data-parallel replica reports its stats then). The executor is a simulator's: every row samples `token_id`,
no logprobs.
"""
from __future__ import annotations

from itertools import repeat
from typing import Callable, Iterator, Sequence

from testbed.engine.core import EngineCore
from testbed.engine.outputs import SchedulerOutput
from testbed.engine.request import RequestStatus

StepEnd = Callable[[SchedulerOutput, float], float]


class ShiftedCounts(Sequence[int]):
    """`base[i] + shift` for every i: a fast-forwarded step's num_computed_before without a list per step."""

    __slots__ = ("base", "shift")

    def __init__(self, base: list[int], shift: int) -> None:
        self.base, self.shift = base, shift

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [c + self.shift for c in self.base[i]]
        return self.base[i] + self.shift

    def __iter__(self) -> Iterator[int]:
        s = self.shift
        return (c + s for c in self.base)


def decode_batch(core: EngineCore) -> tuple[int, list[int], list[list[int]]] | None:
    """When the next steps are plain decodes of the running batch: (how many, the last of them the first in
    which a request appends its last token; each request's computed tokens; its block table), else None."""
    sched = core.scheduler
    running = sched.running
    b = len(running)
    if not b or core.num_pooling or b > sched.max_num_batched_tokens:
        return None
    if len(sched.waiting) and b < sched.max_num_seqs and b < sched.max_num_batched_tokens:
        return None  # the scheduler would try to admit someone
    req_blocks = core.block_manager.req_blocks
    limit, computed, tables = 1 << 62, [], []
    for req in running:
        c = req.num_computed_tokens
        if (req.num_pending or req.num_tokens - c != 1 or c < req.num_prompt_tokens
                or req.token_stops or req.status != RequestStatus.RUNNING):
            return None
        left = req.length_limit - req.num_tokens  # its step that appends the last token is step left - 1
        if left < limit:
            limit = left
        computed.append(c)
        tables.append(req_blocks[req.request_id])
    return limit, computed, tables


def fast_forward(core: EngineCore, now: float, until: float, step_end: StepEnd, token_id: int,
                 max_steps: int | None = None, stop_after_finish: bool = False) -> tuple[int, float, bool]:
    """Advance the stretch of decode steps that starts at `now`; returns (steps taken, time after the last,
    whether the last step finished a request).

    `step_end(so, start)` is the driver's clock: when a step scheduled at `start` ends (it calls the cost
    model, so it is called once per step, in order, as stepping would)."""
    steps, t, finished = 0, now, False
    budget = (1 << 62) if max_steps is None else max_steps
    while steps < budget and t < until:
        k, t, ended = _segment(core, t, until, step_end, token_id, budget - steps)
        steps += k
        finished = ended or (finished and not k)
        if not ended or stop_after_finish:
            break
    return steps, t, finished


def _segment(core: EngineCore, now: float, until: float, step_end: StepEnd, token_id: int,
             max_steps: int) -> tuple[int, float, bool]:
    """One segment: steps of one running batch; the last may finish requests (then through `core.update`)."""
    batch = decode_batch(core)
    if batch is None or max_steps <= 0:
        return 0, now, False
    length, computed0, tables = batch
    limit = min(length, max_steps)
    sched, bm, records = core.scheduler, core.block_manager, core.records
    running = list(sched.running)
    b, bs = len(running), bm.block_size
    # the step (from 0) at which each request first needs a new block; then every block_size steps
    due: dict[int, list[int]] = {}
    for i, blocks in enumerate(tables):
        j = len(blocks) * bs - computed0[i]
        if j < 0:
            return 0, now, False  # blocks short of its computed tokens: not a state stepping leaves
        if j < limit:
            due.setdefault(j, []).append(i)
    sum_ctx0, max_ctx0 = sum(computed0), max(computed0)
    n_struct = sum(1 for r in running if r.structured) if sched.num_structured else 0
    so = SchedulerOutput(requests=running, num_new_tokens=[1] * b, block_ids=tables, total_num_scheduled_tokens=b,
                         num_decode_tokens=b, num_structured_reqs=n_struct)
    replica, total_blocks, waiting, rows_out = core.replica, bm.num_blocks, sched.num_waiting, records.steps
    itl, used, free_ids, cached = records.itl, bm.num_used_blocks, bm.free_ids, bm.cached
    so.num_computed_before = before = ShiftedCounts(computed0, 0)
    last_update = core._last_update
    sched.finished_req_ids = []  # what the first step's schedule() hands out (to runners; a simulator has none)
    last = limit - 1 if length <= max_steps else -1  # the step that finishes a request, if this segment has it
    ctx, longest = sum_ctx0, max_ctx0
    j, t = 0, now
    while j < limit and t < until:
        rows = due.pop(j, None)
        if rows is not None:
            if len(rows) > len(free_ids) + len(cached):
                break  # stepping would preempt in this step
            rows.sort()
            for i in rows:  # in batch order, as the scheduler reaches them
                bm.append_block(running[i], computed0[i] + j + 1)
                if j + bs < limit:
                    due.setdefault(j + bs, []).append(i)
            used += len(rows)
        ctx += b
        longest += 1
        before.shift = j
        so.sum_context_tokens = so.sum_attn_pairs = ctx
        so.max_context_tokens = longest
        end = step_end(so, t)
        if j == last:  # this step's tokens end some requests, as update's stop check ends them
            if j:
                itl.extend(repeat(end - t, b))
            else:
                for r in running:
                    itl.append(end - r.last_token_time)
            start = t if t > last_update else last_update
            _materialize(running, computed0, j + 1, token_id, end)
            core.token_counts.generation += b * (j + 1)
            for r in running:  # in batch order, as update reaches them
                if r.num_tokens >= r.length_limit:
                    core._finish(r, RequestStatus.FINISHED_LENGTH, end)
            sched.drop_finished()
            rows_out.append((replica, start, end - start, b, 0, b, ctx, ctx, used, total_blocks, waiting, b, 0))
            core._last_update = end
            return j + 1, end, True
        if j:  # the previous step ended at t: this one starts there
            itl.extend(repeat(end - t, b))
            rows_out.append((replica, t, end - t, b, 0, b, ctx, ctx, used, total_blocks, waiting, b, 0))
        else:
            for r in running:
                itl.append(end - r.last_token_time)
            start = t if t > last_update else last_update
            rows_out.append((replica, start, end - start, b, 0, b, ctx, ctx, used, total_blocks, waiting, b, 0))
        last_update = t = end
        j += 1
    if j:
        _materialize(running, computed0, j, token_id, t)
        core.token_counts.generation += b * j
        core._last_update = last_update
    return j, t, False


def _materialize(running: list, computed0: list[int], steps: int, token_id: int, last_token_time: float) -> None:
    """Each request as `steps` updated decode steps leave it (nothing to do for 0)."""
    if not steps:
        return
    for i, r in enumerate(running):
        r.num_computed_tokens = computed0[i] + steps
        r.output_token_ids.extend(repeat(token_id, steps))
        r.num_tokens += steps
        r.last_token_time = last_token_time
