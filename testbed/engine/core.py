"""EngineCore: one engine replica (scheduler + block manager + records), driven from outside.

A driver calls `schedule(now)`, runs an executor on the returned SchedulerOutput (a cost model in
simulation, the model on real workers), then `update(output, runner_output, now)`. The core never
reads a clock: both modes feed it their own `now`, which is why the simulator runs this same code.

Grammars (structured outputs) compile off the step loop when `compile_grammars` is on, as in vLLM V1: a
structured request waits as WAITING_FOR_FSM (the scheduler passes over it), the driver takes it from
`take_new_grammars()`, compiles its grammar elsewhere (real: a thread pool of the executor's rank 0;
simulation: a modelled or recorded compile time) and reports back with `mark_grammar_ready` or
`fail_grammar`, each recorded (Recorder.grammars) so a simulation can replay when each grammar was ready.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Protocol

from testbed.engine.beam_search import Beam, best_beams, step_beams
from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig
from testbed.engine.metrics import ASYNC_STEP_COLUMNS, PIPELINE_STEP_COLUMNS, Recorder
from testbed.engine.outputs import ModelRunnerOutput, EngineCoreOutput, SchedulerOutput, check_stop
from testbed.engine.request import Request, RequestStatus
from testbed.engine.scheduler import Scheduler


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class ReplicaStats:
    """What a replica reports to the DP coordinator. `num_added` counts every request the replica
    was given since it started (admitted or rejected), so the coordinator knows which of the requests
    it routed there a report already includes; None = all of them."""

    num_waiting: int
    num_running: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    num_waiting_tokens: int = 0
    num_added: int | None = None


def times(req: Request) -> tuple:
    """A finished request's (first scheduled, first token, last token, finished) times: EngineCoreOutput.timing."""
    return req.first_scheduled_time, req.first_token_time, req.last_token_time, req.finish_time


@dataclass(slots=True)
class TokenCounts:
    """Cumulative token counts of one engine, as vLLM's counters count them: the prompts of the requests whose
    first token is out (and the part of those read from the prefix cache), and every token sampled."""

    prompt: int = 0
    cached_prompt: int = 0
    generation: int = 0


