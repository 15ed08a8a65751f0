"""vLLM-V1-style scheduler: one token budget shared by prefills and decodes.

Every request has `num_computed_tokens` that catches up to `num_tokens` (prompt + output) plus the
tokens still in flight (`num_pending`, sampled by earlier steps not yet updated). Each
step: running requests first (in queue order), then waiting ones, each taking up to the remaining
budget (chunked prefill) while `max_num_seqs` and the block pool allow. When a running request
cannot get a block, the lowest-ranked running request is preempted by recompute (its blocks freed,
its progress reset, back to the front of the waiting queue), or, with `--preemption-mode swap`, swapped out
(its blocks copied to the CPU pool, its progress kept, to the front of the swapped queue; by recompute when
the CPU pool cannot take them). Swapped requests come back (their blocks copied in) before any waiting
request is admitted, as vLLM V0 does; no swapped or waiting request is admitted in a step that preempted. With a step in flight (async scheduling), a request that its in-flight token
ends is not scheduled again, and while one such request holds blocks (anywhere in the running queue) a
shortage stops the running pass instead of preempting (those blocks come back next step). With pipeline parallelism's batch queue
(several batches in flight), a request in a batch still in the pipeline (`in_flight`) is not scheduled again
until that batch is updated: it is never in two in-flight batches. Invariants: the step's tokens <= max_num_batched_tokens; running requests <=
max_num_seqs; a scheduled request always has blocks for all its computed + scheduled tokens.
With LoRA on, the running requests hold at most `max_loras` distinct adapters (vLLM's rule, kept over the
whole running set so every step holds it too): a waiting request whose adapter would be one too many is
skipped, and later waiting requests may go first (as vLLM does); then every adapter of the step gets a
device slot (engine/lora.py).
A waiting request whose grammar still compiles (WAITING_FOR_FSM) is passed over the same way, as in vLLM V1;
a request passed over keeps its place in the queue.
Policies: `fcfs` (arrival order; the waiting head blocks those behind it, so nobody starves) and
`priority` (lower `priority` value first, then arrival; running kept in that order so the victim
of a preemption is always the last one).
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig
from testbed.engine.lora import AdapterSlots
from testbed.engine.outputs import SchedulerOutput
from testbed.engine.request import Request, RequestStatus


def count_lora(counts: dict[str, int], req: Request, delta: int) -> None:
    """Count `req` into (1) or out of (-1) `counts`, adapter name -> requests (a base-model request: no-op);
    a name whose count reaches 0 leaves the dict."""
    lr = req.lora_request
    if lr is None:
        return
    n = counts.get(lr.lora_name, 0) + delta
    if n:
        counts[lr.lora_name] = n
    else:
        del counts[lr.lora_name]


class WaitingQueue:
    """Waiting requests in admission order: a deque for fcfs, a heap on (priority, arrival) otherwise.
    `loras` counts the queued requests of each LoRA adapter (by name, kept as they enter and leave)."""

    def __init__(self, policy: str) -> None:
        self.fcfs = policy == "fcfs"
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0
        self.loras: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._dq) if self.fcfs else len(self._heap)

    def push(self, req: Request, front: bool = False) -> None:
        count_lora(self.loras, req, 1)
        if self.fcfs:
            self._dq.appendleft(req) if front else self._dq.append(req)
        else:
            self._seq += 1
            heapq.heappush(self._heap, (req.priority, req.arrival_time, self._seq, req))

    def peek(self) -> Request:
        return self._dq[0] if self.fcfs else self._heap[0][3]

    def pop(self) -> Request:
        req = self._dq.popleft() if self.fcfs else heapq.heappop(self._heap)[3]
        count_lora(self.loras, req, -1)
        return req

    def pop_entry(self):
        """The head's queue entry (the request, or its heap tuple), for `restore` to put back where it was."""
        entry = self._dq.popleft() if self.fcfs else heapq.heappop(self._heap)
        count_lora(self.loras, entry if self.fcfs else entry[3], -1)
        return entry

    def restore(self, entries: list) -> None:
        """Put back entries popped by `pop_entry`, in the order they were popped: the queue is as before."""
        for e in entries:
            count_lora(self.loras, e if self.fcfs else e[3], 1)
        if self.fcfs:
            self._dq.extendleft(reversed(entries))
        else:
            for e in entries:
                heapq.heappush(self._heap, e)

    def remove(self, req: Request) -> None:
        count_lora(self.loras, req, -1)
        if self.fcfs:
            self._dq.remove(req)
        else:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)


def _ending(running: list[Request], start: int) -> bool:
    """Whether a running request from `start` on ends by its in-flight token (its length): its blocks free up
    next step, so a shortage waits for them rather than preempting (it would be the victim, swapped or
    recomputed for nothing)."""
    return any(r.num_pending and r.num_tokens + r.num_pending >= r.length_limit for r in running[start:])


