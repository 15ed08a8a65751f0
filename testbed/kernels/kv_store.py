"""Triton KV store: scatter this step's key/value rows into the paged cache through a slot mapping.

One program per token; slot = block_id * block_size + offset, and slot -1 (padding, e.g. CUDA-graph
batch padding) writes nothing. Key/value may be strided views (e.g. slices of a fused QKV output).
"""

import torch
import triton
import triton.language as tl

from testbed.kernels.reference import check_cache


@triton.jit
def _store_kernel(Key, Value, KCache, VCache, Slots, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_kb, stride_kp, stride_kch, stride_vb, stride_vp, stride_vch,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + token).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(Key + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(Value + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = KCache + blk * stride_kb + off * stride_kp + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = VCache + blk * stride_vb + off * stride_vp + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VCache.dtype.element_ty), mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Triton version of `store_kvcache_ref` (slots are not range-checked: that would need a device sync)."""
    check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:] \
            or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"store_kvcache: key/value {tuple(key.shape)}/{tuple(value.shape)} must be [num_tokens, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] and slot_mapping {tuple(slot_mapping.shape)} [num_tokens]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"store_kvcache: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kvcache: k_cache/v_cache must be contiguous in head_dim")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if num_kv_heads * head_dim <= 256 else 4)
