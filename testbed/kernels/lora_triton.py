"""Triton multi-LoRA kernels in Punica's SGMV form: the step's tokens sorted by adapter slot, each slot's run cut
into blocks of 16 tokens, one program per block (and per K split or column block), so a slot's A and B tiles are
read once per block rather than once per token.

`lora_segments` sorts a step's tokens by slot once, on the device (every layer shares it); `lora_shrink`:
s[t] = x[t] @ A[idx[t]]^T, float32 [T, n * R]; `lora_expand`: y[t, o] += s[t, slice(o) * R + r] . B[idx[t], o, r]
summed over r. A token whose slot is -1 (the base model) is in no block: no program loads or stores it. The
shrink splits K over programs (float32 atomic adds into a zeroed s) so a decode step's few blocks still fill the
GPU; the expand writes each (token, column) once, from the block holding that token. Every grid depends only on
the step's token count, the slot count and the layer's shapes, and the sort, the blocks and every slot index live
on the device, so all of it runs inside a CUDA graph. Why sorted blocks (measured, benchmarks/lora.py on an
H100): one program per token read B once per token, T x out x R elements a layer, 0.12 ms for gate_up at 256
tokens; blocks of one slot found by scanning every slot (c5b7e22) read every slot's B per column block, slower
again with 16 adapters. Semantics: kernels/lora.py (`lora_apply_ref`, the tests' ground truth).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_T = 16       # tokens of one slot a program takes (tl.dot's smallest M)
SHRINK_K = 64      # K elements a shrink iteration loads
K_PER_PROGRAM = 512  # K elements one shrink program covers (K is split over programs beyond that)
EXPAND_O = 64      # output columns an expand program writes


@dataclass
class LoRASegments:
    """A step's tokens grouped by slot, on the device: `order` the token rows sorted by slot (base rows first),
    slot s's rows at order[starts[s] : starts[s] + counts[s]], cut into nblocks[s] blocks numbered from
    bstart[s]; `max_blocks` bounds the blocks of any step of this many tokens (the grids' size)."""

    order: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    bstart: torch.Tensor
    nblocks: torch.Tensor
    max_blocks: int


def lora_segments(lora_idx: torch.Tensor, num_slots: int) -> LoRASegments:
    """Sort the tokens of a step by slot (torch ops on the device, no host read: graph-safe)."""
    T = lora_idx.numel()
    live = lora_idx >= 0
    order = torch.argsort(lora_idx, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.long, device=lora_idx.device)
    counts.scatter_add_(0, lora_idx.clamp(min=0), live.long())
    starts = torch.cumsum(counts, 0) - counts + (T - counts.sum())
    nblocks = (counts + BLOCK_T - 1) // BLOCK_T
    bstart = torch.cumsum(nblocks, 0) - nblocks
    return LoRASegments(order, starts, counts, bstart, nblocks, min(T, triton.cdiv(T, BLOCK_T) + num_slots - 1))


@triton.jit
def _block(Order, Starts, Counts, Bstart, Nblocks, SLOTS, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's block: (its slot, its token rows [BLOCK_T], which of them are real, whether it has any)."""
    b = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    bs = tl.load(Bstart + s, mask=s < SLOTS, other=0)
    nb = tl.load(Nblocks + s, mask=s < SLOTS, other=0)
    hit = (bs <= b) & (b < bs + nb)
    has = tl.sum(hit.to(tl.int32), axis=0) > 0
    slot = tl.sum(tl.where(hit, s, 0), axis=0)
    j = b - tl.sum(tl.where(hit, bs, 0), axis=0)
    pos = j * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = pos < tl.where(has, tl.load(Counts + slot), 0)
    rows = tl.load(Order + tl.load(Starts + slot) + pos, mask=valid, other=0)
    return slot.to(tl.int64), rows, valid, has


@triton.jit
def _shrink_kernel(X, A, S, Order, Starts, Counts, Bstart, Nblocks, SLOTS, K, N, K_PER,
                   stride_x, stride_as, stride_an, stride_s,
                   BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    slot, rows, valid, has = _block(Order, Starts, Counts, Bstart, Nblocks, SLOTS, BLOCK_S, BLOCK_T)
    if has:
        n = tl.arange(0, BLOCK_N)
        a_base = A + slot * stride_as
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        k_lo = tl.program_id(1) * K_PER
        for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
            ak = tl.load(a_base + n[None, :] * stride_an + k[:, None], mask=(n[None, :] < N) & (k[:, None] < K),
                         other=0.0)
            acc += tl.dot(xk, ak.to(xk.dtype))
        tl.atomic_add(S + rows[:, None] * stride_s + n[None, :], acc, mask=valid[:, None] & (n[None, :] < N))


@triton.jit
def _expand_kernel(S, B, Y, Order, Starts, Counts, Bstart, Nblocks, SLOTS, N, R, OFF1, OFF2,
                   stride_s, stride_bs, stride_bn, stride_y,
                   BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    slot, rows, valid, has = _block(Order, Starts, Counts, Bstart, Nblocks, SLOTS, BLOCK_S, BLOCK_T)
    if has:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        r = tl.arange(0, BLOCK_R)
        piece = (o >= OFF1).to(tl.int32) + (o >= OFF2).to(tl.int32)  # the output slice each column belongs to
        b = tl.load(B + slot * stride_bs + o[None, :] * stride_bn + r[:, None],
                    mask=(o[None, :] < N) & (r[:, None] < R), other=0.0).to(tl.float32)  # [R, O]
        acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
        for p in range(tl.min(piece, axis=0), tl.max(tl.where(o < N, piece, 0), axis=0) + 1):  # <= 3 slices
            sp = tl.load(S + rows[:, None] * stride_s + p * R + r[None, :], mask=valid[:, None] & (r[None, :] < R),
                         other=0.0)
            acc += tl.dot(sp, tl.where(piece[None, :] == p, b, 0.0), input_precision="ieee")
        m = valid[:, None] & (o[None, :] < N)
        ptr = Y + rows[:, None] * stride_y + o[None, :]
        y = tl.load(ptr, mask=m, other=0.0)
        tl.store(ptr, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=m)


def _seg_args(seg: LoRASegments, slots: int) -> tuple:
    return seg.order, seg.starts, seg.counts, seg.bstart, seg.nblocks, slots


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_idx: torch.Tensor,
                seg: LoRASegments | None = None) -> torch.Tensor:
    """x [T, K], lora_a [slots, N, K], lora_idx [T] -> s [T, N] float32 (base rows zero); `seg`: the step's
    lora_segments (made here when None)."""
    T, K = x.shape
    slots, N = lora_a.shape[0], lora_a.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    s = torch.zeros(T, N, dtype=torch.float32, device=x.device)
    if T:
        seg = seg if seg is not None else lora_segments(lora_idx, slots)
        _shrink_kernel[(seg.max_blocks, triton.cdiv(K, K_PER_PROGRAM))](
            x, lora_a, s, *_seg_args(seg, slots), K, N, K_PER_PROGRAM, x.stride(0), lora_a.stride(0),
            lora_a.stride(1), s.stride(0), BLOCK_S=triton.next_power_of_2(slots), BLOCK_T=BLOCK_T,
            BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_K=SHRINK_K)
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor, lora_idx: torch.Tensor,
                slice_sizes: list[int], seg: LoRASegments | None = None) -> None:
    """y [T, N] += s (its slice's R columns) . lora_b [slots, N, R] per token slot, in place (up to 3 slices)."""
    T, N = y.shape
    slots, R = lora_b.shape[0], lora_b.shape[2]
    if len(slice_sizes) > 3 or sum(slice_sizes) != N:
        raise ValueError(f"lora_expand: slice sizes {slice_sizes} must be at most 3 and sum to {N}")
    ends = [sum(slice_sizes[:i + 1]) for i in range(len(slice_sizes))] + [N, N]
    if T:
        seg = seg if seg is not None else lora_segments(lora_idx, slots)
        _expand_kernel[(seg.max_blocks, triton.cdiv(N, EXPAND_O))](
            s, lora_b, y, *_seg_args(seg, slots), N, R, ends[0], ends[1], s.stride(0), lora_b.stride(0),
            lora_b.stride(1), y.stride(0), BLOCK_S=triton.next_power_of_2(slots), BLOCK_T=BLOCK_T,
            BLOCK_O=EXPAND_O, BLOCK_R=max(16, triton.next_power_of_2(R)))
