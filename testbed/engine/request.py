"""Request, SamplingParams and request status: the unit the scheduler moves between queues."""
from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING)* -> FINISHED_*. Finished ones are >= STOPPED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6
    FINISHED_ERROR = 7  # the executor failed on this request (its data); the engine went on

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


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # the engine stores ids, seeds and priorities as int64
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-30 overflow
MAX_N = 128  # sequences per prompt (OpenAI's bound on `n`)
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's bound)


class InvalidParam(ValueError):
    """A request parameter out of range; `param` names it (the API server answers 400 with it)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param} {reason}")
        self.param = param


def _int_in(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_priority(priority) -> None:
    """A request's scheduling priority must fit the engine's int64."""
    if not _int_in(priority, INT64_MIN, INT64_MAX):
        raise InvalidParam("priority", f"must be an integer in [-2**63, 2**63 - 1], got {priority!r}")


def _is_token(t, vocab_size: int) -> bool:
    try:
        return not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
    except TypeError:
        return False


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Every token id must index the vocabulary (the embedding reads out of bounds otherwise). Integer
    lists and arrays are checked with numpy; anything else id by id."""
    if len(ids) == 0:
        return
    arr = np.asarray(ids) if not isinstance(ids, np.ndarray) else ids
    if arr.ndim == 1 and arr.dtype.kind in "iu" and arr.min() >= 0 and arr.max() < vocab_size:
        return
    for t in ids:
        if not _is_token(t, vocab_size):
            shown = int(t) if isinstance(t, (int, np.integer)) and not isinstance(t, bool) else repr(t)
            raise InvalidParam(param, f"token id {shown} is outside the vocabulary [0, {vocab_size})")


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of sequence `index` of an n > 1 request: seed + index, wrapped into int64."""
    return None if seed is None else (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN


@dataclass
class SamplingParams:
    """Per-request generation settings with vLLM's names; the one validator of them, for the offline
    API and the API server alike. Construction checks every range that does not depend on the model
    (InvalidParam naming the field) and normalises: `top_k` -1 becomes 0 (off), a temperature below
    SAMPLING_EPS becomes 0 (greedy). `verify(vocab_size)` adds the vocabulary-dependent checks."""

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
        if not _int_in(self.n, 1, MAX_N):
            raise InvalidParam("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        t = self.temperature
        if not (_number(t) and 0 <= t < math.inf):
            raise InvalidParam("temperature", f"must be a finite number >= 0, got {t!r}")
        self.temperature = 0.0 if t < SAMPLING_EPS else float(t)
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidParam("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _int_in(self.top_k, -1, INT64_MAX):
            raise InvalidParam("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _int_in(self.seed, INT64_MIN, INT64_MAX):
            raise InvalidParam("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.max_tokens is not None and not _int_in(self.max_tokens, 1, INT64_MAX):
            raise InvalidParam("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _int_in(self.min_tokens, 0, INT64_MAX):
            raise InvalidParam("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_LOGPROBS):
            raise InvalidParam("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParam("stop", f"strings must be non-empty, got {s!r}")
            check_text(s, "stop")
        for t in self.stop_token_ids:
            if not _int_in(t, 0, INT64_MAX):
                raise InvalidParam("stop_token_ids", f"must be token ids (integers >= 0), got {t!r}")
        if self.top_k == -1:
            self.top_k = 0

    def verify(self, vocab_size: int) -> "SamplingParams":
        """Check everything again (a field may have been set after construction) plus what depends on
        the model: top_k up to the vocabulary size, stop_token_ids inside the vocabulary."""
        self.__post_init__()
        if self.top_k > vocab_size:
            raise InvalidParam("top_k", f"must be -1, 0 (off) or in [1, {vocab_size}] (the vocabulary size), "
                                        f"got {self.top_k}")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_text(text: str, param: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (JSON "\\ud800") cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParam(param, f"holds a lone surrogate {text[e.start]!r} at character {e.start}, which is "
                                  "not valid Unicode text; send UTF-8 text") from None


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
        check_priority(priority)
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
