"""`testbed profile`: a designed sweep of synthetic steps through the real executor, written as a profile.

The simulator's fidelity is the fidelity of its step time, so the step time is measured, not fitted to
serving runs: the same executor a serving run uses (CUDA graphs, kernels, sampler, TP broadcast and
all-reduce) runs steps of chosen shapes, and every step's time is split by `StepTiming` into host work
(input preparation, launch, readback) and device work (decoder forward, LM head + sampler).

Sweeps (each point: warm-up runs, then the median of `reps` timed runs):
- decode: batch (both edges of every CUDA-graph bucket, so padding is measured) x context per request;
  also the pipelined cycle of the same step under async scheduling;
- chunk: one prefill/extend chunk of `new` tokens after `cached` tokens (long-context attention measured);
  a second pass with hooks on the attention modules splits attention from the rest of the forward;
- decode rows: decodes that share an eager step with a small chunk (how a mixed step runs them);
- engine host: the EngineCore's own schedule + update per batch size and per admitted prompt token;
- host-device: KV blocks swapped out to a pinned CPU pool and back, and copied within the device, as the
  worker's CacheEngine moves them (swap preemption, copy on write): the bandwidths the simulator prices them at;
- LoRA (with --enable-lora): each step's extra device time with every row on an adapter, and an adapter's load
  into a slot from its folder and from the host cache (lora_measure.py);
- validation: random mixed steps (heterogeneous contexts, several chunks), measured whole, so the cost
  model's composition error is known before anyone trusts it.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from testbed.engine.config import EngineConfig
from testbed.kernels.decode_attention import sm_count, split_edges
from testbed.profiling.host_costs import engine_host_costs
from testbed.profiling.lora_measure import measure_lora
from testbed.profiling.profile_file import FORMAT, VERSION
from testbed.profiling.step_measure import ASYNC_TIMING, SLEEP_CYCLES, TIMING_FIELDS, StepMeasurer
from testbed.profiling.synthetic_steps import Row, StepFactory, decode_rows

CONTEXTS = (16, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CHUNKS = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
CHUNK_CONTEXTS = (0, 512, 2048, 8192, 16384, 32768, 65536, 131072)
ROW_BATCHES = (1, 4, 16, 64, 128, 256)
ROW_CHUNK = 16  # the small chunk that makes a step of decode rows a mixed step
TAIL_BASE = 256  # decode tail steps: every row at this context but one, which has `delta` more
TAIL_DELTAS = (1024, 4096, 16384, 65536, 131072)
TAIL_BATCHES = (1, 2, 4, 8, 16, 33, 64, 128, 256)


@dataclass
class Grid:
    """The sweep's points. Points whose KV does not fit the cache, or past max_model_len, are skipped."""

    decode_batches: list[int]
    contexts: list[int]
    chunk_tokens: list[int]
    chunk_contexts: list[int]
    row_batches: list[int]
    num_validation: int = 30
    reps: int = 5
    warmup: int = 2
    tail_batches: list[int] = field(default_factory=lambda: list(TAIL_BATCHES))
    tail_deltas: list[int] = field(default_factory=lambda: list(TAIL_DELTAS))
    tail_base: int = TAIL_BASE
    host_batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128, 256])
    host_admit_tokens: list[int] = field(default_factory=lambda: [16, 256, 1024, 4096, 8192])
    host_decode_steps: int = 30  # decode steps per batch whose median is the engine's host time (engine_host_costs)


def batch_edges(graph_sizes: list[int], max_num_seqs: int) -> list[int]:
    """Both ends of every CUDA-graph bucket (a batch of b runs the smallest graph >= b), up to max_num_seqs."""
    edges, prev = set(), 0
    for g in sorted(s for s in graph_sizes if s <= max_num_seqs) or [max_num_seqs]:
        edges.update((prev + 1, g))
        prev = g
    edges.add(max_num_seqs)
    return sorted(e for e in edges if 1 <= e <= max_num_seqs)


