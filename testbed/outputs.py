"""What the offline LLM returns, shaped as vLLM's output objects (vllm/outputs.py, vllm/sequence.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """When things happened to a request (vLLM's RequestMetrics), in time.time() seconds: `arrival_time`,
    `first_scheduled_time`, `first_token_time`, `last_token_time`, `finished_time` (None where it never got
    that far) and `time_in_queue` (first scheduled - arrival). For the n sequences of one prompt: the first
    scheduling and first token of any, the last token and finish of the last."""

    arrival_time: float
    last_token_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Every sequence of one prompt (vLLM's RequestOutput), with the request's metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's EmbeddingOutput): the pooled final hidden states."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one prompt of `LLM.embed` (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
