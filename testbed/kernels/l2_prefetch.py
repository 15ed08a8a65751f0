"""Pull the first bytes of a weight into the GPU's L2 cache while the device waits on its peers.

A decode step under tensor parallelism spends each all-reduce (7-11 us, 64 a step on Llama-3.1-8B) waiting on
NVLink while HBM idles, and then runs a GEMM that streams its weight from HBM. Reading the start of that weight
during the wait lets the GEMM find it in L2 (50 MB on an H100), so the all-reduce overlaps part of the GEMM's
memory traffic (worker/tp_all_reduce.py launches it on a side stream beside the fused all-reduce + norm).

Two ways, chosen by the caller:
- "bulk": one `cp.async.bulk.prefetch.L2` per 16 KiB chunk (Hopper and later): a few warps issue it all,
  nothing is loaded into registers, and the kernel holds almost no SMs the all-reduce might need.
- "load": every chunk loaded by its own program and dropped (any CUDA GPU); more SMs, more bandwidth.
Neither writes anything the model reads: `load` stores to a scratch word only under a condition that a
real weight's sum never meets exactly, and the store keeps the loads from being removed."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BULK_CHUNK = 16384  # bytes per bulk prefetch (a multiple of 16, as the instruction requires)
LOAD_BLOCK = 8192  # elements per program of the "load" way


@triton.jit
def _bulk_prefetch_kernel(W, n_chunks, CHUNK_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_chunks - 1).to(tl.int64)
    addr = (W + idx * CHUNK_ELEMS).to(tl.int64)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_prefetch_kernel(W, Scratch, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(W + idx, mask=idx < n, other=0.0, eviction_policy="evict_last")
    s = tl.sum(v.to(tl.float32), axis=0)
    tl.store(Scratch + pid % 1024, s, mask=s == -1.2345e38)


def l2_prefetch(weight: torch.Tensor, nbytes: int, way: str, scratch: torch.Tensor) -> None:
    """Start pulling the first min(nbytes, weight's bytes) of contiguous `weight` into L2 (`way`: "bulk" or
    "load", see the module's docstring); `scratch`: 1,024 float32 the "load" way may write."""
    if way not in ("bulk", "load"):
        raise ValueError(f"l2_prefetch: way {way!r}, expected 'bulk' or 'load'")
    if not weight.is_contiguous():
        raise ValueError("l2_prefetch: the weight must be contiguous")
    n = min(weight.numel(), nbytes // weight.element_size())
    if n <= 0:
        return
    if way == "bulk":
        elems = BULK_CHUNK // weight.element_size()
        n_chunks = n // elems  # whole chunks only: none reaches past the weight's end
        if n_chunks == 0:
            return
        _bulk_prefetch_kernel[(triton.cdiv(n_chunks, 128),)](weight, n_chunks, CHUNK_ELEMS=elems, BLOCK=128,
                                                              num_warps=4)
    else:
        _load_prefetch_kernel[(triton.cdiv(n, LOAD_BLOCK),)](weight, scratch, n, BLOCK=LOAD_BLOCK, num_warps=8)