def default_grid(config: EngineConfig, max_model_len: int, graph_sizes: list[int], quick: bool = False,
                 split_batches: Sequence[int] = ()) -> Grid:
    """The full sweep, or (quick) a few points of each kind for tests on a CPU. `split_batches`: both ends of each
    run of batch sizes the decode kernel splits alike (kernels/decode_attention.split_edges), where the uneven-context
    table is measured too: its extra time changes with the split, which no interpolation across one can follow."""
    mnbt, mns = config.max_num_batched_tokens, config.max_num_seqs
    contexts = sorted({c for c in CONTEXTS if c < max_model_len} | {max_model_len - 1})
    top_chunk = min(mnbt, max_model_len)  # one sequence's chunk: a longer one cannot be scheduled
    chunks = sorted({n for n in CHUNKS if n <= top_chunk} | {top_chunk})
    batches = batch_edges(graph_sizes, mns)
    rows = sorted({b for b in ROW_BATCHES if b < mns} | {max(1, mns - 1)})  # beside the chunk: at most mns in all
    if quick:  # a smoke test of every sweep on a CPU: tiny shapes, one timed run each
        small = lambda xs, top: sorted({x for x in xs if x <= top} | {min(xs)})[:2]
        return Grid(small(batches, 4), small(contexts, 64), small(chunks, 64), [0, min(32, max_model_len // 4)],
                    small(rows, 4), num_validation=2, reps=1, warmup=1, tail_batches=small(batches, 4),
                    tail_deltas=[max_model_len // 4], tail_base=max_model_len // 4, host_batches=[1, 4],
                    host_admit_tokens=[16, 64], host_decode_steps=3)
    top = max_model_len - TAIL_BASE - 1
    return Grid(batches, contexts, chunks, [c for c in CHUNK_CONTEXTS if c < max_model_len], rows,
                tail_batches=sorted({b for b in (*TAIL_BATCHES, *split_batches) if b < mns} | {mns}),
                tail_deltas=sorted({d for d in TAIL_DELTAS if d < top} | {top}))


# ---- the sweeps -----------------------------------------------------------------------------------
def _table(rows: list[int], cols: list[int]) -> list[list[float | None]]:
    return [[None] * len(cols) for _ in rows]


def sweep_grid(m: StepMeasurer, f: StepFactory, rows: Callable[[int, int], list[Row]], axes: dict[str, list[int]],
               extra: dict, capacity: int, max_model_len: int, tick: Callable[[], None], timed: str) -> dict:
    """Measure the step `rows(a, b)` at every point of the two `axes`; `timed` adds the async cycle
    ("async_cycle_s") or the attention share ("attention_s") to the sync timings. A point whose rows need more
    KV than the cache holds, or a row past max_model_len, stays None (it cannot happen in serving)."""
    (n0, xs), (n1, ys) = axes.items()
    out = {n0: xs, n1: ys, **extra, **{k: _table(xs, ys) for k in (*TIMING_FIELDS, timed)}}
    for i, a in enumerate(xs):
        for j, b in enumerate(ys):
            tick()
            step = rows(a, b)
            if sum(c + n for c, n, _ in step) > capacity or max(c + n for c, n, _ in step) > max_model_len:
                continue
            so = f.step(step)
            for k, v in m.sync(so).items():
                out[k][i][j] = v
            out[timed][i][j] = m.async_cycle(so) if timed == "async_cycle_s" else m.attention_s(so)
    return out


def sweep_rows_tail(m: StepMeasurer, f: StepFactory, grid: Grid, capacity: int, tick: Callable[[], None]) -> dict:
    """The same unevenness for decode rows inside a mixed step: device time in attention of the uneven
    step (rows at TAIL_BASE, one at TAIL_BASE + delta, plus a ROW_CHUNK chunk) and of the even step with
    the same total context."""
    batches, base = grid.row_batches, grid.tail_base
    out = {"batch": batches, "delta": grid.tail_deltas, "base": base, "chunk": ROW_CHUNK,
           **{k: _table(batches, grid.tail_deltas) for k in ("attention_s", "even_attention_s")}}
    chunk = [(0, ROW_CHUNK, False)]
    for i, b in enumerate(batches):
        for j, d in enumerate(grid.tail_deltas):
            tick()
            if b * (base + 1) + d + ROW_CHUNK > capacity:
                continue
            uneven = f.step(decode_rows(b - 1, base) + decode_rows(1, base + d) + chunk)
            even = f.step(decode_rows(b, base + d // b) + chunk)
            for so in (uneven, even):
                for _ in range(m.warmup):
                    m.executor.execute(so)
            out["attention_s"][i][j] = m.attention_s(uneven)
            out["even_attention_s"][i][j] = m.attention_s(even)
    return out


def random_step(rng: np.random.Generator, config: EngineConfig, max_model_len: int, capacity: int) -> list[Row]:
    """A mixed step as a loaded server forms them: decodes of spread-out contexts, then up to 3 chunks."""
    budget, kv = config.max_num_batched_tokens, capacity
    top = max(2, min(max_model_len, capacity) - 1)
    rows: list[Row] = []
    for _ in range(int(rng.integers(0, config.max_num_seqs + 1))):
        c = int(np.clip(rng.lognormal(math.log(800), 1.0), 1, top - 1))
        if budget < 2 or kv < c + 1:
            break
        rows.append((c, 1, True))
        budget, kv = budget - 1, kv - c - 1
    for _ in range(int(rng.integers(0 if rows else 1, 4))):
        if budget < 2 or len(rows) >= config.max_num_seqs:
            break
        n = int(rng.integers(2, budget + 1))
        cached = int(rng.choice([0, int(rng.integers(0, max(1, top - n)))]))
        if n + cached > min(top, kv):
            continue
        rows.append((cached, n, False))
        budget, kv = budget - n, kv - n - cached
    return rows or [(1, 1, True)]


def validation_steps(m: StepMeasurer, f: StepFactory, grid: Grid, config: EngineConfig, max_model_len: int,
                     capacity: int, tick: Callable[[], None], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(grid.num_validation):
        tick()
        rows = random_step(rng, config, max_model_len, capacity)
        so = f.step(rows)
        out.append({"rows": [list(r) for r in rows], **m.sync(so), "async_cycle_s": m.async_cycle(so)})
    return out


def run_profile(executor, config: EngineConfig, grid: Grid | None = None, quick: bool = False,
                progress: bool = True, reps: int | None = None) -> dict:
    """Every sweep on `executor` (built for `config`); returns the profile's measured grid (no metadata)."""
    runner = executor.runner
    max_model_len = executor.max_model_len
    graph_sizes = list(getattr(runner, "graph_sizes", []))
    grid = grid or default_grid(config, max_model_len, graph_sizes, quick, split_edges(
        runner.num_kv_heads, sm_count(runner.device), config.max_num_seqs))
    if reps is not None:
        if reps < 1:
            raise ValueError(f"--reps must be >= 1, got {reps}")
        grid.reps = reps
    capacity = executor.num_gpu_blocks * config.block_size
    f = StepFactory(executor.num_gpu_blocks, config.block_size, executor.vocab_size, config.seed)
    m = StepMeasurer(executor, grid.reps, grid.warmup)
    total = (len(grid.decode_batches) + len(grid.row_batches)) * len(grid.contexts) \
        + len(grid.chunk_tokens) * len(grid.chunk_contexts) \
        + (len(grid.tail_batches) + len(grid.row_batches)) * len(grid.tail_deltas) \
        + grid.num_validation + (len(grid.decode_batches) + len(grid.chunk_tokens)) * (runner.lora is not None)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="profiling", unit="step", file=sys.stderr, mininterval=1.0)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    t0 = time.perf_counter()
    try:
        run = lambda rows, axes, extra, timed: sweep_grid(m, f, rows, axes, extra, capacity,  # noqa: E731
                                                         max_model_len, tick, timed)
        base, chunk = grid.tail_base, [(0, ROW_CHUNK, False)]
        result = {
            # decode-only steps: batch x context per request
            "decode": run(lambda b, c: decode_rows(b, c), {"batch": grid.decode_batches, "context": grid.contexts},
                          {}, "async_cycle_s"),
            # uneven decode steps: every row at `base` but one at base + delta (the longest row bounds attention)
            "decode_tail": run(lambda b, d: decode_rows(b - 1, base) + decode_rows(1, base + d),
                               {"batch": grid.tail_batches, "delta": grid.tail_deltas}, {"base": base},
                               "async_cycle_s"),
            # one prefill/extend chunk of `tokens` new after `context` cached ones
            "chunk": run(lambda n, c: [(c, n, False)], {"tokens": grid.chunk_tokens, "context": grid.chunk_contexts},
                         {}, "attention_s"),
            # decode rows in a mixed step (beside a ROW_CHUNK-token chunk at context 0)
            "decode_rows": run(lambda b, c: decode_rows(b, c) + chunk, {"batch": grid.row_batches,
                                                                        "context": grid.contexts},
                               {"chunk": ROW_CHUNK}, "attention_s"),
            "rows_tail": sweep_rows_tail(m, f, grid, capacity, tick),
            "validation": validation_steps(m, f, grid, config, max_model_len, capacity, tick),
            "engine_host": engine_host_costs(config, max_model_len, grid.host_batches, grid.host_admit_tokens,
                                             executor, grid.host_decode_steps),
            "host_device": measure_block_moves(runner, grid.reps),
        }
        if runner.lora is not None:
            result["lora"] = measure_lora(m, f, runner, grid.decode_batches, grid.chunk_tokens, capacity, grid.reps,
                                          tick)
    finally:
        runner.record_timing = False
        if bar is not None:
            bar.close()
    result["sweep_wall_s"] = time.perf_counter() - t0
    result["async_timing"] = ASYNC_TIMING  # how its async cycles were timed (`--quick` times its anchors the same way)
    result["graph_sizes"] = graph_sizes
    # the simulator prices a step with a prefill chunk at the mixed size it was padded to (sim/profiled.py)
    result["mixed_graph_sizes"] = list(getattr(runner, "mixed_graph_sizes", []))
    result["attention_timing"] = {"device_sleep_cycles": SLEEP_CYCLES, "issue_overruns": m.attention.overruns}
    if not any(v for row in result["chunk"]["attention_s"] for v in row if v is not None):
        raise RuntimeError("the profile measured no time in attention (its forward hooks did not run); the "
                           "profile would fold attention into the linear layers and misprice long contexts")
    return result


SWAP_PROBE_BLOCKS = 64  # blocks per measured move: one long request's worth at block size 16


def measure_block_moves(runner, reps: int) -> dict:
    """Median times of moving SWAP_PROBE_BLOCKS KV blocks (every other device block, none adjacent, as a fragmented
    cache's are) out to a pinned CPU pool, back in, and within the device, as the worker's CacheEngine moves a
    step's blocks; and the bandwidths they give (bytes of blocks moved / time; a device copy reads and writes each)."""
    from testbed.worker.cache_engine import CacheEngine
    n = max(1, min(SWAP_PROBE_BLOCKS, runner.num_gpu_blocks // 2))
    engine = CacheEngine(runner.kv_caches, n)
    out = [(2 * i, i) for i in range(n)]
    back = [(c, g) for g, c in out]
    copy = [(2 * i, 2 * i + 1) for i in range(n) if 2 * i + 1 < runner.num_gpu_blocks]
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def timed(fn, pairs) -> float:
        times = []
        for _ in range(max(reps, 3) + 1):
            sync()
            t0 = time.perf_counter()
            fn(pairs)
            sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))  # the first warms up

    t_out, t_in, t_copy = timed(engine.swap_out, out), timed(engine.swap_in, back), timed(engine.copy, copy)
    nbytes = n * runner.block_bytes
    return {"blocks": n, "block_bytes": runner.block_bytes, "swap_out_s": t_out, "swap_in_s": t_in,
            "copy_s": t_copy, "bandwidth": 2 * nbytes / (t_out + t_in),
            "device_bandwidth": 2 * len(copy) * runner.block_bytes / t_copy if copy else None}


def device_name(device: torch.device) -> str:
    """The accelerator's name as torch reports it ("NVIDIA H200"), or the host CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu ({platform.processor() or platform.machine()})"


def gpu_preset_name(name: str) -> str:
    """The GPU preset a device name maps to ("NVIDIA H100 80GB HBM3" -> "H100-SXM"), else the name itself."""
    from testbed.specs.hardware import get_gpu_spec
    try:
        return get_gpu_spec(name).name
    except ValueError:
        return name


def profile_gpu(device: torch.device) -> str:
    """The GPU a profile made on `device` is filed under: its preset name ("H100-SXM"), or "cpu"."""
    return gpu_preset_name(device_name(device)) if device.type == "cuda" else "cpu"


def build_profile(model: str | None, config: EngineConfig, load_format: str = "auto", dtype: str = "auto",
                  device: str | None = None, enforce_eager: bool = False, quick: bool = False,
                  progress: bool = True, reps: int | None = None) -> dict:
    """Build the executor a serving run would use for these flags, sweep it, and return the profile. A profile is
    of one pipeline stage's GPUs running every layer (--pipeline-parallel-size 1): the simulator cuts its per-layer
    time into stages (sim/pipeline.py)."""
    from testbed.worker.executor import create_executor
    if config.pipeline_parallel_size > 1:
        raise ValueError(f"--pipeline-parallel-size {config.pipeline_parallel_size}: profile with 1 (and the "
                         "--tensor-parallel-size of one stage); `testbed simulate -pp N` splits that profile's "
                         "per-layer time into N stages and adds the activations' transfers between them")
    t0 = time.perf_counter()
    executor = create_executor(model, config, load_format, dtype, device, enforce_eager)
    try:
        prof = profile_executor(executor, model, config, load_format, enforce_eager, quick, progress, reps)
    finally:
        executor.shutdown()
        del executor  # the next model's executor sizes its KV cache from the memory this one leaves
        if torch.cuda.is_available():
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    prof["setup_s"] = time.perf_counter() - t0 - prof["sweep_wall_s"]
    return prof


def profile_executor(executor, model: str | None, config: EngineConfig, load_format: str = "auto",
                     enforce_eager: bool = False, quick: bool = False, progress: bool = True,
                     reps: int | None = None) -> dict:
    """Sweep an executor built for `config` and return the profile: the measured grid plus model,
    hardware, engine flags, versions and git sha."""
    from pathlib import Path

    from testbed.runs.rundir import environment_info
    measured = run_profile(executor, config, quick=quick, progress=progress, reps=reps)
    runner, hf = executor.runner, executor.hf_config
    dev = device_name(runner.device)
    name = Path(model).name if model and load_format != "dummy" else (model or "SmolLM2-135M-Instruct")
    return {
        "format": FORMAT, "version": VERSION,
        "model": {"name": name, "path": executor.model_path, "load_format": load_format,
                  **{k: hf.get(k) for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}},
        "gpu": profile_gpu(runner.device), "device_name": dev,
        "device_count": torch.cuda.device_count() if runner.device.type == "cuda" else 0,
        "tensor_parallel_size": config.tensor_parallel_size, "dtype": str(runner.dtype).removeprefix("torch."),
        "engine": {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_model_len": executor.max_model_len, "block_size": config.block_size,
                   "num_gpu_blocks": executor.num_gpu_blocks, "enforce_eager": enforce_eager,
                   "gpu_memory_utilization": config.gpu_memory_utilization, "quick": quick},
        **measured, **environment_info(),
    }
