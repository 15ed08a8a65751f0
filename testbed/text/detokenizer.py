"""Incremental detokenization with stop strings, one instance per generated sequence.

Text grows by decoding a short window of recent ids twice (with and without the newest token) and
appending the difference, so each token costs O(window) instead of re-decoding the whole output; a
window whose text ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token. The first
window starts inside the prompt so leading spaces come out as a full decode would give them.
Stop strings: text is truncated where one starts (kept with include_stop_str_in_output) and the
caller aborts the core request; while running, the last len(longest stop) - 1 characters are held
back from the stream, since they may turn out to begin a stop string.
Special tokens are dropped (skip_special_tokens) or kept; kept ones follow each other without the space
a tokenizer's decoder may put before them when spaces_between_special_tokens is off (vLLM's rule for
fast tokenizers: an added token right after another one is its bare content).
Invariant: the concatenation of every `delta()` equals `text`, streamed or not.
"""
from __future__ import annotations

PROMPT_WINDOW = 5  # prompt tokens that seed the first window
REPLACEMENT = "\ufffd"


class TokenTexts:
    """Decoded text of single token ids (for logprobs), cached: top-N lists repeat ids a lot."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{token_id}"
            else:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if len(self.cache) < 1 << 16:
                self.cache[token_id] = s
        return s


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # a fast tokenizer's Rust decoder, called directly: the same text as tokenizer.decode without clean-up
        # (tests/test_detokenizer.py holds them equal), without transformers' Python around each call
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip = skip_special_tokens
        # added token id -> its content, when consecutive added tokens must be joined bare
        self.added: dict[int, str] | None = None
        if tokenizer is not None and not skip_special_tokens and not spaces_between_special_tokens:
            self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()} or None
        self.last_added = False
        tail = list(prompt_token_ids[-PROMPT_WINDOW:]) if tokenizer is not None else []
        self.ids = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self.text = ""
        self.emitted = 0
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.holdback = 0 if include_stop_str_in_output else max(self.max_stop - 1, 0)
        self.stop_reason: str | None = None
        self.num_tokens = 0  # tokens consumed (up to the one that completed a stop string)

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def _step(self, final: bool = False) -> None:
        """Decode the window; `final` forces out pending bytes even if incomplete."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT)):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> bool:
        """Append new tokens; True when a stop string appeared (tokens after it are not consumed)."""
        for tid in token_ids:
            if self.stop_reason is not None:
                return True
            self.num_tokens += 1
            if self.tokenizer is None:
                continue
            self.ids.append(tid)
            before = len(self.text)
            self._step()
            if self.added is not None:
                content = self.added.get(tid)
                if content is not None and self.last_added and len(self.text) > before:
                    self.text = self.text[:before] + content
                self.last_added = content is not None
            if self.stop and len(self.text) > before and self._check_stop(before):
                return True
        return self.stop_reason is not None

    def _check_stop(self, before: int) -> bool:
        start = max(0, before - self.max_stop + 1)
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.stop_reason = s
                self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
                return True
        return False

    def finish(self) -> None:
        """The sequence ended without a stop string: flush bytes still waiting for completion."""
        if self.tokenizer is not None and self.stop_reason is None and self.read_offset < len(self.ids):
            before = len(self.text)
            self._step(final=True)
            if self.stop and len(self.text) > before:
                self._check_stop(before)

    def delta(self, final: bool) -> str:
        """Text not yet returned; while running, minus the hold-back tail."""
        upto = len(self.text) if final else max(len(self.text) - self.holdback, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
