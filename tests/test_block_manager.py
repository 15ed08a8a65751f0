"""BlockManager: conservation, ref counts, LRU eviction, prefix hits, all-or-nothing allocation.

A hypothesis state machine drives random sequences of allocate / cache hit / decode growth / free /
re-allocation after preemption / reset_prefix_cache against an independent model of the pool
(block tables, the full token prefix each hashed block holds, the expected free-stack and LRU order).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from testbed.engine.block_manager import BlockManager, prompt_block_hashes
from conftest import make_request

BS = 4
PATTERNS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]  # block contents prompts are built from


def snapshot(bm: BlockManager) -> tuple:
    return (list(bm.free_ids), list(bm.cached), dict(bm.hash_to_block), list(bm.ref_cnt), list(bm.block_hash),
            {k: list(v) for k, v in bm.req_blocks.items()}, dict(bm.req_num_registered))


def prompt_of(blocks: list[int], tail: int) -> list[int]:
    return [t for p in blocks for t in PATTERNS[p]] + [100 + i for i in range(tail)]


def full_blocks(bm: BlockManager, rid: str, n_tokens: int, tokens: list[int] | None = None):
    req = make_request(rid, n_tokens, tokens=tokens)
    assert bm.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    return req


class BlockManagerMachine(RuleBasedStateMachine):
    """Random pool traffic checked against an independent model after every rule."""

    prefix_caching = True
    num_blocks = 12

    @initialize()
    def setup(self) -> None:
        self.bm = BlockManager(self.num_blocks, BS, self.prefix_caching)
        self.reqs = {}      # rid -> Request still around (with or without blocks)
        self.tables = {}    # rid -> our copy of its block table
        self.content = {}   # hashed block -> full token prefix (tuple) it stands for
        self.count = 0

    # ---- independent model helpers ---------------------------------------------------------------
    def expected_hits(self, req) -> list[int]:
        by_prefix = {v: b for b, v in self.content.items()}
        tokens = list(req.prompt_token_ids)
        hits = []
        for j in range(min((req.num_tokens - 1) // BS, len(tokens) // BS)):
            b = by_prefix.get(tuple(tokens[:(j + 1) * BS]))
            if b is None:
                break
            hits.append(b)
        return hits

    def do_allocate(self, req, k: int, hits: list[int]) -> None:
        bm = self.bm
        before = snapshot(bm)
        free_before, cached_before = list(bm.free_ids), list(bm.cached)
        old = self.tables.get(req.request_id, [])
        upto = req.num_computed_tokens + len(hits) * BS + k
        need = max(0, -(-upto // BS) - len(old) - len(hits))
        reviving = sum(1 for b in hits if bm.ref_cnt[b] == 0)
        fits = need <= len(free_before) + len(cached_before) - reviving
        ok = bm.allocate_slots(req, k, hits)
        assert ok == fits
        if not ok:
            assert snapshot(bm) == before, "a failed allocate changed the pool"
            return
        new = bm.block_ids(req.request_id)
        assert new[:len(old)] == old, "existing blocks moved"
        assert new[len(old):len(old) + len(hits)] == hits
        taken = new[len(old) + len(hits):]
        from_free = free_before[::-1][:need]
        evictable = [b for b in cached_before if b not in hits]
        assert taken == from_free + evictable[:need - len(from_free)], "not FREE-stack then least-recently-freed"
        for b in taken:
            self.content.pop(b, None)  # evicted blocks lose their content
        req.num_computed_tokens = upto
        self.tables[req.request_id] = list(new)
        tokens = list(req.prompt_token_ids)
        for i, b in enumerate(new):
            if bm.block_hash[b] is None:
                continue
            assert (i + 1) * BS <= req.num_computed_tokens, "a block was cached before it was computed"
            prefix = tuple(tokens[:(i + 1) * BS])
            assert bm.block_hash[b] == req.block_hashes[i], f"block {b} at index {i} holds another prefix's hash"
            assert self.content.setdefault(b, prefix) == prefix, f"block {b} reused for different content"

    # ---- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.reqs) < 6)
    @rule(blocks=st.lists(st.integers(0, 2), max_size=4), tail=st.integers(0, BS - 1))
    def new_request(self, blocks, tail) -> None:
        tokens = prompt_of(blocks, tail) or [42]
        self.count += 1
        rid = f"r{self.count}"
        self.reqs[rid] = make_request(rid, tokens=tokens, max_tokens=None)

    @precondition(lambda self: any(rid not in self.tables for rid in self.reqs))
    @rule(data=st.data())
    def admit(self, data) -> None:
        """Waiting request: prefix lookup (checked exactly), then allocate with the hits."""
        rid = data.draw(st.sampled_from(sorted(r for r in self.reqs if r not in self.tables)))
        req = self.reqs[rid]
        before = snapshot(self.bm)
        hits, hit_tokens = self.bm.get_computed_blocks(req)
        assert snapshot(self.bm) == before, "get_computed_blocks is not a pure lookup"
        expected = self.expected_hits(req) if self.prefix_caching else []
        assert hits == expected and hit_tokens == len(hits) * BS
        assert hit_tokens < req.num_tokens, "a full hit must leave a token to compute"
        k = data.draw(st.integers(1, req.num_tokens - hit_tokens))
        self.do_allocate(req, k, hits)

    @precondition(lambda self: bool(self.tables))
    @rule(data=st.data())
    def grow(self, data) -> None:
        """Running request: next prompt chunk, or a decode step after appending a sampled token."""
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        req = self.reqs[rid]
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output(data.draw(st.integers(0, 12)))
        self.do_allocate(req, data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens)), [])

    @precondition(lambda self: bool(self.tables))
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt) -> None:
        """Finish (drop) or preempt (keep, recompute later) a request: blocks released tail first."""
        bm = self.bm
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables.pop(rid)
        free_before, cached_before = list(bm.free_ids), list(bm.cached)
        remaining = {b: sum(b in t for t in self.tables.values()) for b in table}
        released = [b for b in reversed(table) if remaining[b] == 0]
        bm.free(rid)
        assert list(bm.cached) == cached_before + [b for b in released if bm.block_hash[b] is not None]
        assert bm.free_ids == free_before + [b for b in released if bm.block_hash[b] is None]
        after = snapshot(bm)
        bm.free(rid)  # a second free is a no-op: the table is gone
        assert snapshot(bm) == after
        req = self.reqs[rid]
        if preempt:
            req.num_computed_tokens = 0
        else:
            del self.reqs[rid]

    @rule()
    def reset_prefix_cache(self) -> None:
        bm = self.bm
        free_before, cached_before = list(bm.free_ids), list(bm.cached)
        used_hashes = {b: bm.block_hash[b] for b in range(bm.num_blocks) if bm.ref_cnt[b] > 0}
        bm.reset_prefix_cache()
        assert not bm.cached and bm.free_ids == free_before + cached_before
        assert all(bm.block_hash[b] == h for b, h in used_hashes.items()), "used blocks lost their hashes"
        for b in cached_before:
            del self.content[b]

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def conserved(self) -> None:
        bm = self.bm
        bm.check_invariants()
        assert bm.req_blocks == self.tables
        used = {b for t in self.tables.values() for b in t}
        assert len(bm.free_ids) + len(bm.cached) + len(used) == bm.num_blocks
        assert bm.num_used_blocks == len(used) and bm.usage == len(used) / bm.num_blocks
        for b in range(bm.num_blocks):
            assert bm.ref_cnt[b] == sum(b in t for t in self.tables.values())
        assert set(self.content) == {b for b in range(bm.num_blocks) if bm.block_hash[b] is not None}
        assert len(set(self.content.values())) == len(self.content), "two blocks cache the same prefix"
        if not self.prefix_caching:
            assert not bm.hash_to_block and not bm.cached


machine_settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
BlockManagerMachine.TestCase.settings = machine_settings
TestBlockManagerWithPrefixCaching = BlockManagerMachine.TestCase


class NoCachingMachine(BlockManagerMachine):
    prefix_caching = False
    num_blocks = 6


NoCachingMachine.TestCase.settings = machine_settings
TestBlockManagerNoCaching = NoCachingMachine.TestCase


# ---- targeted examples -----------------------------------------------------------------------------
def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = full_blocks(bm, "a", 12, prompt_of([0, 1, 2], 0))
    b = full_blocks(bm, "b", 12, prompt_of([2, 1, 0], 0))
    ta, tb = bm.block_ids("a"), bm.block_ids("b")
    bm.free("a")
    bm.free("b")
    assert list(bm.cached) == ta[::-1] + tb[::-1] and not bm.free_ids
    c = make_request("c", 4)
    assert bm.allocate_slots(c, 4)
    assert bm.block_ids("c") == [ta[2]], "the tail of the least recently freed request goes first"
    assert a.block_hashes[2] not in bm.hash_to_block and bm.block_hash[ta[2]] == c.block_hashes[0]
    assert list(bm.cached) == [ta[1], ta[0]] + tb[::-1]
    bm.check_invariants()
    # a's head is still cached: a repeat of a hits its two leading blocks (the third was evicted)
    hits, n = bm.get_computed_blocks(make_request("a2", tokens=list(a.prompt_token_ids) + [99]))
    assert hits == ta[:2] and n == 8
    del b


def test_cache_hit_revives_block_out_of_lru():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    full_blocks(bm, "a", 9, prompt_of([0, 1], 1))
    ta = bm.block_ids("a")
    bm.free("a")
    assert list(bm.cached) == [ta[1], ta[0]] and bm.free_ids[-1] == ta[2]
    r = make_request("r", tokens=prompt_of([0, 1], 3))
    hits, n = bm.get_computed_blocks(r)
    assert hits == ta[:2] and n == 8
    assert bm.allocate_slots(r, r.num_tokens - n, hits)
    assert bm.block_ids("r")[:2] == ta[:2] and not bm.cached and bm.ref_cnt[ta[0]] == 1
    assert bm.num_used_blocks == 3
    bm.check_invariants()


def test_same_prefix_same_blocks_and_chained_hashes():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    full_blocks(bm, "x", 12, prompt_of([0, 1, 2], 0))
    tx = bm.block_ids("x")
    same = make_request("same", tokens=prompt_of([0, 1, 2], 2))
    assert bm.get_computed_blocks(same) == (tx, 12)
    # same later blocks behind a different first block: no hit at all (hashes chain on the parent)
    other = make_request("other", tokens=prompt_of([1, 1, 2], 2))
    assert bm.get_computed_blocks(other) == ([], 0)
    diverge = make_request("div", tokens=prompt_of([0, 2, 2], 2))
    assert bm.get_computed_blocks(diverge) == (tx[:1], 4)
    assert prompt_block_hashes(prompt_of([0, 1], 0), BS)[1] != prompt_block_hashes(prompt_of([1, 1], 0), BS)[1]


def test_full_hit_leaves_one_token_to_compute():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    full_blocks(bm, "a", 8, prompt_of([0, 1], 0))
    ta = bm.block_ids("a")
    bm.free("a")
    again = make_request("again", tokens=prompt_of([0, 1], 0))
    hits, n = bm.get_computed_blocks(again)
    assert hits == ta[:1] and n == 4, "the last full block is recomputed so a first token gets sampled"
    bm.record_prefix_lookup(again.num_tokens, n)
    assert (bm.prefix_queries, bm.prefix_hits) == (8, 4)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    full_blocks(bm, "a", 12, prompt_of([0, 1, 2], 0))
    big = make_request("big", 8)
    before = snapshot(bm)
    assert not bm.allocate_slots(big, 8)
    assert snapshot(bm) == before and "big" not in bm.req_blocks
    # growing a live request beyond the pool fails the same way
    a = make_request("a", tokens=prompt_of([0, 1, 2], 0))
    a.num_computed_tokens = 12
    for _ in range(8):
        a.append_output(1)
    assert not bm.allocate_slots(a, 8) and snapshot(bm) == before
    assert bm.allocate_slots(a, 4) and len(bm.block_ids("a")) == 4 and bm.num_free_blocks == 0


def test_double_free_is_a_noop_and_forced_double_decrement_raises():
    bm = BlockManager(4, BS)
    full_blocks(bm, "a", 6)
    table = bm.block_ids("a")
    bm.free("a")
    state = snapshot(bm)
    bm.free("a")
    assert snapshot(bm) == state and len(bm.free_ids) == 4
    full_blocks(bm, "b", 6)
    bm.req_blocks["ghost"] = list(bm.block_ids("b"))  # forge a second holder without ref counts
    with pytest.raises(AssertionError, match="ref"):
        bm.check_invariants()
    bm.free("b")
    with pytest.raises(AssertionError, match="double free"):
        bm.free("ghost")
    del table


def test_reset_prefix_cache_drops_only_cached_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    full_blocks(bm, "a", 8, prompt_of([0, 1], 0))
    full_blocks(bm, "b", 8, prompt_of([2, 2], 0))
    bm.free("a")
    bm.reset_prefix_cache()
    assert not bm.cached and len(bm.free_ids) == 6 and bm.num_used_blocks == 2
    assert bm.get_computed_blocks(make_request("a2", tokens=prompt_of([0, 1], 1))) == ([], 0)
    assert bm.get_computed_blocks(make_request("b2", tokens=prompt_of([2, 2], 1)))[1] == 8
    bm.check_invariants()


def test_disabled_prefix_caching_never_hits_or_hashes():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    full_blocks(bm, "a", 8, prompt_of([0, 1], 0))
    bm.free("a")
    assert bm.get_computed_blocks(make_request("a2", tokens=prompt_of([0, 1], 1))) == ([], 0)
    assert not bm.cached and len(bm.free_ids) == 8 and not bm.hash_to_block


def test_bad_pool_size():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)