class EngineCore:
    """Admission (with stated rejections), scheduling, token bookkeeping and stop checks.

    Invariant: every request added ends exactly once, as stop / length / abort / rejected / error, and
    is then recorded in `records.requests`.
    """

    def __init__(self, config: EngineConfig, num_gpu_blocks: int | None = None, max_model_len: int | None = None,
                 replica: int = 0, stream_outputs: bool = True, num_cpu_blocks: int | None = None) -> None:
        """`num_cpu_blocks`: the CPU swap pool (the executor's; None: the config's `num_cpu_blocks`, which
        swap mode then needs)."""
        num_gpu_blocks = num_gpu_blocks or config.num_gpu_blocks
        max_model_len = max_model_len or config.max_model_len
        if not num_gpu_blocks or not max_model_len:
            raise ValueError("EngineCore needs num_gpu_blocks and max_model_len (from the config or the executor)")
        self.config = config
        self.max_model_len = max_model_len
        self.replica = replica
        self.stream_outputs = stream_outputs
        if num_cpu_blocks is None:
            num_cpu_blocks = config.num_cpu_blocks
        if num_cpu_blocks is None:
            if config.preemption_mode == "swap":
                raise ValueError("--preemption-mode swap needs the CPU pool's size: num_cpu_blocks (from the "
                                 "executor or the config)")
            num_cpu_blocks = 0
        self.block_manager = BlockManager(num_gpu_blocks, config.block_size, config.enable_prefix_caching,
                                          num_cpu_blocks)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.records = Recorder()
        self.num_waiting_tokens = 0
        self.num_added = 0  # add_request calls, rejections included (ReplicaStats.num_added)
        self.token_counts = TokenCounts()
        self.num_pooling = 0  # live pooling requests: while 0, steps skip the pooling pass
        self.beam_owner: dict[str, Request] = {}  # live beam sequences' ids -> their beam-search group
        self.num_beam_groups = 0  # live beam searches: while 0, updates look for no beam rows
        self._last_update = float("-inf")
        # pipeline parallelism: batches scheduled and not yet updated, and batches scheduled so far
        self.pipelined = config.pipeline_parallel_size > 1
        self.num_in_flight = self.num_launched = 0
        self._unrecorded_preemptions: list[str] = []  # preempted by a schedule that ran nothing (see schedule)
        if self.pipelined:
            self.records.step_extra = PIPELINE_STEP_COLUMNS
        # async scheduling: each step's record also says when it was scheduled (its start is when it began)
        self.record_scheduled = config.async_scheduling and not self.pipelined
        if self.record_scheduled:
            self.records.step_extra = ASYNC_STEP_COLUMNS
        self.compile_grammars = False  # the driver compiles grammars off the step loop (see the module docstring)
        self._new_grammars: list[Request] = []

    # ---- admission -----------------------------------------------------------------------------
    def rejection_reason(self, req: Request) -> str | None:
        """Why a request can never be served here, or None."""
        n, mml = req.num_prompt_tokens, self.max_model_len
        pooling = req.pooling_params is not None
        max_tokens = 0 if pooling else req.sampling_params.max_tokens
        if (max_tokens is None and n >= mml) or (pooling and n > mml):
            return f"prompt has {n} tokens but max_model_len is {mml}; shorten it or raise --max-model-len"
        if max_tokens and n + max_tokens > mml:
            return (f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds max_model_len "
                    f"({mml}); shorten the prompt, lower max_tokens or raise --max-model-len")
        bm = self.block_manager
        total = mml if max_tokens is None else min(n + max_tokens, mml)  # the longest it can grow
        need = bm.blocks_needed(total)
        if need > bm.num_blocks:
            return (f"needs {need} KV blocks but the cache has {bm.num_blocks}; raise --num-gpu-blocks or "
                    f"--gpu-memory-utilization, or shorten the request")
        mnbt = self.config.max_num_batched_tokens
        longest = max(n, total - 1)  # prompt + outputs recomputed after a preemption
        if not self.config.enable_chunked_prefill and longest > mnbt:
            return (f"with chunked prefill off, the prompt plus outputs recomputed after a preemption ({longest} "
                    f"tokens) must fit one step's --max-num-batched-tokens ({mnbt}); raise it, lower max_tokens "
                    f"or enable chunked prefill")
        bp = req.beam_params
        if bp is not None:
            if self.config.async_scheduling or self.config.pipeline_parallel_size > 1:
                return ("beam search chooses each step's beams before the next step is scheduled, which "
                        "--async-scheduling and pipeline parallelism do not wait for; drop them")
            if bp.beam_width > self.config.max_num_seqs:
                return (f"beam_width {bp.beam_width} exceeds --max-num-seqs ({self.config.max_num_seqs}), which "
                        "counts every beam; lower the width or raise --max-num-seqs")
            # its prompt, then each beam's own blocks past it and the block it may copy on write
            worst = bm.blocks_needed(n) + bp.beam_width * (bm.blocks_needed(total - n) + 1)
            if worst > bm.num_blocks:
                return (f"a beam search of width {bp.beam_width} may need {worst} KV blocks but the cache has "
                        f"{bm.num_blocks}; lower beam_width or max_tokens, or raise --num-gpu-blocks")
        if req.lora_request is not None and not self.config.enable_lora:
            return (f"asks for LoRA adapter {req.lora_request.lora_name!r} but LoRA is off; start the engine with "
                    "--enable-lora (LLM(enable_lora=True))")
        limit = self.config.max_num_waiting
        if limit is not None and self.scheduler.num_waiting >= limit:
            return f"waiting queue is full ({limit} requests, --max-num-waiting); retry later"
        return None

    def add_request(self, req: Request, now: float) -> EngineCoreOutput | None:
        """Queue a request; returns a finished 'rejected' output instead when it cannot be served."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}; ids must be unique among live requests")
        req.replica, req.seq = self.replica, self.num_added
        self.num_added += 1
        reason = self.rejection_reason(req)
        if reason is not None:
            req.status = RequestStatus.FINISHED_REJECTED
            req.stop_reason = reason
            req.finish_time = now
            self.records.record_request(req)
            return EngineCoreOutput(req.request_id, [], True, "rejected", reason, timing=times(req))
        self.num_beam_groups += req.beam_params is not None
        if req.pooling_params is not None:
            self.num_pooling += 1
        elif req.sampling_params.max_tokens is None:
            req.max_tokens = self.max_model_len - req.num_prompt_tokens
        req.length_limit = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        self.requests[req.request_id] = req
        self.num_waiting_tokens += req.num_prompt_tokens
        compile_first = self.compile_grammars and req.structured
        self.scheduler.add_request(req, grammar_ready=not compile_first)
        if compile_first:
            self._new_grammars.append(req)
        return None

    # ---- grammars compiled by the driver -------------------------------------------------------
    def take_new_grammars(self) -> list[Request]:
        """The requests added since the last call whose grammar the driver must compile (still live)."""
        new, self._new_grammars = self._new_grammars, []
        return [r for r in new if r.status == RequestStatus.WAITING_FOR_FSM]

    def mark_grammar_ready(self, request_id: str, now: float) -> None:
        """The request's grammar compiled: the scheduler may take it from now on (a finished or unknown id is
        ignored: it was aborted while compiling)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.WAITING_FOR_FSM:
            req.status = RequestStatus.WAITING
            self.records.grammars.append((request_id, self.replica, now, None))

    def fail_grammar(self, request_id: str, reason: str, now: float) -> EngineCoreOutput | None:
        """The request's grammar did not compile (or not in time): it ends 'rejected' with `reason`; None when it
        is no longer waiting for it."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_FSM:
            return None
        self.records.grammars.append((request_id, self.replica, now, reason))
        req.stop_reason = reason
        self._finish(req, RequestStatus.FINISHED_REJECTED, now)
        return EngineCoreOutput(request_id, [], True, "rejected", reason, timing=times(req))

    def abort(self, request_id: str, now: float) -> EngineCoreOutput | None:
        """End a live request (client gone, stop string seen by the front-end); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        was_running = req.status == RequestStatus.RUNNING
        self._finish(req, RequestStatus.FINISHED_ABORTED, now)
        if was_running:
            self.scheduler.drop_finished()
        return EngineCoreOutput(request_id, [], True, "abort", req.stop_reason, max(req.num_cached_tokens, 0),
                             timing=times(req))

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        if req.pooling_params is not None:
            self.num_pooling -= 1
        if req.beam_params is not None:
            self.num_beam_groups -= 1
        for s in req.beams or ():
            self.beam_owner.pop(s.request_id, None)
            s.status = status
        if req.first_scheduled_time is None:
            self.num_waiting_tokens -= req.num_prompt_tokens
        if status == RequestStatus.FINISHED_ERROR:  # its failed step may have left its blocks half written
            self.block_manager.uncache(req.request_id)
        self.scheduler.finish(req, status)
        req.finish_time = now
        self.records.record_request(req)
        del self.requests[req.request_id]

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        so = self.scheduler.schedule()
        if so.is_empty and so.preempted_req_ids:
            # preempted by a schedule that then ran nothing (pipeline parallelism: the rest were in flight):
            # counted with the next step that runs, so the records and the summary keep every preemption
            # whichever loop (real or simulated) happened to call schedule in between
            self._unrecorded_preemptions += so.preempted_req_ids
        elif not so.is_empty and self._unrecorded_preemptions:
            so.preempted_req_ids[:0] = self._unrecorded_preemptions
            self._unrecorded_preemptions = []
        for req_id in so.new_req_ids:
            req = self.requests[req_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self.num_waiting_tokens -= req.num_prompt_tokens
        so.step_state = (now, self.block_manager.num_used_blocks, self.scheduler.num_waiting,
                         self.scheduler.num_running, len(self.scheduler.swapped))
        if self.pipelined and not so.is_empty:  # the step record's microbatch and in-flight count
            self.num_in_flight += 1
            so.step_state += (self.num_launched % self.config.pipeline_parallel_size, self.num_in_flight)
            self.num_launched += 1
        so.has_pooling = self.num_pooling > 0
        return so

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput, now: float) -> list[EngineCoreOutput]:
        """Apply sampled tokens, run stop checks, finish requests, record the step.

        Steps are updated in the order they were scheduled; with async scheduling the next step may
        already be scheduled (on placeholders) when this one is updated, with pipeline parallelism up to
        pipeline_parallel_size - 1 later batches (of other requests). A token of a request that
        finished meanwhile is dropped; one of a request preempted meanwhile is kept (it was sampled
        from the full context)."""
        outputs: list[EngineCoreOutput] = []
        itl_append = self.records.itl.append
        stream = self.stream_outputs
        lps = out.logprobs
        finished_min = RequestStatus.FINISHED_STOPPED
        any_finished = False
        if out.prompt_logprobs is not None:
            for req, chunk in zip(so.requests, out.prompt_logprobs):
                # a chunk extends the list where it ends (one recomputed after a preemption is already there)
                if chunk is not None and req.prompt_logprobs is not None and chunk[0] == len(req.prompt_logprobs):
                    req.prompt_logprobs.extend(chunk[1])
        counts = self.token_counts
        if so.has_pooling:
            any_finished = self._finish_pooled(so, out, now, outputs)
        sampled = 0
        beam_rows: dict[str, list] | None = {} if self.num_beam_groups else None
        for req, tok, lp in zip(so.requests, out.sampled_token_ids, lps if lps is not None else repeat(None)):
            if tok < 0 or req.status >= finished_min:
                continue
            if beam_rows is not None and (req.group is not None or req.beam_params is not None):
                beam_rows.setdefault((req.group or req).request_id, []).append((req, tok, lp))
                continue
            req.num_pending -= 1
            req.append_output(tok)
            sampled += 1
            if lp is not None and req.logprobs is not None:
                req.logprobs.append(lp)
            if req.first_token_time is None:
                req.first_token_time = now
                plp = req.prompt_logprobs  # handed out once, with the first token
                counts.prompt += req.num_prompt_tokens
                counts.cached_prompt += max(req.num_cached_tokens, 0)
            else:
                itl_append(now - req.last_token_time)
                plp = None
            req.last_token_time = now
            status = check_stop(req, tok) if req.token_stops or req.num_tokens >= req.length_limit else None
            if status is not None:
                self._finish(req, status, now)
                any_finished = True
                outputs.append(EngineCoreOutput(req.request_id, [tok], True, status.finish_reason, req.stop_reason,
                                             req.num_cached_tokens, None if lp is None else [lp], plp,
                                             timing=times(req)))
            elif stream or plp is not None:
                outputs.append(EngineCoreOutput(req.request_id, [tok], False, None, None, req.num_cached_tokens,
                                             None if lp is None else [lp], plp))
        for rows in (beam_rows or {}).values():
            sampled += len(rows)
            any_finished |= self._beam_step(rows, now, outputs)
        counts.generation += sampled
        if out.errors:
            for rid, reason in out.errors.items():
                req = self.requests.get(rid) or self.beam_owner.get(rid)
                if req is not None and req.finished:
                    continue
                if req is not None:
                    req.stop_reason = reason
                    self._finish(req, RequestStatus.FINISHED_ERROR, now)
                    any_finished = True
                    outputs.append(EngineCoreOutput(rid, [], True, "error", reason, max(req.num_cached_tokens, 0),
                                                 timing=times(req)))
        if any_finished:
            self.scheduler.drop_finished()
        if self.pipelined:  # a batch's record spans its whole way through the pipeline, from its scheduling
            self._update_pipelined(so, now)
            return outputs
        scheduled, used, waiting, running_n, swapped = so.step_state
        start = max(scheduled, self._last_update)  # overlapped steps: this one ran after the previous one ended
        self._last_update = now
        row = (self.replica, start, now - start, len(so.requests), so.num_prefill_tokens, so.num_decode_tokens,
               so.sum_context_tokens, so.sum_attn_pairs, used, self.block_manager.num_blocks, waiting, running_n,
               len(so.preempted_req_ids), swapped, so.num_swapped_out, len(so.blocks_to_swap_out),
               len(so.blocks_to_swap_in), len(so.blocks_to_copy))
        self.records.steps.append(row + (scheduled,) if self.record_scheduled else row)
        return outputs

    def _beam_step(self, rows: list, now: float, outputs: list[EngineCoreOutput]) -> bool:
        """Apply one step of a beam group (`rows`: its beams' (sequence, drawn token, logprobs), or its own prompt
        row): choose the next beams (engine/beam_search.py), give each its parent's blocks by reference, and end
        the group with its best beams after max_tokens steps; whether it ended."""
        first = rows[0][0]
        group = first.group or first
        bp = group.beam_params
        if any(lp is None for _, _, lp in rows):
            raise RuntimeError(f"beam search {group.request_id!r}: the executor returned no logprobs for its beams")
        if group.beams is None:  # its prompt's row: the first step of its beams
            group.num_pending -= 1
            parents, parent_ids = [Beam([], [], 0.0)], [group.request_id]
        else:
            parents, parent_ids = [s.beam for s, _, _ in rows], [s.request_id for s, _, _ in rows]
        running, done = step_beams(parents, [(tok, lp) for _, tok, lp in rows], bp.beam_width,
                                   group.num_prompt_tokens, group.eos_token_id, bp.ignore_eos, bp.length_penalty)
        group.beams_done.extend(done)
        slots = group.beams if group.beams is not None else []
        while len(slots) < len(running):
            s = Request(f"{group.request_id}#beam{len(slots)}", group.prompt_token_ids, group.sampling_params,
                        group.arrival_time, group.priority, group.eos_token_id, lora_request=group.lora_request)
            s.group, s.status, s.replica, s.block_hashes = group, RequestStatus.RUNNING, group.replica, group.block_hashes
            s.num_cached_tokens, s.first_scheduled_time = group.num_cached_tokens, group.first_scheduled_time
            self.beam_owner[s.request_id] = group
            slots.append(s)
        gone = slots[len(running):]
        for s in gone:
            self.beam_owner.pop(s.request_id, None)
            self.scheduler.finished_req_ids.append(s.request_id)
        slots = slots[:len(running)]
        self.block_manager.fork_tables([parent_ids[p] for p, _ in running], [s.request_id for s in slots],
                                       [*parent_ids, *(s.request_id for s in gone)])
        for s, (_, beam) in zip(slots, running):
            s.beam, s.output_token_ids = beam, list(beam.token_ids)
            s.num_tokens = s.num_computed_tokens = group.num_prompt_tokens + len(beam.token_ids)
            s.num_computed_tokens -= 1  # its newest token is computed next step
        group.beams = slots
        best = running[0][1] if running else max(done, key=lambda b: b.cum_logprob)
        group.output_token_ids = list(best.token_ids)
        group.num_tokens = group.num_prompt_tokens + len(best.token_ids)
        if group.first_token_time is None:
            group.first_token_time = now
            self.token_counts.prompt += group.num_prompt_tokens
            self.token_counts.cached_prompt += max(group.num_cached_tokens, 0)
        else:
            self.records.itl.append(now - group.last_token_time)
        group.last_token_time = now
        if running and group.num_tokens < group.length_limit:
            return False
        final = best_beams([*group.beams_done, *(b for _, b in running)], bp.beam_width, group.num_prompt_tokens,
                           group.eos_token_id, bp.length_penalty)
        status = RequestStatus.FINISHED_STOPPED if final[0].finish_reason == "stop" else RequestStatus.FINISHED_LENGTH
        self._finish(group, status, now)
        outputs.append(EngineCoreOutput(group.request_id, [], True, status.finish_reason, None, group.num_cached_tokens,
                                        timing=times(group), beams=[(b.token_ids, b.logprobs, b.cum_logprob,
                                                                     b.finish_reason) for b in final]))
        return True

    def _update_pipelined(self, so: SchedulerOutput, now: float) -> None:
        """A pipeline-parallel batch left the pipeline: its requests may be scheduled again, and its record
        (start = when it was scheduled, so batches in flight together overlap) ends with its microbatch and
        the in-flight count at its launch."""
        for req in so.requests:
            req.in_flight = False
        self.num_in_flight -= 1
        start, used, waiting, running_n, swapped, microbatch, in_flight = so.step_state
        self.records.steps.append((
            self.replica, start, now - start, len(so.requests), so.num_prefill_tokens, so.num_decode_tokens,
            so.sum_context_tokens, so.sum_attn_pairs, used, self.block_manager.num_blocks, waiting, running_n,
            len(so.preempted_req_ids), swapped, so.num_swapped_out, len(so.blocks_to_swap_out),
            len(so.blocks_to_swap_in), len(so.blocks_to_copy), microbatch, in_flight))

    def _finish_pooled(self, so: SchedulerOutput, out: ModelRunnerOutput, now: float,
                       outputs: list[EngineCoreOutput]) -> bool:
        """End the pooling requests whose last prompt token this step computed, with the executor's pooled
        output (None from an executor that runs no model); whether any ended. Their row's token, if the
        executor gave one, is not theirs to keep (they end first); one the executor failed on ends as an error
        with the others."""
        pooled, counts, ended, failed = out.pooler_output, self.token_counts, False, out.errors or {}
        for i, req in enumerate(so.requests):
            if (req.pooling_params is None or req.finished or req.request_id in failed
                    or so.num_computed_before[i] + so.num_new_tokens[i] < req.num_prompt_tokens):
                continue
            req.num_pending -= 1
            req.first_token_time = req.last_token_time = now
            counts.prompt += req.num_prompt_tokens
            counts.cached_prompt += max(req.num_cached_tokens, 0)
            self._finish(req, RequestStatus.FINISHED_STOPPED, now)
            outputs.append(EngineCoreOutput(req.request_id, [], True, "stop", None, req.num_cached_tokens,
                                         pooling_output=None if pooled is None else pooled[i], timing=times(req)))
            ended = True
        return ended

    def step(self, now: float, executor: Executor) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """schedule + execute + update, with the step ending at now + the executor's duration."""
        so = self.schedule(now)
        if so.is_empty:
            return so, []
        out = executor.execute(so)
        return so, self.update(so, out, now + out.duration)

    # ---- state ---------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> ReplicaStats:
        bm = self.block_manager
        return ReplicaStats(self.scheduler.num_waiting + self.scheduler.num_swapped, self.scheduler.num_running, bm.usage,
                            bm.num_free_blocks, bm.num_blocks, self.num_waiting_tokens, self.num_added)
