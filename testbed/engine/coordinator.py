"""Data-parallel coordinator: picks a replica per request from the replicas' reported stats.

Policies: `round_robin`; `least_loaded` (vLLM's score: 4 x waiting + running); `kv_aware` (lowest
projected KV usage: used blocks plus the blocks its waiting prompts will need); `prefix_affinity`
(the replica most likely to hold the longest prefix of the prompt, by the coordinator's own record
of which block hashes it sent where; least-loaded breaks ties); `lora_affinity` (a request with a LoRA adapter
goes to the least-loaded replica the coordinator sent that adapter to lately, by its own record of up to
`lora_capacity` adapters per replica, so adapters stay put instead of loading everywhere, unless that replica's
load exceeds the least-loaded one's by more than LORA_AFFINITY_SLACK; base requests go least-loaded). Stats go stale between reports, so
the coordinator counts each request it routed that a replica's latest report does not include yet
as waiting there (as vLLM's front-end does), which stops a burst from piling onto one replica.
A request counts the same whether a report shows it waiting or it is still pending, so routing does
not depend on when exactly a replica admitted it.

StatsPublisher is the replicas' side: when a replica sends a report. Real replicas and simulated
ones run the same rule, so both modes route on equally stale stats.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from testbed.engine.config import DP_POLICIES
from testbed.engine.core import ReplicaStats

LORA_AFFINITY_SLACK = 8  # load units (4 per waiting request, 1 per running one) affinity may cost over the least loaded


class DPCoordinator:
    def __init__(self, num_replicas: int, policy: str = "least_loaded", block_size: int = 16,
                 affinity_capacity_blocks: int = 1 << 16, lora_capacity: int = 1) -> None:
        if num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {num_replicas}")
        if policy not in DP_POLICIES:
            raise ValueError(f"--dp-policy must be one of {DP_POLICIES}, got {policy!r}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.stats = [ReplicaStats(0, 0, 0.0, 1, 1) for _ in range(num_replicas)]
        self.routed = [0] * num_replicas           # requests routed to each replica so far
        self.unreported: list[deque[int]] = [deque() for _ in range(num_replicas)]  # their prompt tokens
        self.pending_tokens = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.capacity = affinity_capacity_blocks
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.lora_capacity = lora_capacity
        self.adapters: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]  # ids sent there
        self._next = 0
        # each replica's load and projected KV usage, as _load and _kv compute them from its stats and pending
        # requests (kept up to date where either changes, so a route reads them without a call per replica)
        self.loads = [self._load(r) for r in range(num_replicas)]
        self.kvs = [self._kv(r) for r in range(num_replicas)]

    @property
    def pending(self) -> list[int]:
        """Per replica: requests routed there that its latest report does not include."""
        return [len(q) for q in self.unreported]

    def update_stats(self, replica: int, stats: ReplicaStats) -> None:
        """Take a replica's report. With `num_added` set, the requests routed there beyond that count
        stay pending (they were in flight when the replica sampled its stats); without it the report
        is taken to include every request routed so far."""
        self.stats[replica] = stats
        q = self.unreported[replica]
        keep = 0 if stats.num_added is None else self.routed[replica] - stats.num_added
        keep = max(0, min(len(q), keep))
        while len(q) > keep:
            self.pending_tokens[replica] -= q.popleft()
        self.loads[replica], self.kvs[replica] = self._load(replica), self._kv(replica)

    def set_alive(self, replica: int, alive: bool) -> None:
        """A dead replica gets no more requests (round robin skips it too)."""
        self.alive[replica] = alive

    def _load(self, r: int) -> int:
        s = self.stats[r]
        return 4 * (s.num_waiting + len(self.unreported[r])) + s.num_running

    def _kv(self, r: int) -> float:
        s = self.stats[r]
        waiting_blocks = -(-(s.num_waiting_tokens + self.pending_tokens[r]) // self.block_size)
        return (s.num_blocks - s.num_free_blocks + waiting_blocks) / s.num_blocks

    def route(self, num_prompt_tokens: int, block_hashes: Sequence[int] = (), lora_id: int = 0) -> int:
        """Replica index for a new request (deterministic for a given history of calls); `lora_id`: its LoRA
        adapter's id (0: the base model). ValueError when every replica is dead."""
        everyone = all(self.alive)
        live = range(self.num_replicas) if everyone else [i for i in range(self.num_replicas) if self.alive[i]]
        if not live:
            raise ValueError("no live data-parallel replica to route to (all of them died)")
        loads = self.loads
        if self.policy == "round_robin":
            r = self._next
            while not self.alive[r]:
                r = (r + 1) % self.num_replicas
            self._next = (r + 1) % self.num_replicas
        elif self.policy == "least_loaded":  # the first of the least loaded: by (load, index)
            r = loads.index(min(loads)) if everyone else min(live, key=loads.__getitem__)
        elif self.policy == "kv_aware":
            r = min(zip(self.kvs, loads, range(self.num_replicas)) if everyone else
                    ((self.kvs[i], loads[i], i) for i in live))[2]
        elif self.policy == "lora_affinity":
            r = self._lora_route(live, lora_id)
        else:
            r = min(live, key=lambda i: (-self._prefix_hits(i, block_hashes), loads[i], i))
            seen = self.seen[r]
            for h in block_hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self.capacity:
                seen.popitem(last=False)
        self.routed[r] += 1
        self.unreported[r].append(num_prompt_tokens)
        self.pending_tokens[r] += num_prompt_tokens
        loads[r], self.kvs[r] = self._load(r), self._kv(r)
        return r

    def _lora_route(self, live: Sequence[int], lora_id: int) -> int:
        loads = self.loads
        r = min(live, key=loads.__getitem__)
        if not lora_id:
            return r
        holders = [i for i in live if lora_id in self.adapters[i]]
        if holders:
            best = min(holders, key=loads.__getitem__)
            if loads[best] - loads[r] <= LORA_AFFINITY_SLACK:
                r = best
        held = self.adapters[r]
        held[lora_id] = None
        held.move_to_end(lora_id)
        while len(held) > self.lora_capacity:
            held.popitem(last=False)
        return r

    def _prefix_hits(self, r: int, block_hashes: Sequence[int]) -> int:
        seen = self.seen[r]
        k = 0
        for h in block_hashes:
            if h not in seen:
                break
            k += 1
        return k


class StatsPublisher:
    """When a replica reports its stats: after a step whose update changed its queues (a request
    started, finished or was preempted), once at least `interval` seconds passed since its previous
    report, and at once when the replica has just become idle (so an idle replica never looks busy).
    A change not reported yet is reported after a later step. Staleness of a report the coordinator
    holds: at most `interval` + one step + the message's transit."""

    def __init__(self, interval: float = 0.0) -> None:
        self.interval = interval
        self.last = float("-inf")
        self.dirty = False

    def after_update(self, now: float, changed: bool, idle: bool) -> bool:
        """Called after each step's update at `now`; True = report now."""
        self.dirty = self.dirty or changed
        if self.dirty and (idle or now - self.last >= self.interval):
            self.last, self.dirty = now, False
            return True
        return False
