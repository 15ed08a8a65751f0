"""Step-time cost models for sim mode: the analytical roofline (for unprofiled models and GPUs) and the
recorded timeline of a real run (decision parity), plus KV-cache capacity. The measured model is in
profiled.py. `step_time` is the simulator's hot path: O(1), a handful of float operations on constants
precomputed in `__init__`, no numpy. An empty step costs 0 s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from testbed.engine.outputs import SchedulerOutput
from testbed.sim.async_timeline import AsyncTimeline, missing_scheduled, replayable
from testbed.specs.presets import ModelSpec
from testbed.specs.hardware import GPUSpec


class CostModel(Protocol):
    def step_time(self, so: SchedulerOutput) -> float:
        """Seconds one engine step takes."""
        ...


@dataclass(frozen=True)
class RankShape:
    """What one tensor-parallel rank holds. KV heads are split across ranks, or replicated (one per
    rank) when tp > num_key_value_heads."""

    num_heads: int
    num_kv_heads: int
    layer_linear_params: float  # QKV, O, gate/up/down of all layers on this rank
    lm_head_params: float
    weight_params: float        # everything resident on this rank (embedding counted once when tied)


def rank_shape(model: ModelSpec, tensor_parallel_size: int = 1) -> RankShape:
    """Per-rank shape; ValueError when `tensor_parallel_size` cannot split the model's heads."""
    tp, h, hd, kv = tensor_parallel_size, model.hidden_size, model.head_dim, model.num_key_value_heads
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tensor-parallel-size must be an integer >= 1, got {tp!r}")
    if model.num_attention_heads % tp or (kv % tp and tp % kv):
        raise ValueError(f"--tensor-parallel-size {tp} cannot split {model.name}: it must divide its "
                         f"{model.num_attention_heads} attention heads, and divide or be a multiple of its {kv} KV heads")
    heads_r, kv_r = model.num_attention_heads // tp, max(1, kv // tp)
    q, kvd = heads_r * hd, kv_r * hd
    linear = h * (q + 2 * kvd) + q * h + 3 * h * model.intermediate_size / tp
    extra = 2 * h + (q + 2 * kvd if model.attention_bias else 0) + (2 * hd if model.qk_norm else 0)
    vocab_rows = model.vocab_size * h / tp
    weights = model.num_hidden_layers * (linear + extra) + vocab_rows * (1 if model.tie_word_embeddings else 2) + h
    return RankShape(heads_r, kv_r, model.num_hidden_layers * linear, vocab_rows, weights)


