"""Torch reference versions of the KV store and paged attention kernels.

They define the semantics that the Triton kernels and the CPU worker's batched attention (batched.py)
must match: tests compare against them. Written for reading, one sequence at a time. Cache layout per layer: ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token slot = block_id * block_size + offset. All math is fp32; outputs are in q's dtype.
A sequence with seq_len 0 (a padding row) gets an all-zero output.
"""

import torch


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise a clear error unless k_cache/v_cache are matching 4-D paged caches."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise unless q is [tokens, num_heads, head_dim] with num_heads a multiple of num_kv_heads."""
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q must be [tokens, num_heads, head_dim={k_cache.shape[3]}], got {tuple(q.shape)}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate | up) -> silu(gate) * up [..., I], eager in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D/2] at `positions` [T] from a float32 cache [max_position, D] of (cos | sin), rounded
    to `dtype` (as Hugging Face Llama does)."""
    cos, sin = cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) rotation of x [T, H, D] by `rope_cos_sin`'s cos/sin; a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding of q [T, Hq, D] and k [T, Hk, D] at `positions` [T]
    from a float32 cache [max_position, D] of (cos | sin); cos/sin are rounded to q's dtype first, as
    Hugging Face Llama does. Returns new tensors."""
    cos, sin = rope_cos_sin(positions, cos_sin_cache, q.dtype)
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


def rope_store_kvcache_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, then the rotated k and v into the paged cache; returns rotated (q, k)."""
    q, k = rope_ref(positions, q, k, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the cache at slot_mapping; slot -1 is skipped."""
    check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"store_kvcache: key/value {tuple(key.shape)}/{tuple(value.shape)} must be [num_tokens, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] and slot_mapping {tuple(slot_mapping.shape)} [num_tokens]")
    slots = slot_mapping.long()
    valid = slots >= 0
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    if bool((slots[valid] >= n_slots).any()):
        raise ValueError(f"store_kvcache: slot out of range (cache has {n_slots} slots)")
    idx = slots[valid]
    k_cache.view(n_slots, *k_cache.shape[2:]).index_copy_(0, idx, key[valid].to(k_cache.dtype))
    v_cache.view(n_slots, *v_cache.shape[2:]).index_copy_(0, idx, value[valid].to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Return the first seq_len positions of one sequence as a contiguous [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    if n_blocks > block_table.shape[0]:
        raise ValueError(f"seq_len {seq_len} needs {n_blocks} blocks but the block table has {block_table.shape[0]}")
    blocks = block_table[:n_blocks].long()
    if bool(((blocks < 0) | (blocks >= cache.shape[0])).any()):
        raise ValueError(f"block table entry out of range [0, {cache.shape[0]}) within seq_len {seq_len}")
    return cache[blocks].reshape(n_blocks * block_size, *cache.shape[2:])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """Causal GQA attention of q [n, H, D] at absolute positions q_start.. over k/v [L, Hkv, D] (fp32 out)."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().view(n, num_kv_heads, group, -1)
    scores = torch.einsum("nkgd,tkd->kgnt", qf, k.float()) * scale
    q_pos = torch.arange(q_start, q_start + n, device=q.device).view(n, 1)
    mask = torch.arange(seq_len, device=q.device).view(1, seq_len) <= q_pos
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("kgnt,tkd->nkgd", probs, v.float())
    return out.reshape(n, num_heads, -1)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence (its own KV already stored) attends to its seq_lens[i] cached positions.

    q [num_seqs, num_heads, head_dim]; block_tables int32 [num_seqs, max_blocks]; num_splits is ignored.
    """
    check_cache(k_cache, v_cache)
    check_heads(q, k_cache)
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or seq_lens.shape != q.shape[:1]:
        raise ValueError(f"decode: block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"must have num_seqs={q.shape[0]} rows")
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len)
        v = gather_kv(v_cache, block_tables[i], seq_len)
        out[i] = _attend(q[i:i + 1], k, v, scale, seq_len - 1)[0].to(q.dtype)
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention for the last q_len_i positions of each sequence over its cached prefix plus this step's keys.

    q [total_q_tokens, num_heads, head_dim]; k/v [total_q_tokens, num_kv_heads, head_dim] this step's keys and
    values; cu_seqlens_q int32 [num_seqs+1]; seq_lens int32 [num_seqs] counts all positions incl. this step's;
    query j of sequence i sits at absolute position ctx_i + j with ctx_i = seq_lens[i] - q_len_i and sees keys
    0..that position: positions < ctx_i are read from the paged cache, the rest are k/v rows
    cu_seqlens_q[i].. (the cache slots of this step's tokens are not read).
    """
    check_cache(k_cache, v_cache)
    check_heads(q, k_cache)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"prefill: cu_seqlens_q {tuple(cu_seqlens_q.shape)} must be [num_seqs+1] and block_tables "
                         f"{tuple(block_tables.shape)} [num_seqs, max_blocks] for num_seqs={num_seqs}")
    kv_shape = (q.shape[0], *k_cache.shape[2:])
    if k.shape != kv_shape or v.shape != kv_shape:
        raise ValueError(f"prefill: k/v {tuple(k.shape)}/{tuple(v.shape)} must be [num_tokens, num_kv_heads, "
                         f"head_dim] = {list(kv_shape)}")
    cu = cu_seqlens_q.tolist()
    if cu[-1] != q.shape[0]:
        raise ValueError(f"prefill: cu_seqlens_q[-1]={cu[-1]} but q has {q.shape[0]} tokens")
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[i + 1] - cu[i]
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"prefill: sequence {i} has q_len {q_len} outside [0, seq_len={seq_len}]")
        if q_len == 0:
            continue
        ctx = seq_len - q_len
        keys = torch.cat([gather_kv(k_cache, block_tables[i], ctx).float(), k[cu[i]:cu[i + 1]].float()])
        values = torch.cat([gather_kv(v_cache, block_tables[i], ctx).float(), v[cu[i]:cu[i + 1]].float()])
        out[cu[i]:cu[i + 1]] = _attend(q[cu[i]:cu[i + 1]], keys, values, scale, ctx).to(q.dtype)
    return out
