"""`testbed simulate`: load a trace, size the cache, run the SimPy cluster, write the run directory."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from testbed import warn
from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.specs.presets import ModelSpec, get_model_spec
from testbed.runs.finish import finish_run, start_run, trace_record
from testbed.sim.error_bands import expected_error
from testbed.sim.cluster import simulate
from testbed.sim.collector import collector_paused
from testbed.sim.trace_requests import trace_to_request
from testbed.sim.cost_model import kv_block_bytes, num_gpu_blocks
from testbed.sim.factory import load_cost_model
from testbed.specs.hardware import get_gpu_spec
from testbed.sim.pipeline import PipelineCostModel
from testbed.specs.partition import pipeline_manifest
from testbed.sim.recorded_dp import RecordedDPRun, simulate_recorded_dp
from testbed.workload.lora import trace_loras
from testbed.workload.trace import REJECTED_OUTPUT_TOKENS, load_trace


def check_vocabulary(trace: list, trace_path, spec: ModelSpec) -> None:
    """ValueError naming the request when a trace's prompt_token_ids fall outside the model's vocabulary
    (as `testbed replay` refuses them), before anything is simulated."""
    for r in trace:
        if r.prompt_token_ids is not None:
            bad = next((t for t in r.prompt_token_ids if t >= spec.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{trace_path}: request {r.id!r}: prompt token id {bad} is outside {spec.name}'s "
                                 f"vocabulary of {spec.vocab_size}; give ids below it or pick the model the trace "
                                 "was tokenized for (--model)")


def warn_rejections(cols: dict[str, list], trace: list, config: EngineConfig, blocks: int, max_model_len: int,
                    vocab_size: int) -> None:
    """Say on stderr how many requests the engine rejected and why (the first one's reason); `cols`: the
    request columns of the run's records. A request a run directory's trace kept as rejected there (asking for
    REJECTED_OUTPUT_TOKENS, which every engine refuses) is said to be that, not given the reason the sentinel makes."""
    rejected = [rid for rid, why in zip(cols["request_id"], cols["finish_reason"]) if why == "rejected"]
    if not rejected:
        return
    by_id = {tr.id: tr for tr in trace}
    again = [rid for rid in rejected if by_id[rid].output_tokens == REJECTED_OUTPUT_TOKENS]
    new = [by_id[rid] for rid in rejected if by_id[rid].output_tokens != REJECTED_OUTPUT_TOKENS]
    msg = f"{len(rejected)} of {len(trace)} requests were rejected and not simulated (finish_reason 'rejected' in " \
          "requests.parquet)"
    if again:
        msg += (f"; {len(again)} of them (the first, {again[0]!r}) were rejected in the run the trace was read from, "
                "and are rejected again as they were there")
    if new:
        loras = trace_loras([tr.lora for tr in trace], config)
        reason = (EngineCore(config, blocks, max_model_len, num_cpu_blocks=0).rejection_reason(
                  trace_to_request(new[0], vocab_size, config.seed, loras))
                  or f"the waiting queue was full (--max-num-waiting {config.max_num_waiting})")
        msg += f"; the first{' other' if again else ''}, {new[0].id!r}: {reason}"
    warn(msg)


@collector_paused()
def run_simulation(trace_path: str, config: EngineConfig, *, model: str = "Llama-3.1-8B", gpu: str = "H100-SXM",
                   cost_model: str = "auto", request_rate: float | None = None, burstiness: float = 1.0,
                   limit: int | None = None, trace_format: str = "auto", slo_ttft: float | None = None,
                   slo_tpot: float | None = None, output: str | Path | None = None, progress: bool = True,
                   on_progress: Callable[[float, float], None] | None = None) -> tuple[Path | None, dict]:
    """Simulate a trace end to end; returns (run directory or None, summary). `progress` draws a bar
    on stderr; `on_progress(sim_time, horizon)` is called as simulated time advances (for GUIs).
    Every input is checked before the simulation starts; requests the configuration must reject
    (too long for max_model_len or the KV cache) are counted in the run and explained on stderr."""
    start_run(output, slo_ttft, slo_tpot)
    spec, gpu_spec = get_model_spec(model), get_gpu_spec(gpu)
    tp = config.tensor_parallel_size
    cm, cm_desc = load_cost_model(cost_model, spec, gpu_spec, config)
    blocks = config.num_gpu_blocks or num_gpu_blocks(spec, gpu_spec, config.block_size,
                                                     config.gpu_memory_utilization, tp,
                                                     pipeline_parallel_size=config.pipeline_parallel_size)
    cpu_blocks = config.cpu_blocks(kv_block_bytes(spec, config.block_size, tp))
    max_model_len = config.max_model_len or spec.max_position_embeddings
    trace = load_trace(trace_path, request_rate=request_rate, burstiness=burstiness, seed=config.seed,
                       limit=limit, fmt=trace_format)
    check_vocabulary(trace, trace_path, spec)

    bar = None
    horizon = trace[-1].arrival_s if trace else 0.0
    if progress and not sys.stderr.isatty():  # a log file: one plain line, no half-drawn bar
        print(f"testbed simulate: simulating {len(trace)} requests over {horizon:,.1f} s of trace time",
              file=sys.stderr, flush=True)
    elif progress:  # a terminal: the bar, left in place when done, showing the end of the simulation
        from tqdm import tqdm
        bar = tqdm(total=round(horizon, 1), unit="sim-s", desc=f"0/{len(trace)} requests", file=sys.stderr, leave=True,
                   mininterval=0.5,
                   bar_format="simulating {n:.0f}/{total:.0f} sim-s |{bar}| {desc} [{elapsed}<{remaining}]")

    def report(now: float, finished: int) -> None:
        if bar is not None:
            bar.total = max(bar.total, round(now, 1))
            bar.n = round(now, 1)
            bar.set_description_str(f"{finished}/{len(trace)} requests", refresh=False)
            bar.update(0)
        if on_progress is not None:
            on_progress(now, max(horizon, now))

    t0 = time.perf_counter()
    if isinstance(cm, RecordedDPRun):  # a DP run's own timings, every decision recomputed
        result = simulate_recorded_dp(trace, config, cm, blocks, max_model_len, spec.vocab_size, cpu_blocks)
    else:
        result = simulate(trace, config, cm, blocks, max_model_len, vocab_size=spec.vocab_size, num_cpu_blocks=cpu_blocks,
                          on_progress=report if (bar is not None or on_progress is not None) else None,
                          progress_interval_s=max(1.0, (trace[-1].arrival_s if trace else 1.0) / 200))
    wall = time.perf_counter() - t0
    if bar is not None:  # the last periodic report may lie before the end: draw the end
        report(result.sim_time, len(result.records.requests))
        bar.close()
    rec = result.records
    req_cols, step_cols = rec.request_columns(), rec.step_columns()
    warn_rejections(req_cols, trace, config, blocks, max_model_len, spec.vocab_size)
    expected = expected_error(cm, spec.name, gpu_spec.name, tp) if not isinstance(cm, PipelineCostModel) else {
        "basis": "unknown: no fidelity runs with pipeline parallelism yet (benchmarks/pp.py measures them)"}
    manifest = {
        "mode": "sim", "config": config.to_dict(), "num_gpu_blocks": blocks, "num_cpu_blocks": cpu_blocks,
        "max_model_len": max_model_len,
        "trace": trace_record(trace_path, trace_format, len(trace), request_rate, burstiness, limit),
        "model": asdict(spec), "hardware": asdict(gpu_spec),
        "cost_model": cm_desc, "expected_error": expected,
        **pipeline_manifest(spec.num_hidden_layers, config.pipeline_parallel_size),
        "seed": config.seed, "wall_time_s": wall, "simulated_time_s": result.sim_time,
        "speedup": result.sim_time / wall if wall > 0 else None,
    }
    return finish_run(rec, output, manifest, slo_ttft, slo_tpot, (result.prefix_queries, result.prefix_hits),
                      {"cost_model": cm_desc, "expected_error": expected}, (req_cols, step_cols))
