"""The prefix-cache hit rate a trace allows, from its `hash_ids` alone (no simulation).

A prompt block can come from a prefix cache only if an earlier request had the same prefix up to and
including that block. Counting those blocks over the trace in arrival order gives the hit rate of one
cache that never evicts and never sees two sharers in flight at once: the bound every cache size,
routing policy and arrival pattern stays under (up to the rounding of a prompt's last, partial block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from testbed.workload.trace import TraceRequest


@dataclass(frozen=True)
class PrefixReuse:
    """Prompt tokens of the counted requests, and how many of them repeat an earlier request's prefix."""

    prompt_tokens: int
    reusable_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_reuse(requests: Iterable[TraceRequest]) -> PrefixReuse:
    """Reusable prompt tokens of `requests` (in the order given: arrival order for a loaded trace). Every
    request needs `hash_ids`; a prefix is keyed by the chain of its ids, so equal ids after a difference
    do not count, as in a block-hash prefix cache."""
    seen: set[int] = set()
    total = reusable = 0
    for r in requests:
        if r.hash_ids is None:
            raise ValueError(f"request {r.id} has no hash_ids: the bound needs a trace with prefix hash ids "
                             "(Mooncake JSONL, or the project JSONL with hash_ids)")
        key, shared, prefix = 0, 0, True
        for h in r.hash_ids:
            key = hash((key, h))  # ints and tuples of ints hash the same in every process
            if prefix and key in seen:
                shared += 1
            else:
                prefix = False
                seen.add(key)
        total += r.input_tokens
        reusable += min(shared * r.hash_block_size, r.input_tokens)
    return PrefixReuse(total, reusable)
