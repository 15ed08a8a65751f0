"""CUDA graphs for every engine step up to the largest capture size: decode-only, mixed and prefill.

Design: full graphs (vLLM's FULL mode), not piecewise. A piecewise graph replays everything but attention
and runs attention eagerly between the pieces, which leaves one Python attention call and one graph
replay per layer on the host: on a 16-layer 1B model that is ~17 replays + 16 Triton launches per step,
still about 1 ms of host issue for a step whose device work is 2-3 ms. The paged prefill/extend kernel
already serves mixed steps in one launch whose grid depends only on (total tokens, number of sequences)
and reads every other fact from device memory, so the whole step fits one graph once both are fixed per
capture size: a step of T tokens and B sequences runs in the graph of the smallest size Tp >= T, padded
to Tp tokens and Sp = min(Tp, max_num_seqs) + 1 sequences. The host then issues a few buffer copies and
one replay, whatever the model's depth.

Padding (`pad_into`), the invariant every graph relies on:
- tokens T..Tp-1 store nothing (slot -1) and belong to sequence B, which has no cached token (seq_len =
  its Tp - T queries): they attend over one another only, never over a real token or the cache, and no
  real row reads them (a key tile that spans them gives them weight 0). Owning them keeps every value in
  the padded rows finite layer after layer, so a 0 weight never meets a NaN;
- sequences B+1..Sp-1 have no query token (cu_seqlens_q repeats Tp) and no cached token (seq_len 0);
  `num_live` (B + 1, on the device) lets the extend kernel's programs for them exit before any work (without
  it, 256 empty sequences cost a 512-token step of Llama-3.1-8B 18% on an H100).
Their hidden rows are never read: sampling and pooling index real rows only.

With LoRA on, every size is captured twice (vLLM's cudagraph_specialize_lora). Once with the LoRA kernels in
it, reading each token's adapter slot from a static index buffer (`lora_idx`) and the adapters from the layers'
preallocated slot tensors, which loads overwrite in place: a step fills the index with its tokens' slots (-1 for
base rows and the padding, which then add nothing), and the same graph serves any mix of adapters. Once without
them, for the steps in which no row runs an adapter: those pay nothing for LoRA, as in an engine without it.

Decode-only steps of at most the largest decode size replay a graph of the split-K decode kernel instead
(batch buckets, one token per sequence), which is faster than the extend kernel on q_len 1 rows; other
steps up to the largest size replay a mixed graph; larger steps run eagerly, where the device time of so
many tokens exceeds the host's issue time (benchmarks/graphs.py shows where that holds).

A pipeline stage (worker/pipeline.py) captures its own layers the same way, each stage on its own: a stage
after the first reads the previous stage's activations from one more static buffer (`intermediate`, [2, tokens,
hidden]: hidden states and residual stream), into which the step's received message is copied before the
replay; a stage before the last returns its (hidden, residual) for the send. The send and receive stay outside
the graphs. The padding rows of `intermediate` hold whatever an earlier step left there (zeros at first): finite
values, which pass through the stage's layers as finite values, as the padding tokens' embeddings do on the
first stage.

Capture sizes are token counts (vLLM's `cuda_graph_sizes`; the defaults and the split in engine/capture_sizes.py,
where the simulator reads them too): decode graphs for those <= max_num_seqs, mixed graphs for all <=
max_num_batched_tokens. The graphs share one memory pool and are captured
largest first; each is warmed up before capture so no kernel compiles inside it.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from testbed.engine.capture_sizes import padded_tokens, split_sizes
from testbed.engine.config import EngineConfig
from testbed.worker.context import reset_context, set_context

logger = logging.getLogger(__name__)


class StaticInputs:
    """The device buffers every graph reads its step from (the largest step's size; graphs see prefixes)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 lora: bool = False, stage_input: tuple[int, torch.dtype] | None = None) -> None:
        # a later pipeline stage's input: the previous stage's (hidden states, residual), given (hidden size, dtype)
        self.intermediate = None if stage_input is None else torch.zeros(
            2, max_tokens, stage_input[0], dtype=stage_input[1], device=device)
        # each token's LoRA slot (-1: base), when LoRA is on
        self.lora_idx = torch.full((max_tokens,), -1, dtype=torch.long, device=device) if lora else None
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.num_live = torch.ones(1, dtype=torch.int32, device=device)  # sequences with queries (mixed graphs)

    def set_context(self, is_decode: bool, num_tokens: int, num_seqs: int, lora: bool = True) -> None:
        """The attention context of a graph of this size, over prefixes of the buffers (`lora` False: no adapter
        runs in it)."""
        set_context(is_decode, self.slot_mapping[:num_tokens], self.block_tables[:num_seqs],
                    self.seq_lens[:num_seqs], self.cu_seqlens_q[:num_seqs + 1], None if is_decode else self.num_live,
                    None if self.lora_idx is None or not lora else self.lora_idx[:num_tokens])


def pad_into(buf: StaticInputs, x, num_tokens: int, num_seqs: int, decode: bool = False) -> None:
    """Copy step `x` (StepInputs) into the buffers' first num_tokens / num_seqs rows with the padding of
    the module docstring (`decode`: a decode graph's, one token per sequence, padding rows with seq_len 0
    and nothing to own). Device copies only: no host sync, no allocation."""
    T, B = x.input_ids.numel(), x.seq_lens.numel()
    if T > num_tokens or B + (not decode) > num_seqs or (decode and num_tokens != num_seqs):
        raise ValueError(f"a step of {T} tokens and {B} sequences does not fit a {'decode' if decode else 'mixed'} "
                         f"graph of {num_tokens} tokens and {num_seqs} sequences")
    buf.input_ids[:T].copy_(x.input_ids, non_blocking=True)
    buf.positions[:T].copy_(x.positions, non_blocking=True)
    buf.slot_mapping[:T].copy_(x.slot_mapping, non_blocking=True)
    buf.slot_mapping[T:num_tokens].fill_(-1)
    if buf.lora_idx is not None:
        if x.lora_idx is not None:
            buf.lora_idx[:T].copy_(x.lora_idx, non_blocking=True)
            buf.lora_idx[T:num_tokens].fill_(-1)
        else:
            buf.lora_idx[:num_tokens].fill_(-1)
    buf.seq_lens[:B].copy_(x.seq_lens, non_blocking=True)
    buf.seq_lens[B:num_seqs].fill_(0)
    buf.cu_seqlens_q[:B + 1].copy_(x.cu_seqlens_q, non_blocking=True)
    buf.cu_seqlens_q[B + 1:num_seqs + 1].fill_(num_tokens)
    if not decode:
        buf.seq_lens[B:B + 1].fill_(num_tokens - T)  # the padding's owner
        buf.num_live.fill_(B + 1)  # the extend kernel skips the empty sequences after it
    if B:
        buf.block_tables[:B, :x.block_tables.shape[1]].copy_(x.block_tables, non_blocking=True)


class CudaGraphs:
    """The captured graphs of one model runner (one TP rank, or one pipeline stage): `replay(x)` runs a step
    through the graph that fits it, or returns None (run it eagerly). `stage_input` (hidden size,
    dtype): the model is a pipeline stage after the first, called with the previous stage's activations."""

    def __init__(self, model: Callable, config: EngineConfig, max_model_len: int, device: torch.device,
                 stage_input: tuple[int, torch.dtype] | None = None) -> None:
        self.model = model
        self.decode_sizes, self.mixed_sizes = split_sizes(config)
        self.max_num_seqs = config.max_num_seqs
        max_tokens = max(self.decode_sizes + self.mixed_sizes, default=1)
        max_seqs = max([self.num_seqs(t) for t in self.mixed_sizes] + self.decode_sizes + [1])
        self.buf = StaticInputs(max_tokens, max_seqs, -(-max_model_len // config.block_size), device,
                                config.enable_lora, stage_input)
        # (size, with the LoRA kernels) -> (graph, its output); with LoRA on, each size both ways
        self.lora_variants = (True, False) if self.buf.lora_idx is not None else (False,)
        self.decode: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mixed: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.capture_bytes = 0

    def _call(self, n: int):
        """The model over the buffers' first n tokens (and, on a later pipeline stage, their activations)."""
        b = self.buf
        inter = None if b.intermediate is None else (b.intermediate[0, :n], b.intermediate[1, :n])
        return self.model(b.input_ids[:n], b.positions[:n], inter)

    def num_seqs(self, num_tokens: int) -> int:
        """The sequences a mixed graph of num_tokens tokens holds: every step's, and the padding's owner."""
        return min(num_tokens, self.max_num_seqs) + 1

    @torch.inference_mode()
    def capture(self, device: torch.device, sync: Callable[[], None] | None = None,
                capture_error_mode: str = "global") -> None:
        """Capture every size, largest first, in one memory pool; logs the time and memory it took. `sync` waits
        for the device (the tensor-parallel executor's watches the other ranks meanwhile, so a rank that fails
        during the warm-ups ends the capture within its timeout); `capture_error_mode` "thread_local" lets
        NCCL's watchdog thread query its events while this thread captures."""
        sync = sync or (lambda: torch.cuda.synchronize(device))
        t0 = time.perf_counter()
        sync()
        before = torch.cuda.mem_get_info(device)[0]
        b = self.buf
        b.cu_seqlens_q.copy_(torch.arange(b.cu_seqlens_q.numel(), dtype=torch.int32, device=device))
        pool = None
        plan = ([(False, t, lora) for t in reversed(self.mixed_sizes) for lora in self.lora_variants]
                + [(True, s, lora) for s in reversed(self.decode_sizes) for lora in self.lora_variants])
        for is_decode, n, lora in plan:
            seqs = n if is_decode else self.num_seqs(n)
            if not is_decode:  # a valid padded layout: one sequence of n fresh tokens, the rest empty
                b.cu_seqlens_q[1:seqs + 1].fill_(n)
                b.seq_lens[:seqs].fill_(0)
                b.seq_lens[0].fill_(n)
                b.num_live.fill_(1)
            else:
                b.seq_lens[:seqs].fill_(1)
            b.set_context(is_decode, n, seqs, lora)
            try:
                self._call(n)  # warm up: compiles every kernel outside the graph
                sync()
                b.set_context(is_decode, n, seqs, lora)  # afresh: what layers cache per step is made inside the graph
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool, capture_error_mode=capture_error_mode):
                    out = self._call(n)
            finally:
                reset_context()
            pool = g.pool() if pool is None else pool
            (self.decode if is_decode else self.mixed)[n, lora] = (g, out)
        b.seq_lens.zero_()
        sync()
        self.capture_s = time.perf_counter() - t0
        self.capture_bytes = before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (%d decode, %d mixed, up to %d tokens) in %.1f s, %.2f GiB",
                    len(plan), len(self.decode), len(self.mixed), max(self.mixed_sizes + self.decode_sizes, default=0),
                    self.capture_s, self.capture_bytes / 2**30)

    def size_for(self, x) -> tuple[bool, int] | None:
        """(is a decode graph, its size) for step x, or None when no capture size fits it (a step of more
        tokens, or of more sequences than max_num_seqs, which no scheduler step has but a synthetic one may)."""
        n = x.input_ids.numel()
        if x.is_decode and self.decode_sizes and n <= self.decode_sizes[-1]:
            return True, padded_tokens(self.decode_sizes, n)
        if x.seq_lens.numel() > self.max_num_seqs:
            return None
        if self.mixed_sizes and n <= self.mixed_sizes[-1]:
            return False, padded_tokens(self.mixed_sizes, n)
        return None

    def replay(self, x, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Hidden states [T, hidden] of step x through its graph (a pipeline stage before the last: its (hidden,
        residual) for the next stage; a later stage takes the previous one's as `intermediate`), or None when no
        graph fits it."""
        fit = self.size_for(x)
        if fit is None or not (self.decode or self.mixed):
            return None
        is_decode, n = fit
        T = x.input_ids.numel()
        pad_into(self.buf, x, n, n if is_decode else self.num_seqs(n), is_decode)
        if self.buf.intermediate is not None:
            self.buf.intermediate[0, :T].copy_(intermediate[0])
            self.buf.intermediate[1, :T].copy_(intermediate[1])
        lora = x.lora_idx is not None and self.buf.lora_idx is not None
        g, out = (self.decode if is_decode else self.mixed)[n, lora]
        g.replay()
        return tuple(o[:T] for o in out) if isinstance(out, tuple) else out[:T]
