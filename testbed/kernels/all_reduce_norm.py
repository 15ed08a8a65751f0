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
Where the row-parallel GEMM pushed its tiles itself (kernels/gemm_push.py), step 1 is already done and the
reduce-only kernel waits on per-block counters instead of per-row flags, then runs step 3 (the same code).

Invariant (the caller's, worker/tp_all_reduce.py): consecutive calls alternate between two regions of the buffer
and flags, and every rank makes the same calls in the same order, so a region is written again only after every
peer has finished reading it (see FusedAllReduceNorm). The pointer arrays hold each rank's buffer, flag and
counter base address (symmetric memory, PeerBuffers); nothing else of the host enters the kernels, so they are
captured in CUDA graphs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_add_rms_norm(buf, row, cols, mask, n_cols, max_rows, Res, W, Out, Hout, eps, WORLD: tl.constexpr):
    """Row `row` of every rank's slot in `buf` summed in rank order in fp32 and rounded to the model's dtype, the
    residual added, then (weight * rmsnorm(h), h) stored, rounding where layers.add_rms_norm rounds."""
    dtype = Res.dtype.element_ty
    acc = tl.zeros(cols.shape, dtype=tl.float32)
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


@triton.jit
def _zero_counters(cnt_ptrs, rank, zero_off, n_zero, ZERO: tl.constexpr):
    """This rank's counters of the other region back to 0 (kernels/gemm_push.py's invariant)."""
    z = tl.arange(0, ZERO)
    tl.store(tl.load(cnt_ptrs + rank).to(tl.pointer_type(tl.int32)) + zero_off + z, 0, mask=z < n_zero)


@triton.jit
def _all_reduce_add_rms_norm_kernel(X, Res, W, Out, Hout, buf_ptrs, flag_ptrs, cnt_ptrs, rank, buf_off, flag_off,
                                    zero_off, n_zero, max_rows, n_cols, eps, WORLD: tl.constexpr,
                                    BLOCK: tl.constexpr, ZERO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = X.dtype.element_ty
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0)
    if row == 0:
        _zero_counters(cnt_ptrs, rank, zero_off, n_zero, ZERO)
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
    _sum_add_rms_norm(buf, row, cols, mask, n_cols, max_rows, Res, W, Out, Hout, eps, WORLD)


@triton.jit
def _reduce_add_rms_norm_kernel(Res, W, Out, Hout, buf_ptrs, cnt_ptrs, rank, buf_off, cnt_off, n_blocks, n_tiles,
                                block_rows, max_rows, n_cols, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                                PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    mine = tl.load(cnt_ptrs + rank).to(tl.pointer_type(tl.int32)) + cnt_off + row // block_rows
    for p in tl.static_range(WORLD):
        while tl.atomic_add(mine + p * n_blocks, 0, sem="acquire", scope="sys") < n_tiles:
            pass
    tl.debug_barrier()  # no thread reads the slots before every peer's tiles of the row arrived
    if PDL:  # launched while the GEMM ran: its outputs' memory may be what the GEMM still reads until it ends
        tl.extra.cuda.gdc_wait()
    buf = tl.load(buf_ptrs + rank).to(tl.pointer_type(Res.dtype.element_ty)) + buf_off
    _sum_add_rms_norm(buf, row, cols, mask, n_cols, max_rows, Res, W, Out, Hout, eps, WORLD)


class PeerBuffers(NamedTuple):
    """Where the fused calls' rows and signals live, as every rank's base addresses (int64 [W] each, symmetric
    memory on GPUs): per rank a buffer of 2 regions x W slots x max_rows x hidden elements, 2 x W x max_rows
    flags (all_reduce_add_rms_norm: one per pushed row) and 2 x W x n_blocks counters (the row-parallel GEMM's
    push, kernels/gemm_push.py: one per block of rows, counting the column tiles that arrived)."""
    buf_ptrs: torch.Tensor
    flag_ptrs: torch.Tensor
    cnt_ptrs: torch.Tensor
    rank: int
    max_rows: int
    hidden: int

    @property
    def world(self) -> int:
        return self.buf_ptrs.numel()

    @property
    def n_blocks(self) -> int:
        return counter_blocks(self.max_rows)

    def buf_off(self, region: int) -> int:
        return region * self.world * self.max_rows * self.hidden

    def slot(self, buffer: torch.Tensor, region: int, rows: int) -> torch.Tensor:
        """This rank's slot of `region` in its own `buffer` (the tensor buf_ptrs[rank] points to): rows x hidden."""
        start = self.buf_off(region) + self.rank * self.max_rows * self.hidden
        return buffer[start: start + rows * self.hidden].view(rows, self.hidden)


MIN_BLOCK_ROWS = 16  # the smallest block of rows a row-parallel GEMM tile covers (tl.dot's least M)


def counter_blocks(max_rows: int) -> int:
    """Counters a rank keeps per peer and region: one per smallest block of rows."""
    return -(-max_rows // MIN_BLOCK_ROWS)


def all_reduce_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   peers: PeerBuffers, region: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(sum_ranks(x) + residual), sum_ranks(x) + residual) for x, residual [T, hidden] (T <=
    max_rows), through `region` (0 or 1) of the peers' buffers and flags; it also sets this rank's counters of
    the other region to 0 (kernels/gemm_push.py's invariant)."""
    rows, n = x.shape
    _check(residual, weight, rows, n, peers)
    if x.shape != residual.shape:
        raise ValueError(f"all_reduce_add_rms_norm: x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    x, residual = x.contiguous(), residual.contiguous()
    out, h = torch.empty_like(x), torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        w, nb = peers.world, peers.n_blocks
        _all_reduce_add_rms_norm_kernel[(rows,)](
            x, residual, weight, out, h, peers.buf_ptrs, peers.flag_ptrs, peers.cnt_ptrs, peers.rank,
            peers.buf_off(region), region * w * peers.max_rows, (1 - region) * w * nb, w * nb, peers.max_rows, n, eps,
            WORLD=w, BLOCK=block, ZERO=triton.next_power_of_2(w * nb), num_warps=max(1, min(16, block // 256)))
    return out, h


def reduce_add_rms_norm_triton(residual: torch.Tensor, weight: torch.Tensor, eps: float, peers: PeerBuffers,
                               region: int, n_tiles: int, block_rows: int, pdl: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """all_reduce_add_rms_norm_triton's result for partial sums that every rank's row-parallel GEMM already
    pushed into `region` (kernels/gemm_push.py: `n_tiles` column tiles a block of `block_rows` rows): waits for
    each peer's tiles of a row, then sums and normalises it. `pdl`: a programmatic dependent launch, which starts
    while a GEMM launched with pdl still runs."""
    rows, n = residual.shape
    _check(residual, weight, rows, n, peers)
    residual = residual.contiguous()
    out, h = torch.empty_like(residual), torch.empty_like(residual)
    if rows:
        block = triton.next_power_of_2(n)
        w, nb = peers.world, peers.n_blocks
        _reduce_add_rms_norm_kernel[(rows,)](
            residual, weight, out, h, peers.buf_ptrs, peers.cnt_ptrs, peers.rank, peers.buf_off(region),
            region * w * nb, nb, n_tiles, block_rows, peers.max_rows, n, eps, WORLD=w, BLOCK=block, PDL=pdl,
            num_warps=max(1, min(16, block // 256)), **({"launch_pdl": True} if pdl else {}))
    return out, h


def _check(residual: torch.Tensor, weight: torch.Tensor, rows: int, n: int, peers: PeerBuffers) -> None:
    if weight.shape != (n,) or rows > peers.max_rows or n != peers.hidden:
        raise ValueError(f"all_reduce_add_rms_norm: residual {tuple(residual.shape)}, weight {tuple(weight.shape)}, "
                         f"at most {peers.max_rows} rows of {peers.hidden}")
