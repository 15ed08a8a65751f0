"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It flattens the step (every scheduled request contributes its new tokens: prefill chunks and
decodes mixed), maps each token to its cache slot (slot_mapping = block_table[pos // bs] * bs +
pos % bs), runs the model under the attention context, and samples only for requests that caught
up with all their tokens (mid-prompt chunks sample nothing, -1). The KV cache is sized from the
memory a profiling forward leaves under `gpu_memory_utilization` on a GPU, or a fixed budget on CPU.

Requests whose logits need processing (SamplingParams.needs_processing) or that ask for prompt logprobs
are tracked from their first step to their end, so a step without any takes the fast path with no
per-row checks. Processing rows with bad words or a grammar need every token sampled before: under async
scheduling the previous step's token is then read back from the device first (a sync only such steps pay).

Pipeline parallelism (worker/pipeline.py): a stage runs its layers on the activations the previous stage sent
and sends its own to the next one. The executor's runner holds the last stage, so its `execute_async` posts the
receive of the step's activations and defers its layers, LM head and sampling to the function it returns: the
engine launches the next batches into the pipeline (the first stages work on them) before it reads this one back.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from itertools import chain
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from testbed.engine.config import EngineConfig
from testbed.engine.outputs import NO_TOKEN_LEFT, ModelRunnerOutput, SchedulerOutput
from testbed.worker import prompt_logprobs
from testbed.worker.cache_engine import CacheEngine
from testbed.worker.context import reset_context, set_context
from testbed.worker.cuda_graphs import CudaGraphs
from testbed.worker.logits_processors import RowContext
from testbed.worker.model import LlamaForCausalLM
from testbed.worker.pipeline import PendingActivations, StageLink, get_parallel_state
from testbed.worker.pooler import Pooler
from testbed.worker.sampler import Sampler
from testbed.engine.stepper import ExecutorFailure
from testbed.worker.timing import StepTimer

CPU_KV_CACHE_BYTES = 2 << 30
LOGIT_SLICE_ROWS = 1024  # the LM head's rows at once when a step wants more (prompt logprobs)


@dataclass
class StepInputs:
    """The flat tensors of one step (what TP rank 0 broadcasts to the other ranks)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    sample_idx: torch.Tensor
    is_decode: bool
    lora_idx: torch.Tensor | None = None  # each token's LoRA slot (-1: base); None when no row runs an adapter


def packed_offsets(n64, n32) -> tuple[list[int], list[int], int, int]:
    """Where a step's packed arrays lie: (int64 offsets, int32 offsets, byte offset of the int32 part, total
    bytes) for arrays of these lengths. Every array starts 16-byte aligned: Triton compiles a kernel variant
    per pointer alignment, so views whose alignment followed the batch size cost a fresh compile on new
    batch shapes."""
    p64 = np.cumsum([0] + [-(-n // 2) * 2 for n in n64]).tolist()  # int64 offsets, 16-byte steps
    p32 = np.cumsum([0] + [-(-n // 4) * 4 for n in n32]).tolist()
    off32 = 8 * p64[-1]
    return p64, p32, off32, off32 + 4 * p32[-1]


def sampled_rows(so: SchedulerOutput) -> list[int]:
    """Indices of the requests that sample a token this step: those whose scheduled tokens reach the end of
    what they have (a prompt's last chunk, a decode, or a placeholder under async scheduling), pooling
    requests aside (their prompt's hidden states are pooled instead)."""
    before, counts = so.num_computed_before, so.num_new_tokens
    if so.has_pooling:
        return [i for i, r in enumerate(so.requests)
                if before[i] + counts[i] >= r.num_tokens and r.pooling_params is None]
    return [i for i, r in enumerate(so.requests) if before[i] + counts[i] >= r.num_tokens]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, load_tokenizer: Callable | None = None) -> None:
        """`load_tokenizer`: gives the model's tokenizer (grammars of structured outputs need it)."""
        self.model = model
        self.config = config
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        attn = model.attention_layers()
        self.num_layers = len(attn)
        self.num_kv_heads, self.head_dim = attn[0].num_kv_heads, attn[0].head_dim
        self.sampler = Sampler(device, config.seed, load_tokenizer)
        self.pooler = Pooler()
        self._processed: set[str] = set()  # live requests whose logits need processing
        self._prompt_logprobs: set[str] = set()  # live requests that ask for prompt logprobs
        self.num_gpu_blocks = 0
        self.memory_baseline = 0  # bytes on the GPU that are another tenant's (executor.memory_in_use)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cache_engine: CacheEngine | None = None  # the CPU swap pool and the block moves (allocate_kv_cache)
        self.broadcast_inputs = None  # set by the TP executor: sends each step's packed inputs to the other ranks
        self.broadcast_block_ops = None  # set by the TP executor: sends each step's block moves to the other ranks
        # pinned host buffers, used in turn: one per step that may be in flight, and one more (a deferred pipeline
        # stage reads its step's inputs when the engine reads the step back, up to pipeline_parallel_size later)
        n = max(2, config.pipeline_parallel_size + 1)
        self._staging: list[torch.Tensor | None] = [None] * n
        self._dev_staging: list[torch.Tensor | None] = [None] * n  # their device twins (GPU only)
        self._staging_turn = 0
        state = get_parallel_state()
        self.stage: StageLink | None = None  # this rank's links to the neighbouring pipeline stages
        if state is not None and state.pp_size > 1:
            self.stage = StageLink(state, model.config.hidden_size, dtype, device, depth=config.pipeline_parallel_size)
        self.is_last_stage = state is None or state.is_last
        self._prev_tokens: torch.Tensor | None = None  # the last launched step's sampled tokens (device)
        self._prev_rows: dict[str, int] = {}  # request id -> its row in _prev_tokens
        self.record_timing = False  # attach a StepTiming to every output (testbed profile)
        self.graphs: CudaGraphs | None = None  # captured CUDA graphs (capture_cuda_graphs), None: eager
        self.eager_steps = False  # run every step eagerly even with graphs (`testbed profile` times attention so)
        self.lora = None  # the adapters' device slots and host cache (worker/lora.py), with enable_lora
        if config.enable_lora:
            from testbed.worker.lora import WorkerLoRA
            self.lora = WorkerLoRA(model, config, device, dtype)

    # ---- KV cache ------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block across all layers of this rank (its pipeline stage's)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The worst-case forward the KV cache is sized after: max_num_batched_tokens prompt tokens (as few
        sequences as max_model_len allows) and max_num_seqs logits rows, upcast as the sampler does. Every
        tensor-parallel rank runs it, so all run the same collectives; only rank 0 gets logits. Nothing here
        reads the device back, so a caller can watch the other ranks while it waits for the device."""
        cfg = self.config
        n = min(cfg.max_num_batched_tokens, self.max_model_len * cfg.max_num_seqs)
        seqs = max(1, min(cfg.max_num_seqs, -(-n // self.max_model_len)))
        lens = [n // seqs + (i < n % seqs) for i in range(seqs)]
        ends = np.cumsum(lens).tolist()
        # on the host: attention without a KV cache reads the sequence bounds back (a device sync per layer)
        cu = torch.tensor([0] + ends, dtype=torch.int32)
        positions = torch.cat([torch.arange(l, device=self.device) for l in lens])
        last = torch.tensor([e - 1 for e in ends], device=self.device)
        set_context(False, cu_seqlens_q=cu)
        try:
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self._stage_forward(n, None, lambda intermediate: self.model(ids, positions, intermediate))
            logits = None if hidden is None else self.model.compute_logits(
                hidden[last].repeat(max(1, cfg.max_num_seqs // seqs), 1))
        finally:
            reset_context()
        if logits is not None:  # rank 0 (None elsewhere): the sampler's float32 copy counts toward the peak
            logits.float()

    @torch.inference_mode()
    def profile_num_blocks(self, sync: Callable[[], None] | None = None) -> int:
        """How many KV blocks fit: GPU memory under the utilisation bound minus the peak of `profile_run`; on
        CPU a fixed budget (after a `profile_run` when TESTBED_PROFILE_ON_CPU=1, which checks that path, its
        collectives on every rank included, without a GPU). `sync` waits for the device (the tensor-parallel
        executor's watches the other ranks meanwhile); torch.cuda.synchronize by default."""
        cfg = self.config
        if self.device.type != "cuda":
            if os.environ.get("TESTBED_PROFILE_ON_CPU", "0") == "1":
                self.profile_run()
            per_seq = -(-self.max_model_len // self.block_size)
            return max(per_seq + 1, min(per_seq * cfg.max_num_seqs, CPU_KV_CACHE_BYTES // self.block_bytes))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        if sync is not None:
            sync()
        else:
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        others = (total - free) - torch.cuda.memory_reserved(self.device) - self.memory_baseline
        budget = total * cfg.gpu_memory_utilization - peak - others
        torch.cuda.empty_cache()
        blocks = int(budget // self.block_bytes)
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache: {total / 2**30:.1f} GiB x {cfg.gpu_memory_utilization}"
                               f" - peak {peak / 2**30:.1f} GiB - other processes {others / 2**30:.1f} GiB; raise "
                               "--gpu-memory-utilization, lower --max-num-batched-tokens or use a smaller model")
        if self.memory_baseline and budget > free:
            raise RuntimeError(f"this replica's share of the GPU ({cfg.gpu_memory_utilization} x {total / 2**30:.1f} GiB"
                               f") needs {budget / 2**30:.1f} GiB for its KV cache, but only {free / 2**30:.1f} GiB is "
                               "free next to the replicas sharing it: split --gpu-memory-utilization among them "
                               "(e.g. 0.45 each for two)")
        return blocks

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """The device KV cache of `num_blocks` blocks and a CPU swap pool of `num_cpu_blocks` (swap preemption)."""
        self.num_gpu_blocks = num_blocks
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append((attn.k_cache, attn.v_cache))
        self.cache_engine = CacheEngine(self.kv_caches, num_cpu_blocks)
        if self.device.type == "cuda" and self.kv_caches:  # every layer has the same shapes: one warm-up serves all
            from testbed.kernels.prefill_attention import warm_up_prefill_variants
            warm_up_prefill_variants(*self.kv_caches[0], attn.num_heads)

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput, rows: list[int] | None = None, extra_rows: list[int] = ()) -> StepInputs:
        """Flat step tensors, packed on the host and sent in one non-blocking copy (no stream sync, so
        the next step can be prepared while the GPU runs this one). Decode-only steps (every request
        adds one token, the common case) take a vectorised path. A position the core has no token
        for yet (async scheduling) is a placeholder: its id is read on the device from the previous
        step's sampled tokens. rows: `sampled_rows(so)`, when the caller has it already; extra_rows:
        flat token rows whose logits are wanted after the sampled ones (prompt logprobs)."""
        rows = sampled_rows(so) if rows is None else rows
        bs = self.block_size
        reqs, starts, counts = so.requests, so.num_computed_before, so.num_new_tokens
        B = len(reqs)
        lens = np.fromiter((len(t) for t in so.block_ids), dtype=np.int64, count=B)
        tables = np.zeros((B, int(lens.max(initial=0))), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
            chain.from_iterable(so.block_ids), dtype=np.int32, count=int(lens.sum()))
        ph_dst: list[int] = []
        ph_src: list[int] = []
        is_decode = all(n == 1 for n in counts)
        if is_decode:
            positions = np.fromiter(starts, dtype=np.int64, count=B)
            input_ids = np.zeros(B, dtype=np.int64)
            for i, (req, p) in enumerate(zip(reqs, starts)):
                if p < req.num_tokens:
                    input_ids[i] = req.token_id(p)
                else:
                    ph_dst.append(i)
                    ph_src.append(self._prev_row(req.request_id))
            sample_idx = list(rows) + list(extra_rows) if extra_rows else rows  # one token per request: row = token
            slots = tables[np.arange(B), positions // bs].astype(np.int64) * bs + positions % bs
            seq_lens = positions + 1
            cu = np.arange(B + 1)
        else:
            ids: list[int] = []
            pos: list[int] = []
            slot_list: list[int] = []
            seq_lens, cu = [], [0]
            for req, start, n, table in zip(reqs, starts, counts, so.block_ids):
                end = start + n
                known = min(end, req.num_tokens)
                ids.extend(req.token_ids(start, known))
                for p in range(known, end):  # placeholders (at most the one token in flight)
                    ph_dst.append(len(ids))
                    ph_src.append(self._prev_row(req.request_id))
                    ids.append(0)
                pos.extend(range(start, end))
                slot_list.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                seq_lens.append(end)
                cu.append(cu[-1] + n)
            sample_idx = [cu[i + 1] - 1 for i in rows] + list(extra_rows)  # each sampling request's last token
            input_ids, positions, slots = ids, pos, slot_list
        lora_idx = (np.repeat(np.asarray(so.lora_slots, dtype=np.int64), counts) if so.num_lora_tokens
                    else ())  # each token's LoRA slot, only when some row runs an adapter
        return self._upload([input_ids, positions, slots, sample_idx, ph_dst, ph_src, lora_idx],
                            [seq_lens, cu, tables], is_decode)

    def _prev_row(self, request_id: str) -> int:
        row = self._prev_rows.get(request_id)
        if row is None:
            raise RuntimeError(f"request {request_id!r} is scheduled on a token the previous step did not sample "
                               "(async scheduling out of order: update each step before scheduling the one after next)")
        return row

    def _upload(self, longs: list, ints: list, is_decode: bool) -> StepInputs:
        """Pack the step's arrays into one pinned host buffer (`_pack`), hand the bytes to the other
        tensor-parallel ranks, and load them onto the device (`load_packed`)."""
        layout, host = self._pack(longs, ints)
        if self.broadcast_inputs is not None:
            self.broadcast_inputs(host, layout, is_decode)
        return self.load_packed(layout, is_decode)

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        """The next of two pinned host buffers, at least nbytes, as a uint8 array. A buffer is reused two
        steps later, when its copy and every reader of the step's views (the step's kernels) have long
        finished (each step's results are read back before the step after next)."""
        self._staging_turn = (self._staging_turn + 1) % len(self._staging)
        buf = self._staging[self._staging_turn]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 16) * 2, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._staging[self._staging_turn] = buf
        return buf.numpy()

    def _pack(self, longs: list, ints: list) -> tuple[tuple, np.ndarray]:
        """(layout, the packed bytes) of int64 and int32 arrays in the next staging buffer (placed by
        `packed_offsets`). The layout is (int64 lengths, int32 lengths, the previous step's sampled-token count)."""
        n64 = [len(a) for a in longs]
        n32 = [int(np.size(a)) for a in ints]
        p64, p32, off32, nbytes = packed_offsets(n64, n32)
        host = self._staging_buffer(nbytes)
        v64 = host[:off32].view(np.int64)
        v32 = host[off32:nbytes].view(np.int32)
        for a, n, o in zip(longs, n64, p64):
            v64[o:o + n] = a
        for a, n, o in zip(ints, n32, p32):
            v32[o:o + n] = np.ravel(a)
        n_prev = self._prev_tokens.numel() if n64[4] else 0
        return (tuple(n64), tuple(n32), n_prev), host[:nbytes]

    def load_packed(self, layout: tuple, is_decode: bool, packed: bytes | None = None) -> StepInputs:
        """The step's device views of packed bytes: this rank's staging buffer (`_pack`'s), or `packed` (the
        bytes rank 0 sent a tensor-parallel rank, first copied into a staging buffer). One host-to-device
        copy without a stream sync into a persistent device buffer, no allocation. Positions the core has no
        token for yet (async scheduling) take the previous step's sampled tokens; ranks other than 0 get
        them from rank 0 by a broadcast."""
        n64, n32, n_prev = layout
        p64, p32, off32, nbytes = packed_offsets(n64, n32)
        if packed is not None:
            host = self._staging_buffer(nbytes)
            host[:nbytes] = np.frombuffer(packed, dtype=np.uint8, count=nbytes)
        buf = self._staging[self._staging_turn]
        if self.device.type == "cuda":
            dev = self._dev_staging[self._staging_turn]
            if dev is None or dev.numel() < nbytes:
                dev = torch.empty(buf.numel(), dtype=torch.uint8, device=self.device)
                self._dev_staging[self._staging_turn] = dev
            dev = dev[:nbytes]
            dev.copy_(buf[:nbytes], non_blocking=True)
        else:
            dev = buf[:nbytes].clone()
        d64 = dev[:off32].view(torch.int64)
        d32 = dev[off32:nbytes].view(torch.int32)
        input_ids, positions, slots, sample_idx, ph_dst, ph_src, lora_idx = (d64[p64[i]:p64[i] + n64[i]]
                                                                             for i in range(7))
        seq_lens, cu, tables = (d32[p32[i]:p32[i] + n32[i]] for i in range(3))
        B = n32[0]
        if n64[4]:
            prev = self._prev_tokens
            if dist.is_initialized() and dist.get_world_size() > 1:
                if dist.get_rank() != 0:
                    prev = torch.empty(n_prev, dtype=torch.long, device=self.device)
                dist.broadcast(prev, 0)
            input_ids[ph_dst] = prev[ph_src]
        return StepInputs(input_ids, positions, slots, tables.view(B, n32[2] // B if B else 0), seq_lens, cu,
                          sample_idx, is_decode, lora_idx if n64[6] else None)

    @torch.inference_mode()
    def capture_cuda_graphs(self, sync: Callable[[], None] | None = None) -> None:
        """Capture every step kind and size of worker/cuda_graphs.py (decode batches, mixed and prefill
        steps up to the largest capture size); `forward` replays them from then on. Every tensor-parallel
        rank captures the same graphs, in the same order, their all-reduces inside (worker/tp_all_reduce.py);
        a pipeline stage captures its own layers, its activations' send and receive left outside the graphs.
        `sync` waits for the device (torch.cuda.synchronize by default)."""
        stage_input = None
        if self.stage is not None and not self.stage.state.is_first:
            stage_input = (self.stage.hidden_size, self.stage.dtype)
        self.graphs = CudaGraphs(self.model, self.config, self.max_model_len, self.device, stage_input)
        tp = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.graphs.capture(self.device, sync, "thread_local" if tp else "global")

    @property
    def graph_sizes(self) -> list[int]:
        """The decode batch sizes captured (none without graphs)."""
        return self.graphs.decode_sizes if self.graphs is not None else []

    @property
    def mixed_graph_sizes(self) -> list[int]:
        """The token counts of the mixed graphs captured, to which a step with a prefill chunk is padded (none
        without graphs)."""
        return self.graphs.mixed_sizes if self.graphs is not None else []

    def _eager(self, x: StepInputs, intermediate: tuple[torch.Tensor, torch.Tensor] | None):
        """The model (this pipeline stage's layers) run op by op under step x's attention context."""
        set_context(x.is_decode, x.slot_mapping, x.block_tables, x.seq_lens, x.cu_seqlens_q, lora_idx=x.lora_idx)
        try:
            return self.model(x.input_ids, x.positions, intermediate)
        finally:
            reset_context()

    def _stage_forward(self, num_tokens: int, pending: PendingActivations | None, run: Callable):
        """`run(intermediate)` (a graph replay or the eager model, over a step of num_tokens tokens) as this
        pipeline stage: a later stage first takes the previous stage's activations (`pending`, posted earlier,
        else received now), a stage before the last sends its own to the next one and returns None."""
        if self.stage is None:
            return run(None)
        state = self.stage.state
        intermediate = None
        if not state.is_first:
            intermediate = (pending if pending is not None else self.stage.post_recv(num_tokens)).wait()
        out = run(intermediate)
        if state.is_last:
            return out
        self.stage.send(*out)
        return None

    @torch.inference_mode()
    def forward(self, x: StepInputs, pending: PendingActivations | None = None) -> torch.Tensor | None:
        """The decoder over the step's tokens (a captured graph when one fits): hidden states [T, hidden]; None on
        a pipeline stage before the last (its activations went to the next stage)."""
        graphs = None if self.eager_steps else self.graphs

        def run(intermediate):
            out = None if graphs is None else graphs.replay(x, intermediate)
            return self._eager(x, intermediate) if out is None else out
        return self._stage_forward(x.input_ids.numel(), pending, run)

    def logit_slices(self, hidden: torch.Tensor, sample_idx: torch.Tensor):
        """(first row, logits [rows, vocab] or None off rank 0) of the rows `sample_idx` picks from `hidden`,
        LOGIT_SLICE_ROWS at a time: prompt logprobs of a long chunk never hold [tokens, vocab] logits at once.
        Every tensor-parallel rank cuts the same slices (the LM head gathers across ranks)."""
        n = sample_idx.numel()
        for a in range(0, max(n, 1), LOGIT_SLICE_ROWS):
            yield a, self.model.compute_logits(hidden.index_select(0, sample_idx[a:a + LOGIT_SLICE_ROWS]))

    @torch.inference_mode()
    def run(self, x: StepInputs) -> None:
        """Forward pass and, on the last pipeline stage, the LM head (a rank other than 0: its share of the
        collectives and sends)."""
        hidden = self.forward(x)
        if hidden is not None:
            for _ in self.logit_slices(hidden, x.sample_idx):
                pass

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(so)()

    def execute_async(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Launch the step on the device and return a function that waits for it and gives its output.
        Nothing here reads the device back, so the caller can schedule and launch the next step first.
        With `record_timing` set, the output carries a StepTiming (host stamps and device events)."""
        t0 = time.perf_counter()
        timer = StepTimer(self.device) if self.record_timing else None
        if so.finished_req_ids:
            self.sampler.forget(so.finished_req_ids)
            self.pooler.forget(so.finished_req_ids)
            self._processed.difference_update(so.finished_req_ids)
            self._prompt_logprobs.difference_update(so.finished_req_ids)
        if so.has_block_ops:  # before the step's inputs: its forward reads and writes the moved blocks
            if self.broadcast_block_ops is not None:
                self.broadcast_block_ops(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)
            self.cache_engine.run(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)
            if not so.requests:  # a step that only swapped its preempted requests out
                return lambda: ModelRunnerOutput([], time.perf_counter() - t0)
        if so.new_req_ids:
            self._track(so)
        if self.lora is not None and so.lora_slots is not None:
            self.lora.apply(so)  # the step's adapters into their slots (on every tensor-parallel rank)
        rows = sampled_rows(so)
        plp = prompt_logprobs.prompt_logprob_rows(so) if self._prompt_logprobs else None
        x = self.prepare(so, rows, plp.flat if plp is not None else ())  # sent to the other TP ranks too
        if timer is not None:
            timer.prepared(t0)
        if self.stage is not None:  # the last stage: its part runs once the earlier stages are done with the step
            pending = self.stage.post_recv(x.input_ids.numel())
            return lambda: self._launch(so, x, rows, plp, timer, t0, pending)()
        return self._launch(so, x, rows, plp, timer, t0)

    def _launch(self, so: SchedulerOutput, x: StepInputs, rows: list[int], plp, timer: StepTimer | None, t0: float,
                pending: PendingActivations | None = None) -> Callable[[], ModelRunnerOutput]:
        """Run the prepared step x on the device (after the previous stage's activations, `pending`) and sample;
        returns the function that waits for the result."""
        try:
            hidden = self.forward(x, pending)
            if timer is not None:
                timer.mark()
            logits, prompt_parts = self._logits(hidden, x.sample_idx, len(rows), plp)
            pooled = self.pooler.pool(hidden, so) if so.has_pooling else None
        except Exception as e:
            if self.broadcast_inputs is None:
                raise
            # the other ranks wait in this step's collectives: the group is out of step for good
            raise ExecutorFailure(f"rank 0's forward failed after the other tensor-parallel ranks started the "
                                  f"step ({type(e).__name__}: {e})") from e
        reqs = so.requests
        params = [reqs[i].sampling_params for i in rows]
        sampled = None
        if rows:
            contexts = self._contexts(so, rows) if self._processed else None
            sampled = self.sampler.sample(logits, params, [reqs[i].request_id for i in rows], contexts)
        self._prev_tokens = sampled[0] if rows else None
        self._prev_rows = {reqs[i].request_id: j for j, i in enumerate(rows)}
        done = None
        if self.device.type == "cuda":
            if sampled is not None:
                tokens, lp, stuck = sampled
                sampled = (tokens.to("cpu", non_blocking=True), _to_host(lp),
                           None if stuck is None else stuck.to("cpu", non_blocking=True))
            if prompt_parts is not None:
                prompt_parts = [_to_host(part) for part in prompt_parts]
            if pooled is not None:
                pooled = [v if v is None else v.to("cpu", non_blocking=True) for v in pooled]
            # Waited for even when nothing was sampled (every row mid-prompt): the staging buffer this step's
            # inputs were copied from is rewritten two steps later, so its copy must be done by then.
            done = torch.cuda.Event()
            done.record()
        if timer is not None:
            timer.launched()

        def result() -> ModelRunnerOutput:
            if done is not None:
                done.synchronize()
            if timer is not None:
                timer.synced()
            out = [-1] * len(reqs)
            logprobs = errors = None
            if sampled is not None:
                tokens, lps = self.sampler.to_lists(sampled, params)
                for i, tok in zip(rows, tokens):
                    out[i] = tok
                    if tok < 0:  # its logits processing left no token
                        errors = errors or {}
                        errors[reqs[i].request_id] = NO_TOKEN_LEFT
                if lps is not None:
                    logprobs = [None] * len(reqs)
                    for i, lp in zip(rows, lps):
                        logprobs[i] = lp
            plps = prompt_logprobs.to_lists(prompt_parts, plp, len(reqs)) if plp is not None else None
            end = time.perf_counter()
            return ModelRunnerOutput(out, end - t0, logprobs, None if timer is None else timer.result(end),
                                     errors, plps, pooler_output=None if pooled is None else
                                     [v if v is None else v.tolist() for v in pooled])

        return result

    def _logits(self, hidden: torch.Tensor, sample_idx: torch.Tensor, num_sampled: int,
                plp: prompt_logprobs.PromptLogprobRows | None) -> tuple[torch.Tensor | None, list | None]:
        """(logits of the sampled rows, prompt-logprob parts or None) from the LM head's slices: rows past
        num_sampled are prompt-logprob rows, reduced slice by slice, so only the sampled rows' logits are kept."""
        sampled, parts = [], [] if plp is not None else None
        for a, logits in self.logit_slices(hidden, sample_idx):
            if logits is None:  # a tensor-parallel rank other than 0 (never here) or no rows at all
                continue
            cut = max(0, min(num_sampled - a, logits.shape[0]))
            sampled.append(logits[:cut] if cut < logits.shape[0] else logits)
            if cut < logits.shape[0]:
                parts.extend(prompt_logprobs.compute(logits[cut:], plp, a + cut - num_sampled))
        if not sampled:
            return None, parts
        return (sampled[0] if len(sampled) == 1 else torch.cat(sampled)), parts

    def _track(self, so: SchedulerOutput) -> None:
        """Note the step's new requests that need processing or prompt logprobs. A request seen for the first
        time (not resumed after a preemption) starts with no sampler state: an id may come again from a
        fresh engine on this runner."""
        new = so.new_req_ids
        fresh = []
        for r in so.requests:
            rid = r.request_id
            if rid in new:
                if not r.num_preemptions:
                    fresh.append(rid)
                sp = r.sampling_params
                if sp is not None and sp.needs_processing:  # a pooling request has none
                    self._processed.add(rid)
                if r.prompt_logprobs is not None:
                    self._prompt_logprobs.add(rid)
        self.sampler.forget(fresh)

    def _contexts(self, so: SchedulerOutput, rows: list[int]) -> list[RowContext | None]:
        """RowContexts of the sampled rows that need processing. Rows with bad words or a grammar get every
        token sampled before, the previous step's one still in flight included (read back from the device)."""
        reqs = so.requests
        out: list[RowContext | None] = []
        in_flight: list[int] = []  # positions in `out` whose output lacks the previous step's token
        for i in rows:
            r = reqs[i]
            if r.request_id not in self._processed:
                out.append(None)
                continue
            p = r.sampling_params
            n_out = max(len(r.output_token_ids) + r.num_pending - 1, len(r.output_token_ids))
            if n_out > len(r.output_token_ids) and (p.bad_words_token_ids or p.structured_outputs is not None):
                in_flight.append(len(out))
            out.append(RowContext(r.prompt_token_ids, r.output_token_ids, n_out, r.eos_token_id))
        if in_flight:
            src = [self._prev_row(reqs[rows[k]].request_id) for k in in_flight]
            for k, tok in zip(in_flight, self._prev_tokens[src].tolist()):
                c = out[k]
                out[k] = c._replace(output_token_ids=[*c.output_token_ids, tok])
        return out


def _to_host(parts: tuple | None) -> tuple | None:
    """Tensors (None kept) copied to the host without a stream sync."""
    return None if parts is None else tuple(t if t is None else t.to("cpu", non_blocking=True) for t in parts)
