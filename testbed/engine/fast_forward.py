"""Exact fast-forward of decode-only stretches of one EngineCore (sim mode).

While no request arrives, finishes or is preempted and nobody can be admitted, every step of an engine
is the same batch of decodes, one token each: the scheduler's decisions follow from counters alone. Such
a stretch is advanced here in one call, with the core, scheduler, block manager and records left exactly
as `schedule` -> executor -> `update` would leave them step by step (same step rows, same ITL samples in
the same order, the same block ids allocated at the same block boundaries, in the same order).

Preconditions (checked; 0 steps are taken otherwise): no step in flight, no pooling request, every
running request decodes (one token to compute, nothing pending, no stop tokens, its prompt done), the
whole batch fits the token budget, and the waiting queue is empty or cannot be admitted from
(`max_num_seqs` reached or no token budget left). A stretch stops before the step whose block
allocations the free pool cannot cover (stepping would preempt there), before the step in which a
request reaches its length limit, and before the first step that would start at or after `until`
(the driver's next arrival). The executor is a simulator's: every row samples `token_id`, no logprobs.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from testbed.engine.core import EngineCore
from testbed.engine.outputs import SchedulerOutput
from testbed.engine.request import RequestStatus


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


def decode_stretch_limit(core: EngineCore) -> int:
    """How many steps from now are plain decodes of the running batch with nothing finishing (0: none,
    or the state is not one this module advances). Block allocation and `until` may stop a stretch sooner."""
    sched = core.scheduler
    running = sched.running
    b = len(running)
    if not b or core.num_pooling or b > sched.max_num_batched_tokens:
        return 0
    if len(sched.waiting) and b < sched.max_num_seqs and b < sched.max_num_batched_tokens:
        return 0  # the scheduler would try to admit someone
    limit = 1 << 62
    for req in running:
        computed = req.num_computed_tokens
        if (req.num_pending or req.num_tokens - computed != 1 or computed < req.num_prompt_tokens
                or req.token_stops or req.status != RequestStatus.RUNNING):
            return 0
        left = req.length_limit - req.num_tokens - 1  # steps before the one that appends its last token
        if left < limit:
            limit = left
    return max(limit, 0)


def fast_forward(core: EngineCore, now: float, until: float, step_end: Callable[[SchedulerOutput, float], float],
                 token_id: int, max_steps: int | None = None) -> tuple[int, float]:
    """Advance the stretch of decode steps that starts at `now`; returns (steps taken, time after the last).

    `step_end(so, start)` is the driver's clock: when a step scheduled at `start` ends (it calls the cost
    model, so it is called once per step, in order, as stepping would)."""
    limit = decode_stretch_limit(core)
    if max_steps is not None:
        limit = min(limit, max_steps)
    if limit <= 0 or now >= until:
        return 0, now
    sched, bm, records = core.scheduler, core.block_manager, core.records
    running = list(sched.running)
    b, bs = len(running), bm.block_size
    computed0 = [r.num_computed_tokens for r in running]
    # the step (from 0) at which each request first needs a new block; then every block_size steps
    due: dict[int, list[int]] = {}
    for i, r in enumerate(running):
        j = len(bm.req_blocks[r.request_id]) * bs - computed0[i]
        if j < 0:
            return 0, now  # blocks short of its computed tokens: not a state stepping leaves
        if j < limit:
            due.setdefault(j, []).append(i)
    sum_ctx0, max_ctx0 = sum(computed0), max(computed0)
    n_struct = sum(1 for r in running if r.structured) if sched.num_structured else 0
    so = SchedulerOutput(requests=running, num_new_tokens=[1] * b, block_ids=[bm.req_blocks[r.request_id] for r in running],
                         total_num_scheduled_tokens=b, num_decode_tokens=b, num_structured_reqs=n_struct)
    replica, total_blocks, waiting, steps = core.replica, bm.num_blocks, sched.num_waiting, records.steps
    itl = records.itl
    last_update = core._last_update
    j = 0
    t = now
    while j < limit and t < until:
        rows = due.pop(j, None)
        if rows is not None:
            if len(rows) > len(bm.free_ids) + len(bm.cached):
                due[j] = rows
                break  # stepping would preempt in this step
            rows.sort()
            for i in rows:
                req = running[i]
                req.num_computed_tokens = computed0[i] + j
                if not bm.allocate_slots(req, 1):
                    raise AssertionError(f"fast_forward: block allocation failed for {req.request_id!r} with "
                                         "free blocks counted")
                if j + bs < limit:
                    due.setdefault(j + bs, []).append(i)
        if j == 0:
            sched.finished_req_ids = []
        ctx = sum_ctx0 + b * (j + 1)
        so.num_computed_before = ShiftedCounts(computed0, j)
        so.sum_context_tokens = so.sum_attn_pairs = ctx
        so.max_context_tokens = max_ctx0 + j + 1
        so.step_state = (t, bm.num_used_blocks, waiting, b)
        end = step_end(so, t)
        start = t if t > last_update else last_update
        if j == 0:
            for r in running:
                itl.append(end - r.last_token_time)
        else:
            itl.extend([end - t] * b)
        steps.append((replica, start, end - start, b, 0, b, ctx, ctx, so.step_state[1], total_blocks, waiting, b, 0))
        last_update = t = end
        j += 1
    if j:
        for i, r in enumerate(running):
            r.num_computed_tokens = computed0[i] + j
            r.output_token_ids.extend([token_id] * j)
            r.num_tokens += j
            r.last_token_time = t
        core.token_counts.generation += b * j
        core._last_update = last_update
    else:
        for i, r in enumerate(running):
            r.num_computed_tokens = computed0[i]
    return j, t
