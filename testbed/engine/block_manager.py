"""Paged KV-cache block manager: block pool, reference counts, prefix cache, per-request block tables.

Invariants (checked by `check_invariants`, exercised by the property tests):
  * every block is in exactly one state: FREE (ref 0, no hash, in `free_ids`), CACHED (ref 0, hashed,
    in the LRU `cached`), or USED (ref > 0, in at least one request's block table);
    so free + cached + used == num_blocks, and no block sits in two free lists;
  * `hash_to_block` maps exactly the hashed blocks (USED or CACHED), one block per hash;
  * a block's ref count equals the number of block tables holding it (no double free).
A second pool of `num_cpu_blocks` CPU blocks holds the KV of swapped-out requests (swap preemption) with the
same invariants: a CPU block is FREE (ref 0, in `cpu_free_ids`) or USED (ref == the number of swapped block
tables holding it), never both, so free + used (+ cached, none on CPU) == total per pool. A block shared by
several requests of one swap (beams) is copied once, and shared again on the way back.
Allocation takes a FREE block first and evicts the least recently freed CACHED block otherwise;
allocate, free and a cache hit are O(1) per block. Only full prompt blocks are hashed, each hash
chained on its parent's, so a hit on block i implies hits on blocks 0..i-1.
"""
from __future__ import annotations

from collections import OrderedDict
from operator import itemgetter
from typing import Sequence

