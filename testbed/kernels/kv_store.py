"""Triton KV store: scatter this step's key/value rows into the paged cache through a slot mapping,
optionally rotating q and k first (rotary embedding fused with the store: one kernel per layer less).

One program per token; slot = block_id * block_size + offset, and slot -1 (padding, e.g. CUDA-graph
batch padding) writes nothing. Key/value may be strided views (e.g. slices of a fused QKV output);
with the rotary embedding, q and k are rotated in place and the rotated k is what the cache holds.
"""

import torch
import triton
import triton.language as tl

from testbed.kernels.reference import check_cache


@triton.jit
def _rotate_rows(X, stride_h, cos, sin, NUM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Rotate-half RoPE of NUM head rows at X in place (fp32 math, one rounding); returns the halves."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_h[:, None] < NUM) & (offs_r[None, :] < HALF)
    ptr = X + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty)
    r2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty)
    tl.store(ptr, r1, mask=mask)
    tl.store(ptr + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _store_kernel(Key, Value, KCache, VCache, Slots, Q, Positions, CosSin,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_kp, stride_kch,
                  stride_vb, stride_vp, stride_vch, stride_qt, stride_qh, stride_cs,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, NUM_HEADS: tl.constexpr,
                  BLOCK_QH: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + token).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    k_dst = KCache + blk * stride_kb + off * stride_kp + offs_h[:, None] * stride_kch
    if ROPE:  # every token is rotated (padding too: harmless); only real slots are stored
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_r = tl.arange(0, BLOCK_R)
        pos = tl.load(Positions + token).to(tl.int64)
        cs = CosSin + pos * stride_cs + offs_r
        cos = tl.load(cs, mask=offs_r < HALF, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
        sin = tl.load(cs + HALF, mask=offs_r < HALF, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
        _rotate_rows(Q + token * stride_qt, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_QH, BLOCK_R)
        k1, k2 = _rotate_rows(Key + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_H, BLOCK_R)
        if slot >= 0:
            mask_r = (offs_h[:, None] < NUM_KV_HEADS) & (offs_r[None, :] < HALF)
            tl.store(k_dst + offs_r[None, :], k1.to(KCache.dtype.element_ty), mask=mask_r)
            tl.store(k_dst + HALF + offs_r[None, :], k2.to(KCache.dtype.element_ty), mask=mask_r)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    if slot >= 0:
        if not ROPE:
            k = tl.load(Key + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
            tl.store(k_dst + offs_d[None, :], k.to(KCache.dtype.element_ty), mask=mask)
        v = tl.load(Value + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        v_dst = VCache + blk * stride_vb + off * stride_vp + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(v_dst, v.to(VCache.dtype.element_ty), mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> None:
    """Triton version of `store_kvcache_ref` (slots are not range-checked: that would need a device sync).
    With rope = (positions, q, cos_sin_cache): `rope_store_kvcache_ref`, rotating q and key in place."""
    check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:] \
            or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"store_kvcache: key/value {tuple(key.shape)}/{tuple(value.shape)} must be [num_tokens, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] and slot_mapping {tuple(slot_mapping.shape)} [num_tokens]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"store_kvcache: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if rope is None:
        key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kvcache: k_cache/v_cache must be contiguous in head_dim")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if rope is None:
        positions, q, cos_sin = slot_mapping, key, key  # unused
    else:
        positions, q, cos_sin = rope
        if head_dim % 2 or q.dim() != 3 or q.shape[0] != num_tokens or q.shape[2] != head_dim \
                or positions.shape != (num_tokens,) or cos_sin.shape[-1] != head_dim or cos_sin.stride(-1) != 1:
            raise ValueError(f"rope_store_kvcache: q {tuple(q.shape)} must be [{num_tokens}, heads, {head_dim}] "
                             f"(even head_dim), positions {tuple(positions.shape)} [{num_tokens}] and cos_sin_cache "
                             f"{tuple(cos_sin.shape)} [max_position, {head_dim}] contiguous")
        if q.stride(-1) != 1 or key.stride(-1) != 1:
            raise ValueError("rope_store_kvcache: q and key are rotated in place, so they must be contiguous in "
                             "head_dim")
    _store_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), q, positions, cos_sin, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), q.stride(0), q.stride(1), cos_sin.stride(0),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), ROPE=rope is not None, NUM_HEADS=q.shape[1],
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_R=triton.next_power_of_2(max(head_dim // 2, 1)),
        num_warps=1 if q.shape[1] * head_dim <= 256 else 4)