def kv_block_bytes(model: ModelSpec, block_size: int, tensor_parallel_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one KV block (K and V of `block_size` tokens, every layer) on one tensor-parallel rank."""
    r = rank_shape(model, tensor_parallel_size)
    return block_size * 2 * model.num_hidden_layers * r.num_kv_heads * model.head_dim * dtype_bytes


@dataclass(frozen=True)
class BlockMoveCost:
    """Time of a step's KV block moves, which the worker makes on the step's stream before its forward: a swapped
    block crosses the host link once (`host_bandwidth`, pinned copies), a block copied on write is read and
    written in device memory (`device_bandwidth`). Every rank moves its own share in parallel."""

    block_bytes: float
    host_bandwidth: float
    device_bandwidth: float

    def time(self, so: SchedulerOutput) -> float:
        swapped = len(so.blocks_to_swap_out) + len(so.blocks_to_swap_in)
        return (swapped * self.block_bytes / self.host_bandwidth
                + 2 * len(so.blocks_to_copy) * self.block_bytes / self.device_bandwidth)


@dataclass(frozen=True)
class RooflineConstants:
    """What the roofline adds to physics, recalibrated from measured profiles (testbed/sim/calibrate.py):
    a decode step's fixed cost (host preparation, launches, sampler, readback), the host time to issue one
    decoder layer of an eager step (a floor under any step with a prefill chunk: the engine of the shipped
    profiles replays those as CUDA graphs too, so it binds only for a tiny model on a slow host), and the
    fractions of the GPU preset's bandwidth and matmul rate that attention and the linear layers reach."""

    step_overhead_s: float
    eager_overhead_per_layer_s: float
    bandwidth_efficiency: float
    matmul_efficiency: float

    def __post_init__(self) -> None:
        if self.step_overhead_s < 0 or self.eager_overhead_per_layer_s < 0:
            raise ValueError(f"roofline overheads must be >= 0, got {self}")
        if not (0 < self.bandwidth_efficiency <= 1 and 0 < self.matmul_efficiency <= 1):
            raise ValueError(f"roofline efficiencies must be in (0, 1], got {self}")


PHYSICAL = RooflineConstants(0.0, 0.0, 1.0, 1.0)  # the bounds alone: no overhead, every byte and FLOP at the preset
# Medians over the profiles shipped in testbed/profiling/profiles (3 models x H100 of 2026-11-26 and x H200 of
# 2026-11-28, every step graphed; the H200 Llama-3.2-1B and Qwen3-0.6B ones re-made at a6f1e0d); a test checks that
# calibrate.roofline_constants() over those files still gives these.
CALIBRATED = RooflineConstants(step_overhead_s=1.4505e-3, eager_overhead_per_layer_s=0.026195e-3,
                               bandwidth_efficiency=0.93176, matmul_efficiency=0.79814)


# Host time a row sampled under a grammar adds to a step (xgrammar's matcher advance and bitmask fill; the
# device's copy, unpack and mask are small next to the forward): the median "host fill per row" of
# benchmarks/grammar.py, 2026-11-24, AMD EPYC (shared 2-core VM), SmolLM2's 49k vocabulary, a 3-field JSON schema.
GRAMMAR_ROW_S = 15e-6
# Compile time of a trace request's grammar (any JSON: xgrammar's built-in JSON grammar) against the tokenizer,
# off the step loop: 4.6-6.8 ms measured (SmolLM2's 49k vocabulary, the same VM, 2026-11-26). The request is
# schedulable from the first step after it.
GRAMMAR_COMPILE_S = 5e-3


class RooflineCostModel:
    """Per step: each part costs max(bytes / bandwidth, flops / matmul rate) on one TP rank (ranks run in
    parallel on equal shares), at the calibrated fractions of the GPU preset's rates, plus 2 ring
    all-reduces per layer when tp > 1, plus a fixed per-step overhead; a step with a prefill chunk takes at
    least the host time to issue its layers eagerly (RooflineConstants.eager_overhead_per_layer_s).

    Parts: decoder linear layers (weights read once, 2*T*params FLOPs); LM head for the last token
    of each request only (2*B*vocab*hidden FLOPs); attention (C KV positions read per layer,
    4*P*heads*head_dim FLOPs per layer). Activations and KV writes are ignored (small next to these).
    Rows sampled under a grammar (structured outputs) add GRAMMAR_ROW_S of host time each; KV block moves (swap
    preemption, copy on write) add their BlockMoveCost at the preset's host link and memory bandwidth.
    """

    def __init__(self, model: ModelSpec, gpu: GPUSpec, tensor_parallel_size: int = 1, dtype_bytes: int = 2,
                 step_overhead_s: float | None = None, allreduce_bandwidth: float | None = None,
                 allreduce_latency_s: float | None = None, constants: RooflineConstants = CALIBRATED,
                 block_size: int = 16) -> None:
        """`block_size`: the engine's, for the bytes of a KV block it swaps or copies."""
        if step_overhead_s is not None:
            constants = replace(constants, step_overhead_s=step_overhead_s)
        if dtype_bytes <= 0:
            raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes}")
        self.model, self.gpu, self.tensor_parallel_size, self.constants = model, gpu, tensor_parallel_size, constants
        r = rank_shape(model, tensor_parallel_size)
        bw, mm = gpu.mem_bandwidth * constants.bandwidth_efficiency, gpu.matmul_flops * constants.matmul_efficiency
        d, L = dtype_bytes, model.num_hidden_layers
        self._lin_mem = r.layer_linear_params * d / bw          # s, weight read
        self._lin_flop = 2 * r.layer_linear_params / mm         # s per scheduled token
        self._head_mem = r.lm_head_params * d / bw
        self._head_flop = 2 * r.lm_head_params / mm             # s per request (one logits row each)
        self._attn_mem = L * 2 * r.num_kv_heads * model.head_dim * d / bw  # s per context token
        self._attn_flop = L * 4 * r.num_heads * model.head_dim / mm        # s per (query, key) pair
        tp = tensor_parallel_size
        ar_bw = allreduce_bandwidth if allreduce_bandwidth is not None else gpu.interconnect_bandwidth
        ar_lat = allreduce_latency_s if allreduce_latency_s is not None else gpu.allreduce_latency_s
        if ar_bw <= 0 or ar_lat < 0:
            raise ValueError(f"allreduce_bandwidth must be > 0 and allreduce_latency_s >= 0, got {ar_bw}, {ar_lat}")
        n_ar = 2 * L if tp > 1 else 0
        self._ar_per_token = n_ar * 2 * (tp - 1) / tp * model.hidden_size * d / ar_bw
        self._fixed = constants.step_overhead_s + n_ar * ar_lat
        self._eager = constants.eager_overhead_per_layer_s * L
        self.moves = BlockMoveCost(kv_block_bytes(model, block_size, tp, d), gpu.host_bandwidth, bw)

    def step_time(self, so: SchedulerOutput) -> float:
        T = so.total_num_scheduled_tokens
        moves = self.moves.time(so) if (so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy) else 0.0
        if T <= 0:
            return moves
        B = len(so.requests)
        device = (max(self._lin_mem, self._lin_flop * T) + max(self._head_mem, self._head_flop * B)
                  + max(self._attn_mem * so.sum_context_tokens, self._attn_flop * so.sum_attn_pairs)
                  + self._ar_per_token * T)
        if so.num_prefill_tokens and self._eager > device:
            device = self._eager
        return device + self._fixed + GRAMMAR_ROW_S * so.num_structured_reqs + moves

    def pipeline_split(self, so: SchedulerOutput) -> tuple[float, float, float]:
        """(host, decoder layers, LM head) of step_time(so), which they sum to: what a pipeline stage's share
        is cut from (sim/pipeline.py). The layers' part is linear layers, attention and all-reduces (or the host
        time to issue the layers of an eager step, when that is longer); the host part is the fixed overhead
        and grammar rows."""
        T = so.total_num_scheduled_tokens
        if T <= 0:
            return 0.0, 0.0, 0.0
        head = max(self._head_mem, self._head_flop * len(so.requests))
        layers = (max(self._lin_mem, self._lin_flop * T) + self._ar_per_token * T
                  + max(self._attn_mem * so.sum_context_tokens, self._attn_flop * so.sum_attn_pairs))
        if so.num_prefill_tokens and self._eager > layers + head:
            layers = self._eager - head
        return self._fixed + GRAMMAR_ROW_S * so.num_structured_reqs, layers, head


