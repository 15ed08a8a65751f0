"""Exact fast-forward of decode-only stretches of one EngineCore (sim mode).

While no request arrives or is preempted and nobody can be admitted, every step of an engine is the same
batch of decodes, one token each: the scheduler's decisions follow from counters alone. Such a stretch is
advanced here in one call, with the core, scheduler, block manager and records left exactly as
`schedule` -> executor -> `update` would leave them step by step (same step rows, same ITL samples in the
same order, the same block ids allocated at the same block boundaries, in the same order).

Within a stretch the batch shrinks when requests reach their length limit: the step that appends a
request's last token ends it through the core's own `_finish`, as `update`'s stop check does, and the
stretch goes on with the others while nobody can be admitted. Requests are brought up to date (counters,
output tokens, last token time) when they finish and when the stretch ends. The steps are recorded as columns
(record_parts.Stretch, one per batch size: a list append or two per step), read back as the same rows and ITL
samples. Where the driver prices a batch's decodes without their SchedulerOutput (`decode_ends`), the steps up
to the next finish are priced in one go (in chunks that double, none past the one that reaches `until`: a step
priced is a step taken, but for that chunk's) and their block boundaries allocated after, in step order.

Preconditions (0 steps are taken otherwise): no step in flight, no pooling request, no beam search, no swapped-out request, every running request
decodes (one token to compute, nothing pending, no stop tokens, its prompt done), the whole batch fits the
token budget, and the waiting queue is empty or cannot be admitted from (`max_num_seqs` reached or no token
budget left). A stretch stops before the step whose block allocations the free pool cannot cover (stepping
would preempt there), before the first step that would start at or after `until` (the driver's next
admission), after a finish that lets a waiting request in, and after a step that finished a request where
`after_finish` says so. `after_finish(j, t)` (a data-parallel replica's stats report) is called after each step
that finished a request, the stretch's j-th, ending at t, where the stretch may go on past it (a batch left,
nobody to admit, `until` and the step budget not reached), with the scheduler's queues and the block manager as
that step's update leaves them (live requests' counters catch up when the stretch ends); it returns whether the
stretch goes on. Where the stretch cannot go on it is not called: the driver is told the last step finished a
request, and acts on it at that step's end, as stepping would. The executor is a simulator's:
every row samples `token_id`, no logprobs.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from itertools import chain, islice
from typing import Callable, Generator, Iterator, Sequence

from testbed.engine.core import EngineCore
from testbed.engine.outputs import SchedulerOutput
from testbed.engine.record_parts import Stretch
from testbed.engine.request import Request, RequestStatus
from testbed.engine.scheduler import Scheduler

StepEnd = Callable[[SchedulerOutput, float], float]
# (rows, rows under a grammar) -> the ends of successive decode steps of such a batch, each starting where the one
# before ended, from the first one's (start, sum_context_tokens, max_context_tokens), as StepEnd gives them for
# those steps; or None (then StepEnd is asked)
# (steps of the stretch taken, the end of the last, which finished a request) -> whether the stretch goes on
AfterFinish = Callable[[int, float], bool]
DecodeEnds = Callable[[int, int], Callable[[float, int, int], Iterator[float]] | None]


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


Batch = tuple[list[int], list[int], list[list[int]], dict[int, list[int]], dict[int, list[int]]]


def decode_batch(core: EngineCore) -> Batch | None:
    """When the next steps are plain decodes of the running batch: each request's computed tokens, the step
    (from 0) in which it appends its last token, its block table, and by step the positions in the batch that
    need a new block in it (then every block_size steps) and those that append their last token in it; else None."""
    sched = core.scheduler
    running = sched.running
    b = len(running)
    if not b or core.num_pooling or core.num_beam_groups or sched.swapped or b > sched.max_num_batched_tokens or _admits(core, b):
        return None
    req_blocks, bs = core.block_manager.req_blocks, core.block_manager.block_size
    computed, last, tables = [], [], []
    due: dict[int, list[int]] = {}
    ending: dict[int, list[int]] = {}
    for p, req in enumerate(running):
        c = req.num_computed_tokens
        if (req.num_pending or req.num_tokens - c != 1 or c < req.num_prompt_tokens
                or req.token_stops or req.status != RequestStatus.RUNNING):
            return None
        blocks = req_blocks[req.request_id]
        end, j = req.length_limit - req.num_tokens - 1, len(blocks) * bs - c
        if j < 0:
            return None  # blocks short of its computed tokens: not a state stepping leaves
        if j <= end:
            due.setdefault(j, []).append(p)
        ending.setdefault(end, []).append(p)
        computed.append(c)
        last.append(end)
        tables.append(blocks)
    return computed, last, tables, due, ending


def _admits(core: EngineCore, running: int) -> bool:
    """Whether the scheduler would try to admit a waiting request next to `running` running ones."""
    sched = core.scheduler
    return bool(len(sched.waiting)) and running < sched.max_num_seqs and running < sched.max_num_batched_tokens


def fast_forward(core: EngineCore, now: float, until: float, step_end: StepEnd, token_id: int,
                 max_steps: int | None = None, after_finish: AfterFinish | None = None,
                 decode_ends: DecodeEnds | None = None) -> tuple[int, float, bool]:
    """Advance the stretch of decode steps that starts at `now`, where `until` is known in advance (advance's
    generator, run through: it asks nothing); returns (steps taken, time after the last, whether the last step
    finished a request that `after_finish` was not called for)."""
    steps = advance(core, now, until, step_end, token_id, max_steps, after_finish, decode_ends)
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise AssertionError("a stretch with a known horizon asked when a request could come")


def advance(core: EngineCore, now: float, until: float, step_end: StepEnd, token_id: int,
            max_steps: int | None = None, after_finish: AfterFinish | None = None,
            decode_ends: DecodeEnds | None = None,
            next_routing: float | None = None) -> Generator[float, float, tuple[int, float, bool]]:
    """fast_forward's stretch, as a generator that returns (steps taken, time after the last, whether the last step
    finished a request that `after_finish` was not called for).

    Lazy, where `next_routing` is given: `until` bounds only the admissions known now (of requests already routed
    here), and a request routed here later cuts the stretch at its routing time. Before it takes each priced chunk
    of steps (up to the next finish), the generator yields the end of the chunk's last step; the driver sends back
    inf once simulated time reached it, or, as soon as a request was routed here before then, the routing time, and
    the chunk keeps the steps that start before that. The first step is always taken (it starts now); where it
    finishes a request, the generator yields its end first, to learn whether that finish ends the stretch or is
    reported inside it. So a chunk is taken only once simulated time passed its steps' starts: what it changes is
    final, and its finish's stats report is taken at its time. Steps priced one by one (no `decode_ends` clock) are
    not taken lazily: a stretch that starts with such a batch stops before `next_routing`, as without laziness.

    `step_end(so, start)` is the driver's clock: when a step scheduled at `start` ends (it calls the cost
    model, so it is called once per step, in order, as stepping would). `decode_ends`, when given, is the same clock
    for one batch size at a time, built once per batch (without LoRA: adapter slots change a step's cost). Requests are brought up to date
    when they finish and when the stretch ends; in between, request i has computed computed0[i] + step. The
    steps are recorded as columns (record_parts.Stretch: one per batch size), their ITL samples with them."""
    batch = decode_batch(core)
    budget = (1 << 62) if max_steps is None else max_steps
    if batch is None or budget <= 0 or now >= until:
        return 0, now, False
    computed0, last_step, tables, due, ending = batch
    sched, bm, records = core.scheduler, core.block_manager, core.records
    everyone = list(sched.running)  # positions in this list order every per-request pass, as the batch's order
    running, pos = list(everyone), list(range(len(everyone)))
    bs = bm.block_size
    base = list(computed0)
    replica, total_blocks, waiting = core.replica, bm.num_blocks, sched.num_waiting
    itl, used, free_ids, cached = records.itl, bm.num_used_blocks, bm.free_ids, bm.cached
    last_update = core._last_update
    sched.finished_req_ids = []  # what the first step's schedule() hands out (to runners; a simulator has none)
    j, t, generated, finished = 0, now, 0, False
    # the steps of one batch size make a Stretch: their ends follow `t` in the step table's times, their blocks in
    # use go to its used list (the first step starts at the previous update's end if that is later than now)
    times, useds = records.steps.times, records.steps.used
    lo, ulo, first_start = len(times), len(useds), (t if t > last_update else last_update)
    times.append(t)
    b, ctx0, longest0, part_ctx, lora_due, clock, so, before = _batch_from(sched, running, pos, base, tables, j, t,
                                                                           decode_ends)
    lazy = next_routing is not None
    if lazy and clock is None:
        lazy, until = False, min(until, next_routing)
    while j < budget and t < until:
        if j and clock is not None:
            # the steps up to the next that ends a request (or the budget's last) priced in one go; the first that would
            # start at or after `until` is not taken, nor those after it, nor any from one whose blocks the free pool
            # cannot cover (the clock, which priced them, is then dropped with the stretch)
            e = min(min(ending), budget - 1)
            m, mark = e - j + 1, len(times)  # times[mark - 1] is t, the start of step j
            priced = _price(times, clock, m, until)
            k = bisect_left(times, until, mark - 1, mark - 1 + priced) - (mark - 1)
            if lazy and k:  # final once no request was routed here before its last step ended
                if b * (k // bs + 1) > len(free_ids) + len(cached):  # the pool may not cover them all
                    k = _covered(due, last_step, j, k, bs, len(free_ids) + len(cached))
                if k:
                    cut = yield times[mark - 1 + k]
                    if cut < until:
                        until = cut
                        k = bisect_left(times, until, mark - 1, mark - 1 + k) - (mark - 1)
            for i in range(j, j + k):
                rows = due.pop(i, None)
                if rows is not None:
                    if len(rows) > len(free_ids) + len(cached):
                        k = i - j  # stepping would preempt in step i
                        break
                    _append_blocks(bm, everyone, computed0, last_step, due, rows, i, bs)
                    used += len(rows)
                useds.append(used)
            del times[mark + k:]
            if k < m:
                if k:
                    j, t, finished = j + k, times[-1], False
                break
            j, t = j + k, times[-1]
            done = ending.pop(e, None)
        else:
            if lazy and j:
                finished = False  # its after_finish was called
                break  # a step priced alone is not taken lazily
            rows = due.pop(j, None)
            if rows is not None:
                if len(rows) > len(free_ids) + len(cached):
                    break  # stepping would preempt in this step
                _append_blocks(bm, everyone, computed0, last_step, due, rows, j, bs)
                used += len(rows)
            if clock is not None:
                end = next(clock)
            else:
                ctx = ctx0 + b * (j + 1)
                before.shift = j
                so.sum_context_tokens = so.sum_attn_pairs = ctx
                so.max_context_tokens = longest0 + j + 1
                if lora_due:
                    sched._assign_slots(so)
                    lora_due = False
                end = step_end(so, t)
                if so.lora_loads or so.lora_dropped:  # done by this step; the next ones load nothing
                    so.lora_loads, so.lora_dropped = [], []
            if not j:  # every row's previous token came at its own time; after this step, at the step's start
                for r in running:
                    itl.append(end - r.last_token_time)
            times.append(end)
            useds.append(used)
            t = end
            j += 1
            done = ending.pop(j - 1, None)
            if lazy and done is not None:  # its finish is final once no request was routed here before it ended
                cut = yield t
                if cut < until:
                    until = cut
        finished = done is not None
        if finished:  # this step's tokens end them, as update's stop check ends them, in batch order
            n = _record(records, Stretch(replica, b, part_ctx, total_blocks, waiting, times, lo, useds, ulo,
                                         len(useds) - ulo, first_start), j)
            generated += b * n
            for p in sorted(done):
                _bring_up_to_date(everyone[p], computed0[p], j, token_id, t)
                core._finish(everyone[p], RequestStatus.FINISHED_LENGTH, t)
            for p in sorted(done, reverse=True):  # out of the batch (pos ascends; running and base follow it)
                i = bisect_left(pos, p)
                del pos[i], running[i], base[i]
            lo, ulo, first_start = lo + n, ulo + n, None  # the next stretch starts where this one ended
            if not running or _admits(core, len(running)) or after_finish is not None and (j >= budget or t >= until):
                b = len(running)
                break
            if after_finish is not None:
                sched.drop_finished()
                if not after_finish(j, t):
                    b, finished = len(running), False
                    break
            used = bm.num_used_blocks  # their blocks are free again
            b, ctx0, longest0, part_ctx, lora_due, clock, so, before = _batch_from(sched, running, pos, base, tables, j,
                                                                                   t, decode_ends)
    if not j:
        times.pop()  # no step taken: its start is nobody's
        return 0, now, False
    n = len(useds) - ulo
    if n:
        generated += b * _record(records, Stretch(replica, b, part_ctx, total_blocks, waiting, times, lo, useds, ulo, n,
                                                  first_start), j)
    for p, r in zip(pos, running):
        _bring_up_to_date(r, computed0[p], j, token_id, t)
    if finished or len(running) != len(everyone):
        sched.drop_finished()
    core.token_counts.generation += generated
    core._last_update = t
    return j, t, finished


PRICE_CHUNK = 16  # steps priced after a first guess fell short of `until` (then twice as many each time)


def _price(times: list[float], clock: Iterator[float], m: int, until: float) -> int:
    """Append the ends of the clock's next steps, up to m of them, to `times` (whose last two entries are the start
    and end of the step before them), in chunks, stopping after the chunk whose last step ends at or after `until`
    (no step after it is taken); how many were appended. The first chunk is as many steps of the last one's length
    as reach `until`, and one more; the next ones PRICE_CHUNK steps, then twice as many each time."""
    t, d = times[-1], times[-1] - times[-2]
    if d <= 0.0:
        c = PRICE_CHUNK
    else:
        c = m if until == math.inf or until - t >= m * d else int((until - t) / d) + 2
    got = 0
    while got < m:
        c = min(c, m - got)
        times.extend(islice(clock, c))
        got += c
        if times[-1] >= until:
            break
        c = PRICE_CHUNK if c < PRICE_CHUNK else c + c
    return got


def _batch_from(sched: Scheduler, running: list[Request], pos: list[int], base: list[int], tables: list[list[int]],
                j: int, t: float, decode_ends: DecodeEnds | None):
    """What prices the batch `running` (batch positions `pos`, computed tokens `base` before the stretch) from step j
    of the stretch, which starts at t: (rows, their context before the stretch, its longest, sum_context_tokens of
    step j, whether adapter slots are to be assigned, the clock of its steps' ends or None, and where that is None
    the steps' SchedulerOutput with its num_computed_before, whose shift is the step)."""
    b = len(running)
    ctx0, longest0 = sum(base), max(base)
    lora_due = sched.lora is not None  # the step's adapter slots to assign (at the start, after a change)
    structured = _structured(sched, running)
    clock = None if decode_ends is None or lora_due else decode_ends(b, structured)
    if clock is not None:
        return b, ctx0, longest0, ctx0 + b * (j + 1), lora_due, clock(t, ctx0 + b * (j + 1), longest0 + j + 1), None, None
    so = SchedulerOutput(requests=running, num_new_tokens=[1] * b, block_ids=[tables[p] for p in pos],
                         total_num_scheduled_tokens=b, num_decode_tokens=b, num_structured_reqs=structured)
    so.num_computed_before = before = ShiftedCounts(base, 0)
    return b, ctx0, longest0, ctx0 + b * (j + 1), lora_due, None, so, before


def _record(records, part: Stretch, j: int) -> int:
    """Add a stretch's steps (the last of which is step j - 1 of the fast-forward) and their ITL samples: each step's
    duration per row, but for the fast-forward's first step (its samples were appended one by one); its steps."""
    records.steps.add_stretch(part)
    records.itl.add_stretch(part, 1 if part.n == j else 0)
    return part.n


def _append_blocks(bm, everyone: list[Request], computed0: list[int], last_step: list[int], due: dict[int, list[int]],
                   rows: list[int], step: int, bs: int) -> None:
    """Give the batch's requests at positions `rows` the block their token of `step` starts, in batch order as the
    scheduler reaches them, and note when each needs its next one."""
    rows.sort()
    for p in rows:
        bm.append_block(everyone[p], computed0[p] + step + 1)
        if step + bs <= last_step[p]:
            due.setdefault(step + bs, []).append(p)


def _covered(due: dict[int, list[int]], last_step: list[int], j: int, k: int, bs: int, free: int) -> int:
    """How many of the steps j .. j+k-1 the `free` blocks cover, their new blocks taken in step order (as the taking
    loop checks them, without taking any): stepping would preempt in the next."""
    later: dict[int, list[int]] = {}  # rows whose next block falls in these steps after one taken in them
    for i in range(j, j + k):
        rows, more = due.get(i, ()), later.pop(i, ())
        n = len(rows) + len(more)
        if n:
            if n > free:
                return i - j
            free -= n
            nxt = i + bs
            for p in chain(rows, more):
                if nxt <= last_step[p]:
                    later.setdefault(nxt, []).append(p)
    return k


def _structured(sched: Scheduler, running: list[Request]) -> int:
    """Rows sampled under a grammar this step (every decode row samples)."""
    return sum(1 for r in running if r.structured) if sched.num_structured else 0


def _bring_up_to_date(req: Request, computed0: int, steps: int, token_id: int, last_token_time: float) -> None:
    """The request as `steps` updated decode steps from computed0 leave it."""
    added = computed0 + steps - req.num_computed_tokens
    req.num_computed_tokens = computed0 + steps
    req.output_token_ids += [token_id] * added
    req.num_tokens += added
    req.last_token_time = last_token_time
