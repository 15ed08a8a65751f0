"""Request and its status: the unit the scheduler moves between queues (its parameters: engine/params.py)."""
from __future__ import annotations

import enum
from typing import Sequence

from testbed.engine.params import PoolingParams, SamplingParams, check_priority


class RequestStatus(enum.IntEnum):
    """Lifecycle: [WAITING_FOR_FSM ->] WAITING -> RUNNING (-> PREEMPTED|SWAPPED -> RUNNING)* -> FINISHED_*.
    Finished ones are >= STOPPED. PREEMPTED: its blocks were freed, its tokens are recomputed; SWAPPED: its
    blocks wait in the CPU pool. WAITING_FOR_FSM (vLLM V1's name): queued, but its grammar is still compiling,
    so the scheduler passes over it until the driver marks the grammar ready (EngineCore.mark_grammar_ready)."""

    WAITING = 0
    WAITING_FOR_FSM = 1
    RUNNING = 2
    PREEMPTED = 3
    SWAPPED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_REJECTED = 8
    FINISHED_ERROR = 9  # the executor failed on this request (its data); the engine went on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence in the engine. Invariants: 0 <= num_computed_tokens <= num_tokens + num_pending,
    num_tokens == num_prompt_tokens + len(output_token_ids) (append only through `append_output`).

    `structured`: the request carries a grammar (the scheduler counts such rows per step for cost
    models; the grammar itself lives in the worker).
    `num_tokens` counts prompt plus generated tokens; the scheduler lets `num_computed_tokens`
    catch up to it (the unified token budget). `num_pending` counts tokens sampled in scheduled steps
    whose values the core has not seen yet (placeholders: with async scheduling the next step may
    compute on them before they arrive). Timestamps are driver-supplied `now` values.
    `lora_request`: the LoRA adapter it runs with (engine/lora.py), None for the base model.
    A pooling request (`pooling_params`, no `sampling_params`) is prompt-only: its length limit is its prompt,
    and it ends, with no token, in the step that computes its last prompt token.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "num_prompt_tokens", "sampling_params", "arrival_time",
        "priority", "eos_token_id", "output_token_ids", "num_computed_tokens", "num_cached_tokens",
        "status", "stop_reason", "num_preemptions", "block_hashes", "first_scheduled_time",
        "first_token_time", "last_token_time", "finish_time", "replica", "max_tokens", "logprobs",
        "num_tokens", "length_limit", "token_stops", "num_pending", "prompt_logprobs", "structured",
        "pooling_params", "lora_request", "beam_params", "beams", "beams_done", "beam", "group", "in_flight", "seq",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None,
        arrival_time: float,
        priority: int = 0,
        eos_token_id: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request=None,
        beam_params=None,
    ) -> None:
        """`beam_params` (engine.params.BeamSearchParams): a beam search; `sampling_params` are then its beams'
        (BeamSearchParams.sampling_params)."""
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        if (sampling_params is None) == (pooling_params is None):
            raise ValueError(f"request {request_id!r}: give sampling_params (generation) or pooling_params "
                             "(embedding), exactly one")
        check_priority(priority)
        # its unset fields take the defaults (LAST, normalised) unless the caller resolved them from a pooler config
        self.pooling_params = None if pooling_params is None else pooling_params.resolve()
        self.lora_request = lora_request  # engine.lora.LoRARequest or None (the base model)
        # beam search (engine/beam_search.py): the group's parameters, its running beams (sequences of their own,
        # made once its prompt is computed) and its complete ones; a beam's state and its group
        self.beam_params = beam_params
        self.beams: list[Request] | None = None
        self.beams_done: list = []
        self.beam = None
        self.group: Request | None = None
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        pooling = pooling_params is not None
        self.logprobs: list | None = [] if not pooling and sampling_params.logprobs is not None else None
        # logprobs of prompt tokens 1.. (token 0 has none), gathered chunk by chunk until the prompt is done
        self.prompt_logprobs: list | None = (
            [] if not pooling and sampling_params.prompt_logprobs is not None else None)
        # the worker masks it with a grammar
        self.structured = not pooling and sampling_params.structured_outputs is not None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] | None = None  # full prompt blocks, filled by the BlockManager
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.replica = 0
        self.seq = -1  # the order its engine received it (EngineCore.add_request), recorded for replays
        if pooling:
            self.max_tokens = 0  # prompt only: its pooled hidden states are the output
        else:
            self.max_tokens = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 62
        self.num_tokens = self.num_prompt_tokens  # prompt + output; kept in step with output_token_ids
        self.num_pending = 0  # sampled tokens (or a pooled output) in flight: scheduled, not yet applied
        self.in_flight = False  # in a batch still in the pipeline (pipeline parallelism's batch queue only)
        self.length_limit = self.num_prompt_tokens + self.max_tokens  # the core caps it at max_model_len
        self.token_stops = not pooling and bool((eos_token_id is not None and not sampling_params.ignore_eos)
                                                or sampling_params.stop_token_ids)

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def token_id(self, i: int) -> int:
        """Token at position i of prompt + output."""
        p = self.num_prompt_tokens
        return int(self.prompt_token_ids[i]) if i < p else self.output_token_ids[i - p]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, as ints."""
        p = self.num_prompt_tokens
        out: list[int] = []
        if start < p:
            out.extend(int(t) for t in self.prompt_token_ids[start:min(end, p)])
        if end > p:
            out.extend(self.output_token_ids[max(start - p, 0):end - p])
        return out

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={len(self.output_token_ids)}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
