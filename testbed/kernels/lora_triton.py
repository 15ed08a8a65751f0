"""Triton multi-LoRA kernels with Punica's semantics (each token's row against its own slot's matrices), grouped
by slot as SGMV groups them, so a slot's matrices are read once per block of tokens rather than once per token.

`lora_shrink`: s[t] = x[t] @ A[idx[t]]^T, float32 [T, n * R]; `lora_expand`: y[t, o] += s[t, slice(o) * R + r]
. B[idx[t], o, r] summed over r. A program owns one slot and a block of 16 tokens: it keeps the rows of its slot
(tl.dot over the block, the other rows masked out) and skips a block holding none, so a token whose slot is -1
(the base model) is loaded and stored by no program. The shrink splits K over programs (atomic float32 adds
into a zeroed s) so a decode step's few tokens still fill the GPU; the expand writes each (token, output) once,
from the one program of that token's slot. Grids depend only on the step's token count, the slot count and the
layer's shapes, and every slot index is read on the device, so both run inside a CUDA graph. Why grouped: the
per-token form (one program per token) read each slot's B once per token, T x out x R elements a layer, and its
serial K loop left a decode step latency-bound (Llama-3.1-8B at 64 tokens: 0.02-0.06 ms a projection, about 5 ms
a step). Semantics: kernels/lora.py (`lora_apply_ref`, the tests' ground truth).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16      # tokens a program takes (tl.dot's smallest M)
SHRINK_K = 64     # K elements a shrink iteration loads
K_STEPS = 4       # shrink iterations a program runs (K is split over programs beyond that)
EXPAND_O = 64     # output columns an expand program writes
EXPAND_T_GRID = 64  # token-block programs per (slot, column block); each loops over its share of the blocks


@triton.jit
def _shrink_kernel(X, A, Idx, S, T, K, N, K_PER, stride_x, stride_as, stride_an, stride_s,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    slot = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    mine = tl.load(Idx + t, mask=t < T, other=-1) == slot
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        t64 = t.to(tl.int64)
        n = tl.arange(0, BLOCK_N)
        a_base = A + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        k_lo = tl.program_id(2) * K_PER
        for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(X + t64[:, None] * stride_x + k[None, :], mask=mine[:, None] & (k[None, :] < K), other=0.0)
            ak = tl.load(a_base + n[None, :] * stride_an + k[:, None], mask=(n[None, :] < N) & (k[:, None] < K),
                         other=0.0)
            acc += tl.dot(xk, ak.to(xk.dtype))
        tl.atomic_add(S + t64[:, None] * stride_s + n[None, :], acc, mask=mine[:, None] & (n[None, :] < N))


@triton.jit
def _expand_kernel(S, B, Idx, Y, T, N, R, OFF1, OFF2, stride_s, stride_bs, stride_bn, stride_y,
                   BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    slot = tl.program_id(0)
    o0 = tl.program_id(1) * BLOCK_O
    o = o0 + tl.arange(0, BLOCK_O)
    r = tl.arange(0, BLOCK_R)
    piece = (o >= OFF1).to(tl.int32) + (o >= OFF2).to(tl.int32)  # the output slice each column belongs to
    b = tl.load(B + slot.to(tl.int64) * stride_bs + o[None, :] * stride_bn + r[:, None],
                mask=(o[None, :] < N) & (r[:, None] < R), other=0.0).to(tl.float32)  # [R, O], read once
    first, last = tl.min(piece, axis=0), tl.max(tl.where(o < N, piece, 0), axis=0)
    for tb in range(tl.program_id(2), tl.cdiv(T, BLOCK_T), tl.num_programs(2)):
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        mine = tl.load(Idx + t, mask=t < T, other=-1) == slot
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            t64 = t.to(tl.int64)
            acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
            for p in range(first, last + 1):  # at most 3 slices meet in a column block
                sp = tl.load(S + t64[:, None] * stride_s + p * R + r[None, :], mask=mine[:, None] & (r[None, :] < R),
                             other=0.0)
                acc += tl.dot(sp, tl.where(piece[None, :] == p, b, 0.0), input_precision="ieee")
            m = mine[:, None] & (o[None, :] < N)
            ptr = Y + t64[:, None] * stride_y + o[None, :]
            y = tl.load(ptr, mask=m, other=0.0)
            tl.store(ptr, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=m)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_idx: torch.Tensor) -> torch.Tensor:
    """x [T, K], lora_a [slots, N, K], lora_idx [T] -> s [T, N] float32 (base rows zero)."""
    T, K = x.shape
    slots, N = lora_a.shape[0], lora_a.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    s = torch.zeros(T, N, dtype=torch.float32, device=x.device)
    if T:
        k_per = SHRINK_K * K_STEPS
        _shrink_kernel[(slots, triton.cdiv(T, BLOCK_T), triton.cdiv(K, k_per))](
            x, lora_a, lora_idx, s, T, K, N, k_per, x.stride(0), lora_a.stride(0), lora_a.stride(1), s.stride(0),
            BLOCK_T=BLOCK_T, BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_K=SHRINK_K)
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor, lora_idx: torch.Tensor,
                slice_sizes: list[int]) -> None:
    """y [T, N] += s (its slice's R columns) . lora_b [slots, N, R] per token slot, in place (up to 3 slices)."""
    T, N = y.shape
    slots, R = lora_b.shape[0], lora_b.shape[2]
    if len(slice_sizes) > 3 or sum(slice_sizes) != N:
        raise ValueError(f"lora_expand: slice sizes {slice_sizes} must be at most 3 and sum to {N}")
    ends = [sum(slice_sizes[:i + 1]) for i in range(len(slice_sizes))] + [N, N]
    if T:
        grid_t = min(triton.cdiv(T, BLOCK_T), EXPAND_T_GRID)
        _expand_kernel[(slots, triton.cdiv(N, EXPAND_O), grid_t)](
            s, lora_b, lora_idx, y, T, N, R, ends[0], ends[1], s.stride(0), lora_b.stride(0), lora_b.stride(1),
            y.stride(0), BLOCK_T=BLOCK_T, BLOCK_O=EXPAND_O, BLOCK_R=max(16, triton.next_power_of_2(R)))
