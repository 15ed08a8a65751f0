"""Request, SamplingParams and request status: the unit the scheduler moves between queues."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING)* -> FINISHED_*. Finished ones are >= STOPPED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6

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
}


@dataclass
class SamplingParams:
    """Per-request generation settings with vLLM's names. `top_k` 0 or -1 means off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 0, f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {msg}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Request:
    """One sequence in the engine. Invariants: 0 <= num_computed_tokens <= num_tokens + num_pending,
    num_tokens == num_prompt_tokens + len(output_token_ids) (append only through `append_output`).

    `num_tokens` counts prompt plus generated tokens; the scheduler lets `num_computed_tokens`
    catch up to it (the unified token budget). `num_pending` counts tokens sampled in scheduled steps
    whose values the core has not seen yet (placeholders: with async scheduling the next step may
    compute on them before they arrive). Timestamps are driver-supplied `now` values.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "num_prompt_tokens", "sampling_params", "arrival_time",
        "priority", "eos_token_id", "output_token_ids", "num_computed_tokens", "num_cached_tokens",
        "status", "stop_reason", "num_preemptions", "block_hashes", "first_scheduled_time",
        "first_token_time", "last_token_time", "finish_time", "replica", "max_tokens", "logprobs",
        "num_tokens", "length_limit", "token_stops", "num_pending",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        eos_token_id: int | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
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
        self.max_tokens = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 62
        self.num_tokens = self.num_prompt_tokens  # prompt + output; kept in step with output_token_ids
        self.num_pending = 0  # sampled tokens in flight (scheduled, not yet appended)
        self.length_limit = self.num_prompt_tokens + self.max_tokens  # the core caps it at max_model_len
        self.token_stops = bool((eos_token_id is not None and not sampling_params.ignore_eos)
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
