"""Synthetic SchedulerOutputs of chosen shapes, for driving a real model runner without a scheduler.

Each row is (tokens already in the cache, new tokens, decode?). A decode row is a request whose prompt
is in the cache and whose one output token is computed now, exactly as the scheduler hands it over;
a chunk row computes `new` prompt tokens after `cached` earlier ones and samples once it reaches the
prompt's end. Rows take distinct KV blocks, cycling through the cache, so a step reads as much memory
as a real batch of that shape (shared blocks would sit in L2 and time too fast). The aggregates
(prefill/decode tokens, context, attention pairs) follow the scheduler's definitions.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from testbed.engine.outputs import SchedulerOutput
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request

Row = tuple[int, int, bool]  # (cached tokens before this step, new tokens, is a decode)

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


class StepFactory:
    """Builds SchedulerOutputs over a cache of `num_blocks` blocks; token ids are drawn from [reserved, vocab)."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, seed: int = 0, reserved: int = 1000,
                 scattered: bool = False) -> None:
        """scattered: rows take their blocks in a random order of the whole cache (as a long-running engine's
        free list hands them out) rather than in runs of consecutive ids; either way distinct until the cache
        wraps around."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.rng = np.random.default_rng(seed)
        self.low, self.vocab = min(reserved, vocab_size // 10), vocab_size
        self._order = self.rng.permutation(num_blocks).tolist() if scattered else None
        self._next_block = 0
        self._next_id = 0

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        start = self._next_block
        self._next_block = (start + n) % self.num_blocks
        ids = [(start + j) % self.num_blocks for j in range(n)]
        return ids if self._order is None else [self._order[i] for i in ids]

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(self.low, self.vocab, n, dtype=np.int32)

    def step(self, rows: Sequence[Row]) -> SchedulerOutput:
        so = SchedulerOutput()
        for cached, new, decode in rows:
            if new < 1 or cached < 0 or (decode and (new != 1 or cached < 1)):
                raise ValueError(f"bad synthetic row {(cached, new, decode)}: need new >= 1, cached >= 0, "
                                 "and a decode row computes 1 token after >= 1 cached")
            self._next_id += 1
            if decode:  # prompt of `cached` tokens, one output token being computed
                req = Request(f"syn-{self._next_id}", self._tokens(cached), GREEDY, 0.0)
                req.append_output(int(self._tokens(1)[0]))
                so.num_decode_tokens += 1
            else:
                req = Request(f"syn-{self._next_id}", self._tokens(cached + new), GREEDY, 0.0)
                so.num_prefill_tokens += new
            req.num_computed_tokens = cached + new
            so.requests.append(req)
            so.num_new_tokens.append(new)
            so.num_computed_before.append(cached)
            so.block_ids.append(self._blocks(cached + new))
            so.sum_context_tokens += cached + new
            so.max_context_tokens = max(so.max_context_tokens, cached + new)
            so.sum_attn_pairs += new * cached + new * (new + 1) // 2
        so.total_num_scheduled_tokens = so.num_prefill_tokens + so.num_decode_tokens
        return so


def decode_rows(batch: int, context: int) -> list[Row]:
    """`batch` decodes, each with `context` tokens in the cache (the new token is at position `context`)."""
    return [(context, 1, True)] * batch