def recorded_grammar_events(path, starts: list[float] | None = None) -> dict[str, tuple[float, str | None, int | None]]:
    """A recorded run's grammar outcomes (its grammars.parquet, if any): request id -> (ready time, the failure's
    reason or None, how many steps the run had scheduled by then, or None without `starts`: a data-parallel run,
    whose replicas each have their own steps), what sim/grammars.py replays."""
    import bisect
    from pathlib import Path
    grammars = Path(path) / "grammars.parquet"
    if not grammars.is_file():
        return {}
    import pandas as pd
    g = pd.read_parquet(grammars, columns=["request_id", "ready", "error"])
    errors = g["error"].astype(object).where(g["error"].notna(), None)
    return {rid: (t, e, None if starts is None else bisect.bisect_left(starts, t))
            for rid, t, e in zip(g["request_id"], g["ready"], errors)}


def recorded_cycles(starts: list[float], durations: list[float]) -> list[float]:
    """Each recorded step's cycle: from its schedule to the next step's (the last step: its own duration). A
    replay that gives step k this long schedules step k+1 at its recorded time."""
    return [b - a for a, b in zip(starts, starts[1:])] + durations[-1:]


class RecordedCostModel:
    """Decision parity: replays the step timeline a real run recorded (its steps.parquet).

    Step k lasts until the real step k+1 was scheduled (the last one its measured duration), so when
    the simulator schedules step k+1 exactly the arrivals the real engine had admitted are in, and the
    same sans-I/O scheduler must then form the same batch. A batch unlike the recorded one (its rows, prefill
    and decode tokens: `shapes`, where the record has them) or running out of recorded
    steps means the two runs diverged, which is an error, not a fallback. An `--async-scheduling` run is replayed
    at its recorded schedule and update times instead (`async_timeline`, sim/async_timeline.py)."""

    def __init__(self, starts: list[float], durations: list[float],
                 shapes: list[tuple[int, int, int]] | None = None) -> None:
        if not starts or len(starts) != len(durations) or shapes is not None and len(shapes) != len(starts):
            raise ValueError("a recorded timeline needs one start and one duration per step (and at least one step)")
        self.durations = recorded_cycles(starts, durations)
        self.shapes = shapes
        self.first_start = starts[0]  # the replay's first step starts here too (its cycles then follow the record)
        self.step = 0
        self.async_timeline: AsyncTimeline | None = None  # an async run's: each step scheduled and updated as recorded
        # request id -> (when its grammar outcome reached the scheduler, None or why it failed, the index of the
        # first step scheduled after it): the run's grammars.parquet, replayed by the simulator (sim/grammars.py)
        self.grammar_events: dict[str, tuple[float, str | None, int]] = {}

    @classmethod
    def from_run_dir(cls, path) -> "RecordedCostModel":
        from testbed.runs.rundir import read_run
        run = read_run(path)
        if not replayable(run):
            raise missing_scheduled(path)
        overlapped = bool(run.manifest.get("config", {}).get("async_scheduling"))
        steps = run.steps(columns=["replica", "start", "duration", *STEP_SHAPE, *(["scheduled"] if overlapped else [])])
        if steps["replica"].nunique() > 1:
            raise ValueError(f"{path}: recorded timelines replay one replica; this run has {steps['replica'].nunique()}")
        starts, durations = steps["start"].tolist(), steps["duration"].tolist()
        model = cls(starts, durations, list(zip(*(steps[c].tolist() for c in STEP_SHAPE))))
        if overlapped:
            model.async_timeline = AsyncTimeline(steps["scheduled"].tolist(), starts, durations)
        model.grammar_events = recorded_grammar_events(path, steps["scheduled"].tolist() if overlapped else starts)
        return model

    def step_time(self, so: SchedulerOutput) -> float:
        if self.step >= len(self.durations):
            raise RuntimeError(f"the simulation needs more than the {len(self.durations)} recorded steps: its "
                               "decisions diverged from the recorded run (different trace, flags or cache size?)")
        k, d = self.step, self.durations[self.step]
        if self.async_timeline is not None:
            self.async_timeline.formed(f"step {k}:")
        if self.shapes is not None:
            shape = (len(so.requests), so.num_prefill_tokens, so.num_decode_tokens)
            if shape != self.shapes[k]:
                raise RuntimeError(f"step {k}: the simulation formed a batch of " + _shape(shape) + ", the recorded "
                                   "run " + _shape(self.shapes[k]) + ": its decisions diverged from the recorded run "
                                   "(different trace, flags or cache size?)")
        self.step += 1
        return d


