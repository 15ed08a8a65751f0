"""Batched paged attention: the CPU worker's attention path.

The same semantics as `paged_decode_attention_ref` and `paged_prefill_attention_ref` (reference.py, the
tests' ground truth), computed for the whole step at once: one gather of every sequence's blocks from the
paged cache, this step's keys/values written over their positions, and one masked
`scaled_dot_product_attention` per group of sequences (per tile of QUERY_TILE query rows in a long prefill
chunk), with no Python loop over sequences.

Whatever depends only on the step (not on the layer) is built once per step into an `AttentionPlan` that
every layer reuses: the gather indices and masks, and, for the model's path (`step_plan`), the rotary
cos/sin at the step's positions and the validated cache slots of its tokens. Sequences are grouped so that
padding stays small: the rows with one query token (decodes) form one group, those with longer chunks
(prefills) another, each padded to its longest query and its longest sequence. GQA: the query heads of one
KV head are folded into the query rows, so keys/values are never repeated per query head.

Invariant: cache slots that a sequence does not own but that its padded gather reads (the tail of its last
block, block 0 under padding) hold finite values; they are masked out, and the cache is zero-filled at
allocation and only ever written with keys/values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from testbed.kernels.reference import check_cache, rope_cos_sin

QUERY_TILE = 256  # padded query rows of a prefill group per SDPA call: its mask stays G x group x 256 x keys


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to max_q query rows and num_blocks blocks each.

    blocks [G, num_blocks] long: the cache blocks to gather (table padding clamped to block 0).
    seq_idx/q_idx [T_g] long: where each of the group's query tokens sits in the padded [G, max_q] grid.
    rows [T_g] long or None: the group's query tokens in the step's flat q (None: all of them, in order).
    key_pos [T_g] long or None: the absolute position of each query token, where a prefill writes this
    step's key/value over the gathered cache (None for decodes, whose keys are all in the cache).
    pos [G, max_q] long: the absolute position of every padded query row (0 for padding: it sees key 0 only,
    so its discarded output stays finite).
    mask: `_mask(pos)` when max_q is 1 (decodes: built once, used by every layer), else None (a prefill
    builds it per query tile, so a long chunk never holds a [max_q, num_keys] mask).
    """

    blocks: torch.Tensor
    seq_idx: torch.Tensor
    q_idx: torch.Tensor
    rows: torch.Tensor | None
    key_pos: torch.Tensor | None
    pos: torch.Tensor
    mask: torch.Tensor | None
    max_q: int


@dataclass
class AttentionPlan:
    """One step's batched-attention indices for a given head grouping; every layer of the step shares it.
    `step_plan` adds what the model's layers share besides: rotary (cos | cos, -sin | sin) at the step's positions,
    the cache slots of the tokens that are stored (slots), and those tokens' rows (store_rows; None: all)."""

    groups: list[AttentionGroup]
    group_size: int  # query heads per KV head
    num_tokens: int  # query tokens of the step (rows of q)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    slots: torch.Tensor | None = None
    store_rows: torch.Tensor | None = None


