"""The fused tensor-parallel all-reduce + residual add + RMSNorm (kernels/all_reduce_norm.py) and the row-parallel
GEMM that pushes its own tiles before the reduce-only norm (kernels/gemm_push.py), under the Triton interpreter,
with real ranks: one process per rank, every rank's buffer, flags and counters in shared memory and each rank's
pointer arrays holding their addresses in its own address space, as symmetric memory gives them on GPUs. Chains
of calls alternate the two regions as FusedAllReduceNorm does (each call's residual is the last one's output, as
in a forward; each forward starts on region 0 and makes an even number of calls), mixing the two ways call by
call; every rank must end with the same bits, the reference's values, every flag back at 0 and the counters of
region 0 at 0 (the invariant a forward starts from)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

EPS = 1e-6
FORWARDS = (("push", "fused", "fused", "push"), ("push", "push"), ("fused", "fused"), ("push", "push"))
CALLS = [(f, c, kind) for f, fwd in enumerate(FORWARDS) for c, kind in enumerate(fwd)]


def _partial(a: torch.Tensor, w: torch.Tensor, call: int) -> torch.Tensor:
    return (a * (call + 1)) @ w.T


def _rank(rank: int, bufs, flags, counters, acts, weights, residual, norm_w, max_rows: int, block_n: int,
          queue) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported: their jit reads it
    from testbed.kernels.all_reduce_norm import (PeerBuffers, all_reduce_add_rms_norm_triton,
                                                 reduce_add_rms_norm_triton)
    from testbed.kernels.gemm_push import gemm_push_triton
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64) for ts in (bufs, flags, counters)]
    peers = PeerBuffers(*ptrs, rank=rank, max_rows=max_rows, hidden=weights[0].shape[0])
    res = residual
    outs = []
    for i, (_, c, kind) in enumerate(CALLS):
        region = c % 2
        if kind == "push":
            tiles, block_rows = gemm_push_triton(acts[rank] * (i + 1), weights[rank], peers, region, block_n=block_n)
            out, res = reduce_add_rms_norm_triton(res, norm_w, EPS, peers, region, tiles, block_rows)
        else:
            out, res = all_reduce_add_rms_norm_triton(_partial(acts[rank], weights[rank], i), res, norm_w, EPS, peers,
                                                      region)
        outs.append((out.numpy().copy(), res.numpy().copy()))
    queue.put((rank, outs))


def _reference(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One call in the kernels' arithmetic: the ranks' partials summed in rank order, the residual added, the norm."""
    total = torch.zeros_like(partials[0])
    for x in partials:
        total = total + x
    h = total + residual
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)), h


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,rows,max_rows,hidden,k", [(2, 3, 4, 40, 20), (3, 20, 32, 24, 16)])
def test_every_rank_ends_with_the_sum_normalised_and_the_signals_cleared(world, rows, max_rows, hidden, k):
    g = torch.Generator().manual_seed(world)
    acts = [torch.randn(rows, k, generator=g) for _ in range(world)]
    weights = [torch.randn(hidden, k, generator=g) / k ** 0.5 for _ in range(world)]
    residual, norm_w = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
    blocks = -(-max_rows // 16)
    bufs = [torch.full((2 * world * max_rows * hidden,), float("nan")).share_memory_() for _ in range(world)]
    flags = [torch.zeros(2 * world * max_rows, dtype=torch.int32).share_memory_() for _ in range(world)]
    counters = [torch.zeros(2 * world * blocks, dtype=torch.int32).share_memory_() for _ in range(world)]
    block_n = 16  # several column tiles a block of rows
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, bufs, flags, counters, acts, weights, residual, norm_w, max_rows,
                                             block_n, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=280) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    res = residual
    for i, (f, c, kind) in enumerate(CALLS):
        want_out, want_h = _reference([_partial(acts[r], weights[r], i) for r in range(world)], res, norm_w)
        for r in range(world):
            out, h = (torch.from_numpy(a) for a in got[r][i])
            where = f"rank {r}, forward {f}, call {c} ({kind})"
            assert torch.equal(out, torch.from_numpy(got[0][i][0])), f"{where} differs from rank 0"
            torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {m}")
        res = torch.from_numpy(got[0][i][1])
    assert all(int(f.abs().sum()) == 0 for f in flags), "a flag was left set"
    assert all(int(c[: world * blocks].abs().sum()) == 0 for c in counters), "region 0's counters were not reset"
    assert any(int(c[world * blocks:].sum()) > 0 for c in counters), "the last call pushed nothing through counters"