STEP_SHAPE = ("num_reqs", "num_prefill_tokens", "num_decode_tokens")  # a step's batch, as recorded


def _shape(s: tuple) -> str:
    return f"{s[0]} requests, {s[1]} prefill and {s[2]} decode tokens"


def num_gpu_blocks(model: ModelSpec, gpu: GPUSpec, block_size: int, gpu_memory_utilization: float = 0.9,
                   tensor_parallel_size: int = 1, dtype_bytes: int = 2, activation_reserve_bytes: int | None = None,
                   pipeline_parallel_size: int = 1) -> int:
    """KV blocks per rank: (memory * utilization - weights per rank - activation reserve) / block bytes per rank.
    Default reserve: max(1 GiB, 5% of memory). ValueError when not even one block fits. With pipeline stages each
    rank holds its stage's layers (and the embedding or the LM head) and their KV cache; the engine gets the
    fewest blocks any stage has room for, as real mode sizes it (the block ids are shared by all stages)."""
    if pipeline_parallel_size > 1:
        from testbed.specs.partition import pp_partition
        return min(_stage_blocks(model, gpu, block_size, gpu_memory_utilization, tensor_parallel_size, dtype_bytes,
                                 activation_reserve_bytes, layers, s == 0, s == pipeline_parallel_size - 1)
                   for s, layers in enumerate(pp_partition(model.num_hidden_layers, pipeline_parallel_size)))
    return _stage_blocks(model, gpu, block_size, gpu_memory_utilization, tensor_parallel_size, dtype_bytes,
                         activation_reserve_bytes, model.num_hidden_layers, True, True)


