"""A row-parallel layer's GEMM whose epilogue pushes its partial sums to every tensor-parallel rank.

Under tensor parallelism attention's o_proj and the MLP's down_proj leave each rank a partial sum, which the
fused all-reduce + residual add + RMSNorm (kernels/all_reduce_norm.py) first pushes into every rank's buffer.
Here each tile of the GEMM y = x W^T stores its [block_rows x BLOCK_N] piece straight into slot `rank` of every
rank's buffer (peer memory, NVLink) as soon as it is computed, then adds 1 to its block of rows' counter on every
rank (release, system scope): the pushes overlap the tiles still computing, and the norm after it
(reduce_add_rms_norm_triton) only waits until each peer's counter of a row's block reaches the tile count, then
sums and normalises. At decode sizes (up to 64 rows, one block) the grid is one tile per BLOCK_N columns.

Invariant (with all_reduce_norm's two kernels, which FusedAllReduceNorm alternates between two regions): every
call of either kernel sets this rank's counters of the *other* region back to 0 before it signals anything, so
the counters of a region are 0 when a call on it starts. A peer adds to a region's counters only in a call on it;
the next such call comes after the peers passed the call between, which waited for this rank's signals of that
call, and those follow the reset (program order, a CTA barrier, a release at system scope).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from testbed.kernels.all_reduce_norm import MIN_BLOCK_ROWS, PeerBuffers, _zero_counters

BLOCK_N, BLOCK_K, STAGES, WARPS = 32, 256, 4, 4  # Llama-3.1-8B's TP=2 o_proj/down_proj at 1-64 rows on an H100


@triton.jit
def _gemm_push_kernel(A, Wt, buf_ptrs, cnt_ptrs, rank, buf_off, cnt_off, zero_off, n_zero, n_blocks, max_rows, M, N,
                      K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORLD: tl.constexpr,
                      ZERO: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the norm after it may launch now (it spins on the counters); nothing here runs before the last ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        rk = k + tl.arange(0, BK)
        a = tl.load(A + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(Wt + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(a, tl.trans(w))
    dtype = A.dtype.element_ty
    c = acc.to(dtype)
    if (pid_n == 0) & (pid_m == 0):
        _zero_counters(cnt_ptrs, rank, zero_off, n_zero, ZERO)
    slot = (rank * max_rows + rm[:, None]) * N + rn[None, :]
    for p in tl.static_range(WORLD):
        dst = tl.load(buf_ptrs + p).to(tl.pointer_type(dtype))
        tl.store(dst + buf_off + slot, c, mask=(rm[:, None] < M) & (rn[None, :] < N))
    tl.debug_barrier()  # every thread's stores of the tile precede the counters' release
    for p in tl.static_range(WORLD):
        cnt = tl.load(cnt_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_add(cnt + cnt_off + rank * n_blocks + pid_m, 1, sem="release", scope="sys")


def block_rows_for(rows: int) -> int:
    """The rows of one tile: the step's rows rounded up to a power of two, 16 to 64."""
    return min(64, max(MIN_BLOCK_ROWS, triton.next_power_of_2(rows)))


def gemm_push_triton(x: torch.Tensor, weight: torch.Tensor, peers: PeerBuffers, region: int,
                     block_rows: int | None = None, block_n: int = BLOCK_N, pdl: bool = False) -> tuple[int, int]:
    """x [T, K] @ weight[N, K]^T (N = hidden, T <= max_rows) pushed into slot `rank` of `region` of every rank's
    buffer, each block of rows counted on every rank; returns (tiles a block of rows gets, block_rows), what
    reduce_add_rms_norm_triton waits for. Also sets this rank's counters of the other region to 0. `pdl`: launched
    as a programmatic dependent launch that lets the kernel after it launch at once (Hopper and later)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or n != peers.hidden or rows > peers.max_rows or x.dtype != weight.dtype:
        raise ValueError(f"gemm_push: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"at most {peers.max_rows} rows and {peers.hidden} outputs")
    bm = block_rows or block_rows_for(rows)
    if bm < MIN_BLOCK_ROWS or bm & (bm - 1):
        raise ValueError(f"gemm_push: block_rows {bm}: a power of two of at least {MIN_BLOCK_ROWS}")
    tiles = triton.cdiv(n, block_n)
    if rows:
        w, nb = peers.world, peers.n_blocks
        _gemm_push_kernel[(tiles, triton.cdiv(rows, bm))](
            x.contiguous(), weight, peers.buf_ptrs, peers.cnt_ptrs, peers.rank, peers.buf_off(region),
            region * w * nb, (1 - region) * w * nb, w * nb, nb, peers.max_rows, rows, n, k, BM=bm, BN=block_n,
            BK=min(BLOCK_K, max(16, triton.next_power_of_2(k))), WORLD=w, ZERO=triton.next_power_of_2(w * nb),
            PDL=pdl, num_stages=STAGES, num_warps=WARPS, **({"launch_pdl": True} if pdl else {}))
    return tiles, bm