from testbed.engine.request import Request


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the full blocks of a prompt, each chained on the previous one: block i's hash covers
    blocks 0..i, so equal hashes mean equal prefixes (up to 64-bit collisions)."""
    hashes: list[int] = []
    parent = None
    tolist = getattr(token_ids, "tolist", None)
    tokens = tolist() if tolist else list(token_ids)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    """Owns the KV block pool of one engine; the scheduler asks it for slots, never for memory."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_ref_cnt = [0] * num_cpu_blocks
        self.cpu_free_ids: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.req_cpu_blocks: dict[str, list[int]] = {}  # swapped-out requests' block tables in the CPU pool
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: pops block 0 first
        self.cached: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, least recently freed first
        self.hash_to_block: dict[int, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_registered: dict[str, int] = {}  # leading blocks of a request already offered to the cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of which found cached

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: FREE plus evictable CACHED."""
        return len(self.free_ids) + len(self.cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids) - len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_used_cpu_blocks(self) -> int:
        return self.num_cpu_blocks - len(self.cpu_free_ids)

    @property
    def cpu_usage(self) -> float:
        """Fraction of the CPU swap pool held by swapped-out requests (vLLM V0's cpu_cache_usage)."""
        return self.num_used_cpu_blocks / self.num_cpu_blocks if self.num_cpu_blocks else 0.0

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure_hashes(self, req: Request) -> list[int]:
        if req.block_hashes is None:
            req.block_hashes = prompt_block_hashes(req.prompt_token_ids, self.block_size)
        return req.block_hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request's prompt: (block ids, tokens covered). Pure lookup.

        At least one token is always left to compute, so the model produces a first token. A request still
        gathering prompt logprobs reads nothing from the cache (its cached positions would give none), as vLLM,
        nor does one pooled by MEAN (its mean needs the hidden states of every prompt token)."""
        if not self.enable_prefix_caching:
            return [], 0
        plp = req.prompt_logprobs
        if (plp is not None and len(plp) < req.num_prompt_tokens - 1) or (
                req.pooling_params is not None and req.pooling_params.pooling_type == "MEAN"):
            return [], 0
        hashes = self.ensure_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # ---- mutations -----------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Give `req` blocks for its computed tokens (+ `computed_blocks` hits) plus `num_new_tokens`.

        All or nothing: returns False, changing nothing, when the pool cannot cover it."""
        blocks = self.req_blocks.get(req.request_id)
        have = (len(blocks) if blocks is not None else 0) + len(computed_blocks)
        upto = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-upto // self.block_size) - have
        if need <= 0 and not computed_blocks:
            if self.enable_prefix_caching:
                self._cache_full_blocks(req, blocks, upto)
            return True
        ref_cnt = self.ref_cnt
        reviving = sum(1 for b in computed_blocks if ref_cnt[b] == 0)
        if need > len(self.free_ids) + len(self.cached) - reviving:
            return False
        if blocks is None:
            blocks = self.req_blocks[req.request_id] = []
        for b in computed_blocks:
            if ref_cnt[b] == 0:
                del self.cached[b]
            ref_cnt[b] += 1
            blocks.append(b)
        free_ids = self.free_ids
        fresh = min(need, len(free_ids))
        if fresh > 0:  # FREE blocks first, in the order popping them one by one gives
            taken = free_ids[-fresh:]
            del free_ids[-fresh:]
            taken.reverse()
            for b in taken:
                ref_cnt[b] = 1
            blocks.extend(taken)
        for _ in range(need - max(fresh, 0)):  # then evicted CACHED ones
            b = self._take_block()
            ref_cnt[b] = 1
            blocks.append(b)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, upto)
        return True

    def append_block(self, req: Request, upto: int) -> None:
        """One more block at the end of a running request's table whose blocks its `upto` - 1 computed tokens
        fill (a decode crossing a block boundary), exactly as `allocate_slots(req, 1)` gives it there. The
        caller has checked that a block is free."""
        blocks = self.req_blocks[req.request_id]
        free = self.free_ids
        b = free.pop() if free else self._take_block()  # _take_block's first choice, without the call
        self.ref_cnt[b] = 1
        blocks.append(b)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, upto)

    def _take_block(self) -> int:
        if self.free_ids:
            return self.free_ids.pop()
        b, _ = self.cached.popitem(last=False)  # evict the least recently freed cached block
        del self.hash_to_block[self.block_hash[b]]  # type: ignore[index]
        self.block_hash[b] = None
        return b

    def _cache_full_blocks(self, req: Request, blocks: list[int], upto: int) -> None:
        """Register the full prompt blocks covered by this step so later requests can hit them."""
        hashes = self.ensure_hashes(req)
        n_full = min(upto // self.block_size, len(hashes))
        start = self.req_num_registered.get(req.request_id, 0)
        if n_full <= start:
            return
        block_hash, h2b = self.block_hash, self.hash_to_block
        for i in range(start, n_full):
            b = blocks[i]
            h = hashes[i]
            if block_hash[b] is not None or h in h2b:  # a hit, or another block holds this content
                continue
            block_hash[b] = h
            h2b[h] = b
        self.req_num_registered[req.request_id] = n_full

    # ---- beams: shared tables, copy on write ----------------------------------------------------
    def fork_tables(self, parent_ids: Sequence[str], child_ids: Sequence[str], drop_ids: Sequence[str]) -> None:
        """Give child i a block table sharing every block of parent i's (reference counts up), then release the
        tables of `drop_ids` (the beams being replaced; ids may repeat among the three lists)."""
        tables = [list(self.req_blocks[p]) for p in parent_ids]
        ref_cnt = self.ref_cnt
        for t in tables:
            for b in t:
                ref_cnt[b] += 1
        for rid in drop_ids:
            self.free(rid)
        for rid, t in zip(child_ids, tables):
            self.req_blocks[rid] = t

    def append_beam_slots(self, seqs: Sequence[Request]) -> list[tuple[int, int]] | None:
        """Slots for each beam's uncomputed tokens, all or nothing (None when the pool cannot cover them): a new
        block past a table's end, or, for a block the beam shares with others (reference count > 1), a fresh
        block it writes instead, copied from the shared one (copy on write; the last of the sharers writes in
        place). Returns the (source, destination) copies."""
        bs, ref_cnt = self.block_size, self.ref_cnt
        need, sharers = 0, {}
        for s in seqs:
            table = self.req_blocks[s.request_id]
            for idx in range(s.num_computed_tokens // bs, (s.num_tokens - 1) // bs + 1):
                if idx >= len(table):
                    need += 1
                    continue
                b = table[idx]
                left = sharers.get(b, ref_cnt[b])
                if left > 1:
                    need += 1
                    sharers[b] = left - 1
        if need > len(self.free_ids) + len(self.cached):
            return None
        copies = []
        for s in seqs:
            table = self.req_blocks[s.request_id]
            for idx in range(s.num_computed_tokens // bs, (s.num_tokens - 1) // bs + 1):
                if idx >= len(table):
                    b = self._take_block()
                    ref_cnt[b] = 1
                    table.append(b)
                elif ref_cnt[table[idx]] > 1:
                    src, dst = table[idx], self._take_block()
                    ref_cnt[src] -= 1
                    ref_cnt[dst] = 1
                    table[idx] = dst
                    copies.append((src, dst))
        return copies

    # ---- swapping ------------------------------------------------------------------------------
    def can_swap_out(self, request_ids: Sequence[str]) -> bool:
        """Whether the CPU pool has a block for every distinct GPU block these requests hold."""
        distinct = {b for rid in request_ids for b in self.req_blocks.get(rid, ())}
        return len(distinct) <= len(self.cpu_free_ids)

    def swap_out(self, request_ids: Sequence[str]) -> list[tuple[int, int]]:
        """Move these requests' block tables to the CPU pool (the caller checked `can_swap_out`) and release
        their GPU blocks as `free` does; returns the (GPU block, CPU block) copies to make, one per distinct
        block (blocks the requests share stay shared on the CPU)."""
        mapping: dict[int, int] = {}
        cpu_ref, cpu_free = self.cpu_ref_cnt, self.cpu_free_ids
        for rid in request_ids:
            table = self.req_cpu_blocks[rid] = []
            for b in self.req_blocks.get(rid, ()):
                c = mapping.get(b)
                if c is None:
                    c = mapping[b] = cpu_free.pop()
                cpu_ref[c] += 1
                table.append(c)
        for rid in request_ids:
            self.free(rid, cpu=False)
        return list(mapping.items())

    def swap_in_blocks(self, request_ids: Sequence[str]) -> int:
        """GPU blocks a swap-in of these requests takes (their distinct CPU blocks)."""
        return len({c for rid in request_ids for c in self.req_cpu_blocks.get(rid, ())})

    def swap_in(self, request_ids: Sequence[str]) -> list[tuple[int, int]]:
        """Bring swapped-out block tables back to the GPU pool (the caller checked that `swap_in_blocks` fit
        `num_free_blocks`) and release their CPU blocks; returns the (CPU block, GPU block) copies to make."""
        mapping: dict[int, int] = {}
        cpu_ref, ref_cnt = self.cpu_ref_cnt, self.ref_cnt
        for rid in request_ids:
            table = self.req_blocks[rid] = []
            for c in self.req_cpu_blocks.pop(rid, ()):
                b = mapping.get(c)
                if b is None:
                    b = mapping[c] = self._take_block()
                ref_cnt[b] += 1
                table.append(b)
                cpu_ref[c] -= 1
                if cpu_ref[c] == 0:
                    self.cpu_free_ids.append(c)
        return list(mapping.items())

    def free(self, request_id: str, cpu: bool = True) -> None:
        """Release a request's blocks, tail first, so its tail is evicted before its (shareable) head (and, with
        `cpu`, the CPU blocks it holds while swapped out)."""
        if cpu and request_id in self.req_cpu_blocks:
            cpu_ref = self.cpu_ref_cnt
            for c in reversed(self.req_cpu_blocks.pop(request_id)):
                cpu_ref[c] -= 1
                if cpu_ref[c] == 0:
                    self.cpu_free_ids.append(c)
                elif cpu_ref[c] < 0:
                    raise AssertionError(f"double free of CPU block {c} by request {request_id!r}")
        blocks = self.req_blocks.pop(request_id, None)
        self.req_num_registered.pop(request_id, None)
        if not blocks:
            return
        ref_cnt, block_hash, cached, free = self.ref_cnt, self.block_hash, self.cached, self.free_ids.append
        hashed = self.enable_prefix_caching  # else no block has a hash (only _cache_full_blocks gives one)
        if not hashed and len(blocks) > 1 and itemgetter(*blocks)(ref_cnt).count(1) == len(blocks):
            for b in blocks:  # held by this request alone: every one goes back to the free pool, tail first
                ref_cnt[b] = 0
            self.free_ids.extend(reversed(blocks))
            return
        for b in reversed(blocks):
            n = ref_cnt[b] = ref_cnt[b] - 1
            if n == 0:
                if hashed and block_hash[b] is not None:
                    cached[b] = None
                else:
                    free(b)
            elif n < 0:
                raise AssertionError(f"double free of block {b} by request {request_id!r}")

    def uncache(self, request_id: str) -> None:
        """Take a request's blocks out of the prefix cache (their contents may be wrong), before `free`."""
        h2b, block_hash = self.hash_to_block, self.block_hash
        for b in self.req_blocks.get(request_id, ()):
            if block_hash[b] is not None:
                del h2b[block_hash[b]]
                block_hash[b] = None

    def reset_prefix_cache(self) -> None:
        """Forget every CACHED block (used blocks keep their hashes until freed)."""
        for b in self.cached:
            del self.hash_to_block[self.block_hash[b]]  # type: ignore[index]
            self.block_hash[b] = None
            self.free_ids.append(b)
        self.cached.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken."""
        free, cached = set(self.free_ids), set(self.cached)
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        assert not free & cached, "a block is both FREE and CACHED"
        holders = [0] * self.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                holders[b] += 1
        for b in range(self.num_blocks):
            assert holders[b] == self.ref_cnt[b], f"block {b}: ref {self.ref_cnt[b]} but {holders[b]} holders"
            state = (b in free) + (b in cached) + (self.ref_cnt[b] > 0)
            assert state == 1, f"block {b} is in {state} states"
            if b in free:
                assert self.block_hash[b] is None, f"FREE block {b} has a hash"
            if b in cached:
                assert self.block_hash[b] is not None, f"CACHED block {b} has no hash"
        assert len(free) + len(cached) + sum(r > 0 for r in self.ref_cnt) == self.num_blocks
        hashed = {b for b in range(self.num_blocks) if self.block_hash[b] is not None}
        assert hashed == set(self.hash_to_block.values()), "hash map out of sync with block hashes"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h
        cpu_free = set(self.cpu_free_ids)
        assert len(cpu_free) == len(self.cpu_free_ids), "a CPU block is twice in the free list"
        cpu_holders = [0] * self.num_cpu_blocks
        for blocks in self.req_cpu_blocks.values():
            for c in blocks:
                cpu_holders[c] += 1
        for c in range(self.num_cpu_blocks):
            assert cpu_holders[c] == self.cpu_ref_cnt[c], f"CPU block {c}: ref {self.cpu_ref_cnt[c]} but {cpu_holders[c]} holders"
            assert (c in cpu_free) + (self.cpu_ref_cnt[c] > 0) == 1, f"CPU block {c} is FREE and USED, or neither"
        assert len(cpu_free) + sum(r > 0 for r in self.cpu_ref_cnt) == self.num_cpu_blocks
        assert not set(self.req_cpu_blocks) & set(self.req_blocks), "a request holds GPU and CPU blocks at once"