def _group(block_tables: torch.Tensor, block_size: int, group_size: int, seqs: torch.Tensor,
           q_starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor, max_q: int,
           prefill: bool, all_rows: bool) -> AttentionGroup:
    """The group of sequences `seqs` whose queries are flat rows q_starts[i] .. + q_lens[i]."""
    num_blocks = max(1, -(-int(seq_lens.max()) // block_size))
    ctx = seq_lens - q_lens if prefill else seq_lens  # the positions read from the cache
    if -(-int(ctx.max()) // block_size) > block_tables.shape[1]:
        raise ValueError(f"seq_lens {seq_lens.tolist()} need more blocks than the block table's {block_tables.shape[1]}")
    table = block_tables[seqs, :min(num_blocks, block_tables.shape[1])].long().clamp_min(0)
    if table.shape[1] < num_blocks:  # positions past the table come from this step's keys only
        table = F.pad(table, (0, num_blocks - table.shape[1]))
    seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    q_idx = torch.arange(int(q_lens.sum())) - starts[seq_idx]
    rows = None if all_rows else q_starts[seq_idx] + q_idx
    ctx = seq_lens - q_lens  # the first query's position
    pos = torch.zeros(len(seqs), max_q, dtype=torch.long)
    pos[seq_idx, q_idx] = ctx[seq_idx] + q_idx
    mask = _mask(pos, num_blocks * block_size, group_size) if max_q == 1 else None
    return AttentionGroup(table, seq_idx, q_idx, rows, ctx[seq_idx] + q_idx if prefill else None, pos, mask, max_q)


def _mask(pos: torch.Tensor, num_keys: int, group_size: int) -> torch.Tensor:
    """Additive mask [G, 1, group * Q, num_keys] of the query rows at positions pos [G, Q], rows ordered (head in
    group, query): 0 where key t <= the row's position, -inf elsewhere (what SDPA makes of a bool mask)."""
    ok = torch.arange(num_keys).view(1, 1, -1) <= pos.unsqueeze(-1)
    ok = ok.unsqueeze(1).expand(-1, group_size, -1, -1).reshape(pos.shape[0], 1, group_size * pos.shape[1], -1)
    return torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, group_size: int
                ) -> AttentionPlan:
    """One query token per sequence at position seq_lens[i] - 1; rows with seq_len 0 are left out (zeros)."""
    lens = seq_lens.long()
    live = torch.nonzero(lens > 0).flatten()
    groups = []
    if live.numel():
        one = torch.ones_like(live)
        groups.append(_group(block_tables, block_size, group_size, live, live, one, lens[live], 1, False,
                             live.numel() == lens.numel()))
    return AttentionPlan(groups, group_size, lens.numel())


def prefill_plan(cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 group_size: int) -> AttentionPlan:
    """Query chunks of cu_seqlens_q over their cached prefix plus this step's keys: decodes (one token) and
    longer chunks in separate groups; sequences without queries are left out."""
    cu = cu_seqlens_q.long()
    lens, starts, q_lens = seq_lens.long(), cu[:-1], cu[1:] - cu[:-1]
    if bool(((q_lens < 0) | (q_lens > lens)).any()):
        raise ValueError(f"prefill: query lengths {q_lens.tolist()} must lie in [0, seq_len] ({lens.tolist()})")
    groups = []
    for sel in (q_lens == 1, q_lens > 1):
        seqs = torch.nonzero(sel).flatten()
        if seqs.numel():
            ql = q_lens[seqs]
            groups.append(_group(block_tables, block_size, group_size, seqs, starts[seqs], ql, lens[seqs],
                                 int(ql.max()), True, int(ql.sum()) == int(cu[-1]) and bool(sel.all())))
    return AttentionPlan(groups, group_size, int(cu[-1]))


def step_plan(is_decode: bool, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None, cos_sin_cache: torch.Tensor,
              k_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> AttentionPlan:
    """The plan of one model step (the attention context's tensors), with the rotary cos/sin and the cache slots
    validated once: every layer then rotates, stores and attends with no per-layer index work."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    plan = (decode_plan(block_tables, seq_lens, block_size, group) if is_decode else
            prefill_plan(cu_seqlens_q, block_tables, seq_lens, block_size, group))
    slots = slot_mapping.long()
    valid = slots >= 0
    n_slots = k_cache.shape[0] * block_size
    if slots.shape != positions.shape or bool((slots >= n_slots).any()):
        raise ValueError(f"slot_mapping {tuple(slots.shape)} must give one slot below {n_slots} per token "
                         f"({positions.numel()})")
    plan.store_rows = None if bool(valid.all()) else torch.nonzero(valid).flatten()
    plan.slots = slots if plan.store_rows is None else slots[plan.store_rows]
    cos, sin = rope_cos_sin(positions, cos_sin_cache, dtype)
    plan.rotary = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return plan


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotate_ref` in four ops, bit for bit: x * (cos | cos) + (x2 | x1) * (-sin | sin)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * signed_sin


def rope_store_batched(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_store_kvcache_ref` with the step plan's cos/sin and slots: returns the rotated (q, k)."""
    q, k = _rotate(q, *plan.rotary), _rotate(k, *plan.rotary)
    rows = plan.store_rows
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    for cache, new in ((k_cache, k), (v_cache, v)):
        new = new if rows is None else new.index_select(0, rows)
        cache.view(n_slots, *cache.shape[2:]).index_copy_(0, plan.slots, new.to(cache.dtype))
    return q, k


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks [G, nb] of a paged cache as float32 rows [G * nb, block elements] (index_select on the flat
    view: far cheaper on CPU than advanced indexing of the 4-D cache)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks.flatten()).float()


def _attend(plan: AttentionPlan, g: AttentionGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, k: torch.Tensor | None, v: torch.Tensor | None, query_tile: int) -> torch.Tensor:
    """One group's attention: its query tokens' outputs [T_g, num_heads, head_dim] in float32."""
    n, nb = g.blocks.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    keys = _gather(k_cache, g.blocks).view(n, nb * block_size, num_kv_heads, head_dim)
    values = _gather(v_cache, g.blocks).view(n, nb * block_size, num_kv_heads, head_dim)
    qg = q if g.rows is None else q[g.rows]
    if g.key_pos is not None:  # a prefill: this step's keys/values, not their cache slots
        keys[g.seq_idx, g.key_pos] = (k if g.rows is None else k[g.rows]).float()
        values[g.seq_idx, g.key_pos] = (v if g.rows is None else v[g.rows]).float()
    group, keys, values = plan.group_size, keys.transpose(1, 2), values.transpose(1, 2)
    if g.max_q == 1:
        # [G, Hkv, group, D]: the query heads of a KV head folded into its query rows
        qp = qg.float().reshape(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=g.mask, scale=scale)
        return o.reshape(n, num_kv_heads * group, head_dim)
    qp = qg.new_zeros(n, g.max_q, qg.shape[1], head_dim, dtype=torch.float32)
    qp[g.seq_idx, g.q_idx] = qg.float()
    qp = qp.view(n, g.max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [G, Hkv, group, max_q, D]
    tiles = []
    for a in range(0, g.max_q, query_tile):
        b = min(a + query_tile, g.max_q)
        qt = qp[:, :, :, a:b].reshape(n, num_kv_heads, group * (b - a), head_dim)
        mask = _mask(g.pos[:, a:b], keys.shape[2], group)
        tiles.append(F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, scale=scale)
                     .view(n, num_kv_heads, group, b - a, head_dim))
    o = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=3)
    o = o.permute(0, 3, 1, 2, 4).reshape(n, g.max_q, num_kv_heads * group, head_dim)
    return o[g.seq_idx, g.q_idx]


def paged_attention_batched(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            query_tile: int = QUERY_TILE) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] attends as `plan` says; k/v (prefill plans): this step's keys and
    values [num_tokens, num_kv_heads, head_dim]; query_tile: padded query rows of a prefill group per SDPA call.
    Math in float32; returns a tensor like q (zeros for rows the plan leaves out)."""
    check_cache(k_cache, v_cache)
    if q.shape[0] != plan.num_tokens or q.shape[1] != k_cache.shape[2] * plan.group_size:
        raise ValueError(f"q {tuple(q.shape)} does not fit the plan ({plan.num_tokens} tokens, "
                         f"{k_cache.shape[2]} KV heads x {plan.group_size})")
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _attend(plan, plan.groups[0], q, k_cache, v_cache, scale, k, v, query_tile).to(q.dtype)
    out = torch.zeros_like(q)
    for g in plan.groups:  # at most two: decodes and longer chunks
        out[g.rows] = _attend(plan, g, q, k_cache, v_cache, scale, k, v, query_tile).to(q.dtype)
    return out
