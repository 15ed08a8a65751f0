"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it, in one Triton kernel.

A row-parallel layer (attention's o_proj, the MLP's down_proj) leaves each rank a partial sum; the next norm
adds the residual stream to the full sum. One program per token row:
  1. push: store this rank's partial row into slot `rank` of every rank's buffer (peer memory, NVLink/PCIe),
     then, after a CTA barrier, set the row's flag (rank, row) in every rank's flag array (release, system scope);
  2. wait: spin on this rank's flags (p, row) for every p until each is 1, taking it back to 0 (acquire);
  3. reduce: sum the W slots of the row in rank order in fp32 (every rank adds the same values in the same order,
     so every rank holds bitwise the same result), round to the model's dtype as an all-reduce returns it, add
     the residual, and normalise: (weight * rmsnorm(sum + residual), sum + residual), rounding where
     layers.add_rms_norm rounds.
Pushing (stores to a peer) rather than pulling (loads from it) puts one NVLink crossing, not a round trip, on
the path, and a program pairs only with the same row on the peers: no grid-wide barrier.

Invariant (the caller's, worker/tp_all_reduce.py): consecutive calls alternate between two regions of the buffer
and flags, and every rank makes the same calls in the same order, so a region is written again only after every
peer has finished reading it (see FusedAllReduceNorm). The pointer arrays hold each rank's buffer and flag base
address (symmetric memory); nothing else of the host enters the kernel, so it is captured in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _all_reduce_add_rms_norm_kernel(X, Res, W, Out, Hout, buf_ptrs, flag_ptrs, rank, buf_off, flag_off, max_rows,
                                    n_cols, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = X.dtype.element_ty
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0)
    slot = (rank * max_rows + row) * n_cols
    for p in tl.static_range(WORLD):
        dst = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
        tl.store(dst + buf_off + slot + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's stores of the row precede the flags' release
    for p in tl.static_range(WORLD):
        flag = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flag + flag_off + rank * max_rows + row, 1, sem="release", scope="sys")
    mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32)) + flag_off + row
    for p in tl.static_range(WORLD):
        while tl.atomic_cas(mine + p * max_rows, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()  # no thread reads the slots before every flag was taken
    buf = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)) + buf_off
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        acc += tl.load(buf + (p * max_rows + row) * n_cols + cols, mask=mask, other=0.0,
                       cache_modifier=".cg").to(tl.float32)
    res = tl.load(Res + row * n_cols + cols, mask=mask, other=0.0)
    h = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / n_cols
    normed = (hf * tl.rsqrt(var + eps)).to(dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Out + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)
    tl.store(Hout + row * n_cols + cols, h, mask=mask)


def all_reduce_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   buf_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, rank: int, buf_off: int,
                                   flag_off: int, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(sum_ranks(x) + residual), sum_ranks(x) + residual) for x, residual [T, hidden] (T <=
    max_rows), through the buffers and flags whose per-rank base addresses are buf_ptrs, flag_ptrs (int64 [W]);
    buf_off, flag_off: the region's first element in each (a region: W x max_rows rows, W x max_rows flags)."""
    rows, n = x.shape
    if residual.shape != x.shape or weight.shape != (n,) or rows > max_rows:
        raise ValueError(f"all_reduce_add_rms_norm: x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
                         f"{tuple(weight.shape)}, at most {max_rows} rows")
    x, residual = x.contiguous(), residual.contiguous()
    out, h = torch.empty_like(x), torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _all_reduce_add_rms_norm_kernel[(rows,)](
            x, residual, weight, out, h, buf_ptrs, flag_ptrs, rank, buf_off, flag_off, max_rows, n, eps,
            WORLD=buf_ptrs.numel(), BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return out, h
