"""The tensor-parallel all-reduce of the row-parallel layers and the vocabulary-parallel embedding.

On GPUs it runs over symmetric memory (torch's symm_mem, peer-to-peer over NVLink/PCIe): each rank copies its
partial sum into a buffer every peer can read, the ranks meet at a barrier on device signal pads, and each
reads every peer's copy and sums them, in one kernel (one-shot; two-shot, a reduce-scatter and an all-gather,
for large messages; vLLM's custom all-reduce works the same way). Its only host state is which buffer region
the next message takes, fixed by the message's place in the forward, so it is captured inside CUDA graphs and
replayed with them. NCCL stays outside the graphs (the step's broadcast, the LM head's gather, steps larger
than the buffer). NVLink multicast is never used. Elsewhere (CPU/gloo, no symmetric memory, a message larger
than the buffer, another dtype, TESTBED_TP_ALL_REDUCE=nccl) it is torch.distributed's.

The all-reduce of a row-parallel layer's output is followed by the residual add and the next RMSNorm. Under
tensor parallelism the row-parallel layers leave their partial sums to that norm (RMSNorm(partial=True)), which
reduces them: on GPUs with symmetric memory all three run in one kernel (FusedAllReduceNorm,
kernels/all_reduce_norm.py) for steps of up to FUSED_MAX_ROWS tokens, elsewhere `all_reduce` runs first.
TESTBED_TP_FUSED_NORM=0 keeps them apart (the benchmark's A/B). For steps of up to GEMM_PUSH_MAX_ROWS tokens the
row-parallel GEMM itself pushes its tiles to the peers as it computes them (FusedAllReduceNorm.gemm,
kernels/gemm_push.py), so the fused call only waits, sums and normalises (TESTBED_TP_GEMM_PUSH=0: cuBLAS, then
the fused call pushes). While the fused kernel waits on its peers, a
side stream pulls the start of the next GEMM's weight into L2 (kernels/l2_prefetch.py; TESTBED_TP_PREFETCH):
on 2 H100s the Llama-3.1-8B decode step at batch 64 took 0.98x its time without (benchmarks/tp.py, 2ga / 2gan).

Invariant: every rank calls `all_reduce` and the fused kernel with the same shapes, dtypes and order
(the model is the same on each), so every rank takes the same path for each message and the barriers pair up.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from testbed.worker.pipeline import get_parallel_state

logger = logging.getLogger(__name__)
T = TypeVar("T")

BACKEND_ENV = "TESTBED_TP_ALL_REDUCE"  # auto (symmetric memory where available) | nccl
FUSED_ENV = "TESTBED_TP_FUSED_NORM"  # 1 (default): the all-reduce fused with the residual add + norm; 0: apart
PREFETCH_ENV = "TESTBED_TP_PREFETCH"  # bulk | load | off: the next GEMM's weight into L2 during the fused call
PREFETCH_MB_ENV = "TESTBED_TP_PREFETCH_MB"  # how much of it, MiB
PREFETCH_JOIN_ENV = "TESTBED_TP_PREFETCH_JOIN"  # forward (default): the stream waits for it at the forward's end; call
# 1 (default): row-parallel GEMMs push their own tiles; 0: cuBLAS, then the fused call pushes the rows
GEMM_PUSH_ENV = "TESTBED_TP_GEMM_PUSH"
GEMM_PUSH_MAX_ROWS = 64  # steps of more tokens take cuBLAS, then the fused call's push (benchmarks/tp_gemm_push.py)
FUSED_MAX_ROWS = 256  # steps of more tokens reduce, then normalise (fused 20.9 against 23.8 us at 256 on 2 H200s)


ONE_SHOT_MAX_BYTES = 512 << 10  # larger messages take the two-shot all-reduce: the crossover on 2x H200 (benchmarks/tp.py)


class SymmetricAllReduce:
    """All-reduce of up to `max_numel` elements of `dtype` through symmetric buffers: one-shot for messages of
    up to ONE_SHOT_MAX_BYTES (copy in, barrier, every rank sums all copies), two-shot above (reduce-scatter,
    all-gather; half the reads per rank).

    A one-shot kernel writes its rank's buffer before its barrier, so the buffer of one all-reduce must not be
    written by the next while a slower peer still reads it: the messages take turns between two regions, and
    the first all-reduce of a forward (the embedding's) has a third. Any two all-reduces writing the same
    region then have another all-reduce's barrier between them, which every peer passes only after its
    earlier reads, so a forward needs no synchronisation with the previous one."""

    def __init__(self, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = dist.group.WORLD.group_name
        self.dtype = dtype
        self.max_numel = max_numel
        self.buffer = symm_mem.empty(3 * max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.turn = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def _region(self, first: bool, n: int) -> torch.Tensor:
        region, self.turn = (2, 0) if first else (self.turn, 1 - self.turn)
        return self.buffer[region * self.max_numel: region * self.max_numel + n]

    def one_shot(self, x: torch.Tensor, first: bool = False) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self._region(first, x.numel()), x.view(-1), "sum",
                                                        self.group_name, out.view(-1))
        return out

    def two_shot(self, x: torch.Tensor, first: bool = False) -> torch.Tensor:
        buf = self._region(first, x.numel())
        buf.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
        out = torch.empty_like(x)
        out.view(-1).copy_(buf)
        return out

    def __call__(self, x: torch.Tensor, first: bool = False) -> torch.Tensor:
        if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
            return self.one_shot(x, first)
        return self.two_shot(x, first)


class FusedAllReduceNorm:
    """The all-reduce of a row-parallel layer's partial sums fused with the residual add and RMSNorm after it,
    for up to `max_rows` rows of `hidden` elements: each rank pushes its rows into slot `rank` of every rank's
    buffer and flags them; each rank sums its own buffer's slots (kernels/all_reduce_norm.py).

    The calls take turns between two regions of the buffer and of the flags. A rank writes a region again two
    calls later, after the call between has finished on it, and that call waited for every peer's push of it,
    which every peer made only after finishing its own reads of the region (one stream: kernels run in order).
    The flags a call sets are taken back to 0 by their reader within the same call, so they are 0 again before
    anyone sets them two calls later; the counters a GEMM's push adds to (`gemm`) are set back to 0 by this rank's
    next call, whichever way it runs (kernels/gemm_push.py's invariant). `begin_forward` starts every forward on
    region 0: a forward makes an even number of calls (2 x its layers: each layer's post-attention norm and the
    norm after its MLP, the next layer's input norm or the final norm), so the turns alternate across forwards,
    replayed graphs included."""

    def __init__(self, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from testbed.kernels.all_reduce_norm import PeerBuffers, counter_blocks
        group = dist.group.WORLD.group_name
        self.world = dist.get_world_size()
        self.max_rows, self.hidden, self.dtype = max_rows, hidden, dtype
        self.buffer = symm_mem.empty(2 * self.world * max_rows * hidden, dtype=dtype, device=device)
        self.flags = symm_mem.empty(2 * self.world * max_rows, dtype=torch.int32, device=device)
        self.counters = symm_mem.empty(2 * self.world * counter_blocks(max_rows), dtype=torch.int32, device=device)
        self.flags.zero_()
        self.counters.zero_()
        handles = [symm_mem.rendezvous(t, group) for t in (self.buffer, self.flags, self.counters)]
        self.rank = handles[0].rank
        self.peers = PeerBuffers(*(torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=device) for h in handles),
                                 rank=self.rank, max_rows=max_rows, hidden=hidden)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags and counters are 0 before any rank pushes
        self.turn = 0
        self.pushed: tuple[int, int, int] | None = None  # (data_ptr, tiles, block_rows) of the last gemm's push
        self.gemm_push = os.environ.get(GEMM_PUSH_ENV, "1") != "0" and dtype in (torch.bfloat16, torch.float16)
        from testbed.kernels.decode_attention import supports_pdl
        self.pdl = supports_pdl(device)  # the norm after a GEMM's push launches while the GEMM runs
        self.prefetch_way, self.prefetch_bytes = prefetch_setting(torch.cuda.get_device_capability(device),
                                                                  hip=torch.version.hip is not None)
        self.side = torch.cuda.Stream(device) if self.prefetch_way != "off" else None
        self.scratch = torch.zeros(1024, dtype=torch.float32, device=device)
        join = os.environ.get(PREFETCH_JOIN_ENV, "forward")
        if join not in ("forward", "call"):
            raise ValueError(f"{PREFETCH_JOIN_ENV}={join!r}: expected 'forward' or 'call'")
        self.join_each_call = join == "call"
        self.pending: torch.cuda.Stream | None = None  # the stream that has yet to wait for the side stream

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden

    def gemm_fits(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `gemm` can compute x W^T for this call (16-bit, few enough rows, `hidden` outputs)."""
        return (self.gemm_push and x.dtype == self.dtype and weight.dtype == self.dtype and x.dim() == 2
                and x.shape[0] <= GEMM_PUSH_MAX_ROWS and x.shape[0] <= self.max_rows and weight.shape[0] == self.hidden)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x W^T, this rank's partial sum of a row-parallel layer, computed by a kernel that pushes it into the
        next call's region of every rank's buffer (kernels/gemm_push.py). Returns it as this rank's slot there;
        the call that receives this very tensor next only waits for the peers' pushes, then sums and normalises."""
        from testbed.kernels.gemm_push import gemm_push_triton
        tiles, block_rows = gemm_push_triton(x, weight, self.peers, self.turn, pdl=self.pdl)
        y = self.peers.slot(self.buffer, self.turn, x.shape[0])
        self.pushed = (y.data_ptr(), tiles, block_rows)
        return y

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefetch`: the weight of the GEMM that reads this call's output; its first bytes are pulled into L2
        on a side stream while this call waits on the peers (kernels/l2_prefetch.py). The GEMM does not wait for
        the prefetch: the caller's stream waits for the side stream once, at the forward's end (`join`), so a
        captured graph's branches meet before the capture ends (TESTBED_TP_PREFETCH_JOIN=call: after each call).
        The prefetch writes nothing the model reads: results are the same with or without it."""
        from testbed.kernels.all_reduce_norm import all_reduce_add_rms_norm_triton, reduce_add_rms_norm_triton
        region, self.turn = self.turn, 1 - self.turn
        pushed, self.pushed = self.pushed, None
        side = self.side if prefetch is not None else None
        if side is not None:
            from testbed.kernels.l2_prefetch import l2_prefetch
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch(prefetch, self.prefetch_bytes, self.prefetch_way, self.scratch)
        if pushed is not None and pushed[0] == x.data_ptr():
            out = reduce_add_rms_norm_triton(residual, weight, eps, self.peers, region, pushed[1], pushed[2],
                                             self.pdl)
        else:
            out = all_reduce_add_rms_norm_triton(x, residual, weight, eps, self.peers, region)
        if side is not None:
            self.pending = main
            if self.join_each_call:
                self.join()
        return out

    def join(self) -> None:
        """The stream of the last prefetching call waits for the side stream's prefetches."""
        if self.pending is not None:
            self.pending.wait_stream(self.side)
            self.pending = None


def prefetch_setting(capability: tuple[int, int], hip: bool = False) -> tuple[str, int]:
    """(way, bytes) of the L2 prefetch beside the fused call on a GPU of this compute capability (`hip`: an AMD
    GPU under ROCm, whose numbers are not NVIDIA's), from TESTBED_TP_PREFETCH (default bulk) and
    TESTBED_TP_PREFETCH_MB (default 24). "bulk" is a PTX instruction of NVIDIA Hopper (9.0) and later, so other
    GPUs take none: the "load" way cost 3-9% a decode step on 2 H100s (benchmarks/tp.py, case 2gal), so it runs
    only when asked for. "off": none."""
    way = os.environ.get(PREFETCH_ENV, "bulk")
    if way not in ("bulk", "load", "off"):
        raise ValueError(f"{PREFETCH_ENV}={way!r}: expected 'bulk', 'load' or 'off'")
    if way == "bulk" and (hip or capability < (9, 0)):
        way = "off"
    text = os.environ.get(PREFETCH_MB_ENV, "24")
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ValueError(f"{PREFETCH_MB_ENV}={text!r}: expected a positive number of MiB")
    return way, int(mb * 2**20)


_symmetric: SymmetricAllReduce | None = None
_fused: FusedAllReduceNorm | None = None


def init_tp_all_reduce(max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Set up the symmetric-memory all-reduce for messages of up to max_tokens x hidden_size on every rank
    (a collective: all ranks call it). Returns whether every rank has it; when one rank cannot, none uses it."""
    global _symmetric, _fused
    _symmetric = _fused = None
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    state = get_parallel_state()
    if state is not None and state.pp_size > 1:  # every rank knows: none takes part in the collective below
        if state.tp_size > 1:
            logger.info("pipeline parallelism: each stage's tensor-parallel all-reduces use NCCL (its steps run eager)")
        return False
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "nccl"):
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected 'auto' or 'nccl'")

    def build() -> SymmetricAllReduce | None:
        return SymmetricAllReduce(max_tokens * hidden_size, dtype, device) if choice == "auto" else None

    _symmetric = _on_every_rank(build, "tensor-parallel all-reduce: symmetric memory unavailable", "; using NCCL",
                                device)
    if _symmetric is not None and os.environ.get(FUSED_ENV, "1") != "0":
        rows = min(max_tokens, FUSED_MAX_ROWS)
        _fused = _on_every_rank(lambda: FusedAllReduceNorm(rows, hidden_size, dtype, device),
                                "tensor-parallel all-reduce + norm: not fused", "", device)
    return _symmetric is not None


def _on_every_rank(build: Callable[[], T | None], what: str, then: str, device: torch.device) -> T | None:
    """What `build()` makes on this rank where every rank made one, else None on every rank (a collective: the
    ranks agree, so every rank takes the same path). A rank whose build raised (an old torch, no peer access
    between these GPUs, no symmetric memory backend) logs `what` on rank R (the error)`then`."""
    mine = None
    try:
        mine = build()
    except Exception as e:
        logger.warning("%s on rank %d (%s: %s)%s", what, dist.get_rank(), type(e).__name__, e, then)
    ok = torch.tensor([int(mine is not None)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return mine if bool(ok.item()) else None


def symmetric_available() -> bool:
    """Whether the graph-safe all-reduce is set up (else a captured graph would hold NCCL collectives)."""
    return _symmetric is not None


def all_reduce(x: torch.Tensor, first: bool = False) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel ranks (a new tensor, or `x` summed in place); `first`: the first
    all-reduce of a forward (see SymmetricAllReduce)."""
    if _symmetric is not None and _symmetric.fits(x):
        return _symmetric(x, first)
    state = get_parallel_state()
    dist.all_reduce(x, group=state.tp_group if state is not None else None)
    return x


def begin_forward() -> None:
    """Called once at the start of every forward: the fused calls start on their first region (see
    FusedAllReduceNorm)."""
    if _fused is not None:
        _fused.join()  # a forward that raised part-way left its prefetches unjoined
        _fused.turn, _fused.pushed = 0, None


def end_forward() -> None:
    """Called once at the end of every forward (before its output is read): the forward's stream waits for the
    L2 prefetches its fused calls started (FusedAllReduceNorm.join), so a captured graph ends joined."""
    if _fused is not None:
        _fused.join()


def fused_for(x: torch.Tensor) -> FusedAllReduceNorm | None:
    """The fused all-reduce + residual add + norm for a row-parallel layer's partial sums x, where it is set up
    and x fits it (else the caller all-reduces, then normalises)."""
    return _fused if _fused is not None and _fused.fits(x) else None


def gemm_push_for(x: torch.Tensor, weight: torch.Tensor) -> FusedAllReduceNorm | None:
    """The fused call whose `gemm` computes a row-parallel layer's partial sums x W^T and pushes them itself,
    where it is set up and this step fits it (else the caller runs the GEMM, and the fused call pushes)."""
    return _fused if _fused is not None and _fused.gemm_fits(x, weight) else None


def close_tp_all_reduce() -> None:
    """Drop the symmetric buffers (before the process group is destroyed)."""
    global _symmetric, _fused
    _symmetric = _fused = None
