"""Data-parallel coordinator: picks a replica per request from the replicas' reported stats.

Policies: `round_robin`; `least_loaded` (vLLM's score: 4 x waiting + running); `kv_aware` (lowest
projected KV usage: used blocks plus the blocks its waiting prompts will need); `prefix_affinity`
(the replica most likely to hold the longest prefix of the prompt, by the coordinator's own record
of which block hashes it sent where; least-loaded breaks ties). Stats go stale between reports, so
the coordinator counts each request it routes as waiting there until the next report (as vLLM's
front-end does), which stops a burst from piling onto one replica.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from testbed.engine.config import DP_POLICIES
from testbed.engine.core import ReplicaStats


class DPCoordinator:
    def __init__(self, num_replicas: int, policy: str = "least_loaded", block_size: int = 16,
                 affinity_capacity_blocks: int = 1 << 16) -> None:
        if num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {num_replicas}")
        if policy not in DP_POLICIES:
            raise ValueError(f"--dp-policy must be one of {DP_POLICIES}, got {policy!r}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.stats = [ReplicaStats(0, 0, 0.0, 1, 1) for _ in range(num_replicas)]
        self.pending = [0] * num_replicas          # routed since the replica's last report
        self.pending_blocks = [0] * num_replicas
        self.capacity = affinity_capacity_blocks
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = 0

    def update_stats(self, replica: int, stats: ReplicaStats) -> None:
        self.stats[replica] = stats
        self.pending[replica] = 0
        self.pending_blocks[replica] = 0

    def _load(self, r: int) -> int:
        s = self.stats[r]
        return 4 * (s.num_waiting + self.pending[r]) + s.num_running

    def _kv(self, r: int) -> float:
        s = self.stats[r]
        waiting_blocks = -(-s.num_waiting_tokens // self.block_size) + self.pending_blocks[r]
        return (s.num_blocks - s.num_free_blocks + waiting_blocks) / s.num_blocks

    def route(self, num_prompt_tokens: int, block_hashes: Sequence[int] = ()) -> int:
        """Replica index for a new request (deterministic for a given history of calls)."""
        n = self.num_replicas
        if self.policy == "round_robin":
            r = self._next
            self._next = (r + 1) % n
        elif self.policy == "least_loaded":
            r = min(range(n), key=lambda i: (self._load(i), i))
        elif self.policy == "kv_aware":
            r = min(range(n), key=lambda i: (self._kv(i), self._load(i), i))
        else:
            r = min(range(n), key=lambda i: (-self._prefix_hits(i, block_hashes), self._load(i), i))
            seen = self.seen[r]
            for h in block_hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self.capacity:
                seen.popitem(last=False)
        self.pending[r] += 1
        self.pending_blocks[r] += -(-num_prompt_tokens // self.block_size)
        return r

    def _prefix_hits(self, r: int, block_hashes: Sequence[int]) -> int:
        seen = self.seen[r]
        k = 0
        for h in block_hashes:
            if h not in seen:
                break
            k += 1
        return k
