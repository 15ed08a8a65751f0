"""The fused tensor-parallel all-reduce + residual add + RMSNorm kernel (kernels/all_reduce_norm.py) under the
Triton interpreter, with real ranks: one process per rank, every rank's buffer and flags in shared memory and
each rank's pointer arrays holding their addresses in its own address space, as symmetric memory gives them on
GPUs. A chain of calls alternates the two regions as FusedAllReduceNorm does (each call's residual is the last
one's output, as in a forward); every rank must end with the same bits, the exact-rounding reference's values,
and every flag back at 0."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

EPS = 1e-6
CALLS = 4


def _reference(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, call: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One call in the kernel's arithmetic: sum of the ranks' partials in rank order, the residual added, the norm."""
    total = torch.zeros_like(xs[0])
    for x in xs:
        total = total + x * (call + 1)
    h = total + residual
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)), h


def _rank(rank: int, bufs, flags, xs, residual, weight, max_rows: int, queue) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported: its jit reads it
    from testbed.kernels.all_reduce_norm import all_reduce_add_rms_norm_triton
    world, hidden = len(bufs), xs[0].shape[1]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    res = residual
    outs = []
    for call in range(CALLS):
        region = call % 2
        out, res = all_reduce_add_rms_norm_triton(xs[rank] * (call + 1), res, weight, EPS, buf_ptrs, flag_ptrs, rank,
                                                  region * world * max_rows * hidden, region * world * max_rows,
                                                  max_rows)
        outs.append((out.numpy().copy(), res.numpy().copy()))
    queue.put((rank, outs))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,rows,max_rows,hidden", [(2, 3, 4, 24), (3, 4, 4, 40)])
def test_every_rank_ends_with_the_sum_normalised_and_the_flags_cleared(world, rows, max_rows, hidden):
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(rows, hidden, generator=g) for _ in range(world)]
    residual, weight = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
    bufs = [torch.full((2 * world * max_rows * hidden,), float("nan")).share_memory_() for _ in range(world)]
    flags = [torch.zeros(2 * world * max_rows, dtype=torch.int32).share_memory_() for _ in range(world)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, bufs, flags, xs, residual, weight, max_rows, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=150) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    res = residual
    for call in range(CALLS):
        want_out, res = _reference(xs, res, weight, call)
        for r in range(world):
            out, h = (torch.from_numpy(a) for a in got[r][call])
            assert torch.equal(out, torch.from_numpy(got[0][call][0])), f"rank {r} differs from rank 0, call {call}"
            torch.testing.assert_close(h, res, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        res = torch.from_numpy(got[0][call][1])
    assert all(int(f.abs().sum()) == 0 for f in flags), "a flag was left set"
