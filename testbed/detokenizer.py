"""Incremental detokenization with stop strings, shared by the offline LLM and the API server.

Text is emitted only once it is stable: a delta whose last character is the replacement char
(a multi-byte character split across tokens) waits for the next token. The last few prompt
tokens seed the window so the first output token gets its leading space right (vLLM's scheme).
Invariant: `text` equals decode(output tokens) up to a stop string, which is cut off (or kept
with include_stop_str_in_output) and reported once.
"""
from __future__ import annotations

from typing import Sequence

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        ctx = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self.tokens: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.stop = list(stop)
        self.skip = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output tokens; returns the newly stable text (cut at a stop string once one appears)."""
        if self.stop_hit is not None:
            return ""
        before = len(self.text)
        for tid in token_ids:
            self.tokens.append(int(tid))
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stop:
            self._check_stop(before)
        return self.text[before:]

    def _check_stop(self, before: int) -> None:
        longest = max(len(s) for s in self.stop)
        window_start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stop_hit = s
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]

    def flush(self) -> str:
        """Text still held back at the end of a request (e.g. a dangling partial character)."""
        if self.stop_hit is not None:
            return ""
        full = self._decode(self.tokens[self.prefix_offset:])
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        tail = full[len(prefix):] if len(full) > len(prefix) else ""
        self.text += tail
        return tail