def _stage_blocks(model: ModelSpec, gpu: GPUSpec, block_size: int, gpu_memory_utilization: float,
                  tensor_parallel_size: int, dtype_bytes: int, activation_reserve_bytes: int | None, layers: int,
                  first: bool, last: bool) -> int:
    """num_gpu_blocks of one rank holding `layers` decoder layers, the embedding if `first`, the LM head (and
    final norm) if `last`."""
    if block_size < 1 or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"block_size must be >= 1 and gpu_memory_utilization in (0, 1], "
                         f"got {block_size}, {gpu_memory_utilization}")
    r = rank_shape(model, tensor_parallel_size)
    reserve = activation_reserve_bytes if activation_reserve_bytes is not None else max(1 << 30, 0.05 * gpu.memory_bytes)
    budget = gpu.memory_bytes * gpu_memory_utilization
    L = model.num_hidden_layers
    if layers == L:
        weights = r.weight_params * dtype_bytes
    else:  # a pipeline stage: its share of the layers, and the vocabulary tables it holds
        tables = (first + last) if not (first and last and model.tie_word_embeddings) else 1
        weights = ((r.weight_params - r.lm_head_params * (1 if model.tie_word_embeddings else 2)) * layers / L
                   + r.lm_head_params * tables) * dtype_bytes
    block_bytes = block_size * 2 * layers * r.num_kv_heads * model.head_dim * dtype_bytes
    free = budget - weights - reserve
    if free < block_bytes:
        raise ValueError(f"{model.name} does not fit {gpu.name} at tp={tensor_parallel_size}: "
                         f"{gpu_memory_utilization:.2f} x {gpu.memory_bytes / 1e9:.1f} GB = {budget / 1e9:.1f} GB, "
                         f"weights {weights / 1e9:.1f} GB/rank, activation reserve {reserve / 1e9:.1f} GB, leaving "
                         f"{free / 1e9:.2f} GB for KV (one block = {block_bytes / 1e6:.2f} MB); raise "
                         "--tensor-parallel-size or --gpu-memory-utilization, or pick a bigger GPU")
    return int(free // block_bytes)
