"""What the offline LLM returns, shaped as vLLM's output objects (vllm/outputs.py, vllm/sequence.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log probability (of the raw distribution), its rank in that distribution (1 =
    the most likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_dict(token_id: int, entry: tuple, token_text: Callable[[int], str] | None) -> dict[int, Logprob]:
    """vLLM's logprobs of one position, from the engine's (logprob, rank, [(token id, logprob), ...] top N):
    the token at that position first, then the top N with ranks 1..N."""
    lp, rank, top = entry
    text = (lambda t: None) if token_text is None else token_text
    out = {token_id: Logprob(lp, rank, text(token_id))}
    for r, (t, v) in enumerate(top, 1):
        out.setdefault(t, Logprob(v, r, text(t)))
    return out


def prompt_logprob_dicts(prompt_token_ids: Sequence[int], entries: list,
                         token_text: Callable[[int], str] | None) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing precedes it), then one dict a token."""
    return [None, *(logprob_dict(t, e, token_text) for t, e in zip(prompt_token_ids[1:], entries))]


@dataclass
class BeamSearchSequence:
    """One beam of a beam search (vLLM's): its tokens (the prompt's, then the generated ones), per generated token
    the logprobs of the candidates it was chosen among, the sum of its tokens' logprobs, its text (the decoded
    tokens, None without a tokenizer) and why it ended ("stop": EOS, "length": max_tokens)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The result of one prompt's beam search (vLLM's): its best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_sequences(prompt_token_ids: Sequence[int], beams: list, num_top: int,
                   decode: Callable[[list[int]], str] | None, token_text: Callable[[int], str] | None = None
                   ) -> list[BeamSearchSequence]:
    """BeamSearchSequences of the engine's finished beams ((token ids, [{token: logprob}], cum, reason), best
    first). Each step's dict holds its `num_top` top logprobs in rank order, then the drawn token when it was not
    among them (rank None)."""
    text = (lambda t: None) if token_text is None else token_text
    out = []
    for toks, lps, cum, reason in beams:
        dicts = [{t: Logprob(v, r if r <= num_top else None, text(t)) for r, (t, v) in enumerate(d.items(), 1)}
                 for d in lps]
        tokens = [*prompt_token_ids, *toks]
        out.append(BeamSearchSequence(tokens, dicts, cum, None if decode is None else decode(tokens), reason,
                                      None))
    return out


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
    """One generated sequence (vLLM's CompletionOutput); `logprobs` (when asked for) has one dict per token."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Every sequence of one prompt (vLLM's RequestOutput), with the request's metrics and, when asked for,
    the prompt's logprobs (prompt_logprob_dicts)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
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