class Scheduler:
    """Decides each step's batch; owns the waiting and running queues of one engine."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill
        self.fcfs = config.policy == "fcfs"
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.swap = config.preemption_mode == "swap"
        self.swapped: deque[Request] = deque()  # swapped out, in the order they resume
        self.num_swapped_out_blocks = 0  # cumulative KV blocks copied to the CPU pool
        self.num_swapped_in_blocks = 0   # and back
        self.num_swap_preemptions = 0    # preemptions that swapped (the others recomputed)
        self.beam_extra = 0  # sequences of the running beam groups beyond one each (max_num_seqs counts every beam)
        self.running_groups = 0  # running beam groups: while 0, no step has a beam row
        self.finished_req_ids: list[str] = []
        self.num_preemptions = 0
        self.num_structured = 0  # live requests carrying a grammar: while 0, steps do not count them
        self.lora = AdapterSlots(config.max_loras, config.max_cpu_loras) if config.enable_lora else None
        self.running_loras: dict[int, int] = {}  # adapter id -> running requests that use it
        self.running_lora_names: dict[str, int] = {}  # the same by adapter name (for the stats)
        self.num_lora_deferred = 0  # waiting requests the last step passed over for their adapter
        self.batch_queue = config.pipeline_parallel_size > 1  # mark scheduled requests in flight until updated

    def add_request(self, req: Request, grammar_ready: bool = True) -> None:
        """Queue a request; `grammar_ready` False: it waits (WAITING_FOR_FSM) until its grammar is marked ready."""
        req.status = RequestStatus.WAITING if grammar_ready else RequestStatus.WAITING_FOR_FSM
        self.num_structured += req.structured
        self.waiting.push(req)

    def _rank(self, req: Request) -> tuple[int, float]:
        return (req.priority, req.arrival_time)

    def _lora_change(self, req: Request, delta: int) -> None:
        """Count `req` into (1) or out of (-1) the running set's adapters."""
        aid = req.lora_request.lora_int_id
        n = self.running_loras.get(aid, 0) + delta
        if n:
            self.running_loras[aid] = n
        else:
            del self.running_loras[aid]
        count_lora(self.running_lora_names, req, delta)

    def _lora_blocked(self, req: Request) -> bool:
        """Whether admitting `req` would give the running set more than max_loras adapters."""
        lr = req.lora_request
        return (lr is not None and lr.lora_int_id not in self.running_loras
                and len(self.running_loras) >= self.config.max_loras)

    def _seats(self, req: Request) -> bool:
        """Whether `req` (beam_width sequences for a beam search) fits max_num_seqs next to the running ones."""
        width = req.beam_params.beam_width if req.beam_params is not None else 1
        return len(self.running) + self.beam_extra + width <= self.max_num_seqs

    def _admit(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if req.beam_params is not None:
            self.beam_extra += req.beam_params.beam_width - 1
            self.running_groups += 1
        if req.lora_request is not None:
            self._lora_change(req, 1)
        if self.fcfs:
            self.running.append(req)
        else:
            keys = [self._rank(r) for r in self.running]
            self.running.insert(bisect.bisect_right(keys, self._rank(req)), req)

    def _preempt_last(self, so: SchedulerOutput) -> Request:
        """Preempt the last running request: swap it out when swapping and the CPU pool can take its blocks,
        else recompute it."""
        victim = self.running.pop()
        if victim.lora_request is not None:
            self._lora_change(victim, -1)
        if victim.beam_params is not None:
            self.beam_extra -= victim.beam_params.beam_width - 1
            self.running_groups -= 1
        # a beam group is one unit: its beams' blocks (shared ones once) or its prompt's, while it computes that
        ids = [s.request_id for s in victim.beams] if victim.beams is not None else [victim.request_id]
        victim.num_preemptions += 1
        self.num_preemptions += 1
        so.preempted_req_ids.append(victim.request_id)
        bm = self.block_manager
        if self.swap and bm.can_swap_out(ids):
            pairs = bm.swap_out(ids)
            so.blocks_to_swap_out.extend(pairs)
            so.num_swapped_out += 1
            self.num_swapped_out_blocks += len(pairs)
            self.num_swap_preemptions += 1
            victim.status = RequestStatus.SWAPPED
            self.swapped.appendleft(victim)
            return victim
        for rid in ids:
            bm.free(rid)
        if victim.beams is not None:  # a beam search recomputes from its prompt: its beams start again
            self.finished_req_ids.extend(ids)
            victim.beams, victim.beams_done = None, []
            del victim.output_token_ids[:]
            victim.num_tokens = victim.num_prompt_tokens
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        self.waiting.push(victim, front=True)
        return victim

    def _schedule_beams(self, so: SchedulerOutput, group: Request, budget: int) -> int | None:
        """Schedule every beam of a beam group past its prompt (one token each), with the copies its shared
        blocks need, preempting from the back of the queue until they fit; the tokens it takes, or None when it
        cannot run this step (the budget is short, or it was the victim itself)."""
        seqs = group.beams
        n = sum(s.num_tokens - s.num_computed_tokens for s in seqs)
        if n > budget:
            return None
        bm = self.block_manager
        while (copies := bm.append_beam_slots(seqs)) is None:
            if self._preempt_last(so) is group:
                return None
        so.blocks_to_copy.extend(copies)
        for s in seqs:  # each computes its newest token: a decode
            c = s.num_computed_tokens
            so.requests.append(s); so.num_new_tokens.append(1); so.num_computed_before.append(c)
            so.block_ids.append(bm.req_blocks[s.request_id])
            s.num_computed_tokens = c + 1
            so.num_decode_tokens += 1
            so.sum_context_tokens += c + 1
            so.sum_attn_pairs += c + 1
            so.max_context_tokens = max(so.max_context_tokens, c + 1)
        return n

    def _swap_in(self, so: SchedulerOutput, budget: int) -> bool:
        """Bring the head of the swapped queue back to the end of the running queue if its blocks and the slots
        of its next tokens fit (the running pass then schedules it); whether it did. It lands at the end: every
        running request outranks it (it was the last when preempted, and nobody is admitted while it waits)."""
        req = self.swapped[0]
        if req.num_pending or req.in_flight:
            return False  # swapped with a token (or a chunk) in flight: resumes once it has landed
        if self.lora is not None and self._lora_blocked(req):
            return False  # its adapter would exceed max_loras: it waits for a running one to end
        n = req.num_tokens - req.num_computed_tokens
        if n > budget:
            if not self.chunked:
                return False
            n = budget
        bm = self.block_manager
        if req.beams is not None:  # a beam group: every beam, each may need a block (new or copied on write)
            rid = tuple(s.request_id for s in req.beams)
            n = len(rid)
            if n > budget or bm.swap_in_blocks(rid) + n > bm.num_free_blocks:
                return False
        else:
            rid = (req.request_id,)
            have = bm.swap_in_blocks(rid)
            if have + max(0, bm.blocks_needed(req.num_computed_tokens + n) - have) > bm.num_free_blocks:
                return False
        pairs = bm.swap_in(rid)
        so.blocks_to_swap_in.extend(pairs)
        self.num_swapped_in_blocks += len(pairs)
        self.swapped.popleft()
        self._admit(req)
        if self.running[-1] is not req:
            raise AssertionError(f"request {req.request_id!r} swapped in ahead of a running request")
        so.new_req_ids.add(req.request_id)
        return True

    def schedule(self) -> SchedulerOutput:
        so = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = []
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        reqs, nnew, nbefore, tables = so.requests, so.num_new_tokens, so.num_computed_before, so.block_ids
        prefill = decode = ctx = pairs = maxc = 0
        running = self.running

        req_blocks, bs = bm.req_blocks, bm.block_size
        ending = False  # a running request whose in-flight token ends it: its blocks free up next step
        stalled = False  # a running request waits for those blocks: admit nobody before it
        i = 0
        while True:  # the running queue, then each request swapped back in (to its end) in turn
            while i < len(running) and budget > 0:
                req = running[i]
                if req.in_flight or (req.beams is not None and any(b.in_flight for b in req.beams)):
                    ending = ending or req.num_tokens + req.num_pending >= req.length_limit
                    i += 1  # its batch is still in the pipeline: not in two in-flight batches
                    continue
                if req.beams is not None:  # a beam group past its prompt: all its beams or none
                    used = self._schedule_beams(so, req, budget)
                    if used is None:
                        break
                    budget -= used
                    i += 1
                    continue
                computed = req.num_computed_tokens
                known = req.num_tokens + req.num_pending
                n = known - computed
                if n <= 0 or (req.num_pending and known >= req.length_limit):
                    ending = ending or known >= req.length_limit
                    i += 1  # its in-flight token ends it (length) or is all it awaits: nothing to compute
                    continue
                if n > budget:
                    n = budget
                blocks = req_blocks.get(req.request_id)
                # Fast path (most decodes): its blocks already cover the new tokens and no prompt block
                # awaits registration in the prefix cache; otherwise ask the block manager, preempting
                # from the back of the queue until it can.
                if blocks is None or len(blocks) * bs < computed + n or computed < req.num_prompt_tokens:
                    scheduled = True
                    while not bm.allocate_slots(req, n):
                        ending = ending or _ending(running, i + 1)
                        if ending:  # wait for the ending requests' blocks rather than preempt (async scheduling)
                            scheduled, stalled = False, True
                            break
                        victim = self._preempt_last(so)
                        if victim is req:
                            scheduled = False
                            break
                    if not scheduled:
                        break
                    blocks = req_blocks[req.request_id]
                i += 1
                reqs.append(req); nnew.append(n); nbefore.append(computed); tables.append(blocks)
                budget -= n
                if computed + n >= known:
                    req.num_pending += 1  # this step samples its next token
                if n == 1 and computed >= req.num_prompt_tokens:
                    decode += 1
                else:
                    prefill += n
                ctx += computed + n
                if computed + n > maxc:
                    maxc = computed + n
                pairs += n * computed + n * (n + 1) // 2
                req.num_computed_tokens = computed + n
            if (i < len(running) or budget <= 0 or not self.swapped or so.preempted_req_ids or stalled
                    or not self._seats(self.swapped[0]) or not self._swap_in(so, budget)):
                break
            running = self.running

        if not so.preempted_req_ids and not stalled and not self.swapped:
            waiting = self.waiting
            skipped: list = []  # queue entries passed over: grammar still compiling, or their adapter (LoRA)
            lora_deferred = 0
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting.peek()
                if req.status == RequestStatus.WAITING_FOR_FSM:
                    skipped.append(waiting.pop_entry())
                    continue
                if not self._seats(req):
                    break
                if req.num_pending or req.in_flight:
                    break  # preempted with a token (or a chunk) in flight: resumes once it has landed
                if self.lora is not None and self._lora_blocked(req):
                    skipped.append(waiting.pop_entry())
                    lora_deferred += 1
                    continue
                hit_blocks, hit = bm.get_computed_blocks(req)
                n = req.num_tokens - hit
                if n > budget:
                    if not self.chunked:
                        break
                    n = budget
                if not bm.allocate_slots(req, n, hit_blocks):
                    break
                waiting.pop()
                self._admit(req)
                running = self.running
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit
                    bm.record_prefix_lookup(req.num_tokens, hit)
                so.new_req_ids.add(req.request_id)
                reqs.append(req); nnew.append(n); nbefore.append(hit); tables.append(bm.req_blocks[req.request_id])
                budget -= n
                if hit + n >= req.num_tokens:
                    req.num_pending += 1
                prefill += n
                ctx += hit + n
                if hit + n > maxc:
                    maxc = hit + n
                pairs += n * hit + n * (n + 1) // 2
                req.num_computed_tokens = hit + n
            if skipped:  # back where they were, ahead of everyone not yet considered
                waiting.restore(skipped)
            self.num_lora_deferred = lora_deferred

        if self.batch_queue:
            for req in reqs:
                req.in_flight = True  # until EngineCore.update applies this batch
        so.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        so.num_prefill_tokens = prefill
        so.num_decode_tokens += decode  # beam rows are counted in as they are scheduled
        so.sum_context_tokens += ctx
        so.sum_attn_pairs += pairs
        so.max_context_tokens = max(so.max_context_tokens, maxc)
        so.has_beams = self.running_groups > 0
        if self.lora is not None:
            self._assign_slots(so)
        if self.num_structured:
            so.num_structured_reqs = sum(1 for r, b, n in zip(reqs, nbefore, nnew) if r.structured and b + n >= r.num_tokens)
        return so

    def _assign_slots(self, so: SchedulerOutput) -> None:
        loras = [r.lora_request for r in so.requests]
        so.lora_slots, so.lora_loads, so.lora_dropped = self.lora.assign(loras)
        so.num_lora_tokens = sum(n for lr, n in zip(loras, so.num_new_tokens) if lr is not None)
        so.num_loras = len({lr.lora_int_id for lr in loras if lr is not None})

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Move a request to a finished state and free its blocks (removal from `running` is the caller's
        batch job via `drop_finished`, to keep it O(batch) per step)."""
        if req.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING and req.lora_request is not None:
            self._lora_change(req, -1)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        if req.status == RequestStatus.RUNNING and req.beam_params is not None:
            self.beam_extra -= req.beam_params.beam_width - 1
            self.running_groups -= 1
        req.status = status
        self.num_structured -= req.structured
        self.block_manager.free(req.request_id)
        self.finished_req_ids.append(req.request_id)
        for s in req.beams or ():
            self.block_manager.free(s.request_id)
            self.finished_req_ids.append(s.request_id)

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def lora_adapters(self) -> tuple[dict[str, int], dict[str, int]]:
        """Adapter name -> requests using it: the running ones, and the waiting ones (queued, or swapped out
        to resume); vLLM's scheduler stats `running_lora_adapters` and `waiting_lora_adapters`."""
        waiting = dict(self.waiting.loras)
        for req in self.swapped:
            count_lora(waiting, req, 1)
        return dict(self.running_lora_names), waiting
