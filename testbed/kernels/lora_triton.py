"""Triton multi-LoRA kernels with BGMV semantics (Punica): each token's row against its own slot's matrices.

`lora_shrink`: s[t] = x[t] @ A[idx[t]]^T, float32 [T, n * R]; `lora_expand`: y[t, o] += s[t, slice(o) * R + r]
. B[idx[t], o, r] summed over r. A token whose slot is -1 (the base model) loads and stores nothing. The grids
depend only on the step's token count and the layer's shapes, and every slot index is read on the device, so
both run inside a CUDA graph. Semantics: kernels/lora.py (`lora_apply_ref`, the tests' ground truth).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_slot(Idx, N):
    """(this program's token, its slot clamped to >= 0, N or 0 for a base row: it loads and stores nothing)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Idx + t)
    return t, tl.maximum(slot, 0).to(tl.int64), tl.where(slot >= 0, N, 0)


@triton.jit
def _shrink_kernel(X, A, Idx, S, K, N, stride_x, stride_as, stride_an, stride_s,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t, slot, n_live = _token_slot(Idx, N)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(X + t * stride_x + k, mask=k < tl.where(n_live > 0, K, 0), other=0.0).to(tl.float32)
        a = tl.load(A + slot * stride_as + n[:, None] * stride_an + k[None, :],
                    mask=(n[:, None] < n_live) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(S + t * stride_s + n, acc, mask=n < n_live)


@triton.jit
def _expand_kernel(S, B, Idx, Y, N, R, OFF1, OFF2, stride_s, stride_bs, stride_bn, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t, slot, n_live = _token_slot(Idx, N)
    o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    piece = (o >= OFF1).to(tl.int32) + (o >= OFF2).to(tl.int32)  # the output slice each row belongs to
    mo = o < n_live
    s = tl.load(S + t * stride_s + piece[:, None] * R + r[None, :], mask=mo[:, None] & (r[None, :] < R), other=0.0)
    b = tl.load(B + slot * stride_bs + o[:, None] * stride_bn + r[None, :], mask=mo[:, None] & (r[None, :] < R),
                other=0.0).to(tl.float32)
    delta = tl.sum(s * b, axis=1)
    y = tl.load(Y + t * stride_y + o, mask=mo, other=0.0)
    tl.store(Y + t * stride_y + o, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mo)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_idx: torch.Tensor) -> torch.Tensor:
    """x [T, K], lora_a [slots, N, K], lora_idx [T] -> s [T, N] float32 (base rows left unwritten)."""
    T, K = x.shape
    N = lora_a.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    s = torch.empty(T, N, dtype=torch.float32, device=x.device)
    if T:
        block_n = min(32, triton.next_power_of_2(N))
        _shrink_kernel[(T, triton.cdiv(N, block_n))](x, lora_a, lora_idx, s, K, N, x.stride(0), lora_a.stride(0),
                                                      lora_a.stride(1), s.stride(0), BLOCK_N=block_n, BLOCK_K=128)
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor, lora_idx: torch.Tensor,
                slice_sizes: list[int]) -> None:
    """y [T, N] += s (its slice's R columns) . lora_b [slots, N, R] per token slot, in place (up to 3 slices)."""
    T, N = y.shape
    R = lora_b.shape[2]
    if len(slice_sizes) > 3 or sum(slice_sizes) != N:
        raise ValueError(f"lora_expand: slice sizes {slice_sizes} must be at most 3 and sum to {N}")
    ends = [sum(slice_sizes[:i + 1]) for i in range(len(slice_sizes))] + [N, N]
    if T:
        _expand_kernel[(T, triton.cdiv(N, 64))](s, lora_b, lora_idx, y, N, R, ends[0], ends[1], s.stride(0),
                                                lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_N=64,
                                                BLOCK_R=triton.next_power_of_2(R))
