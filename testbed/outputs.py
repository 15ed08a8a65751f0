"""What the offline LLM returns, shaped as vLLM's output objects."""
from __future__ import annotations

from dataclasses import dataclass


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
