"""`testbed replay`: drive the real engine in-process with a trace's arrival times.

Prompts are synthesised to the trace's input lengths (shared prefixes rebuilt from hash_ids),
outputs forced to the trace's lengths (max_tokens + ignore_eos), so the same trace gives the same
work in sim and real mode. Writes the run directory of DESIGN.md with mode = real and the
measured step durations.
"""
from __future__ import annotations

import time
from pathlib import Path

from testbed.engine.config import EngineConfig
from testbed.engine.metrics import check_slos, summarize
from testbed.engine.request import SamplingParams
from testbed.rundir import check_output, environment_info, write_run
from testbed.sim.trace import load_trace, synthesize_prompt

RESERVED_TOKEN_IDS = 1000  # synthetic prompts avoid the low ids where tokenizers keep special tokens


def hardware_info(device) -> dict:
    import torch
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"name": p.name, "memory_bytes": p.total_memory, "device": "cuda", "count": torch.cuda.device_count()}
    import os
    import platform
    return {"name": platform.processor() or platform.machine(), "device": "cpu", "cpus": os.cpu_count()}


def run_replay(trace_path: str, config: EngineConfig, *, model: str | None = None, load_format: str = "auto",
               dtype: str = "auto", device: str | None = None, request_rate: float | None = None,
               burstiness: float = 1.0, limit: int | None = None, trace_format: str = "auto",
               slo_ttft: float | None = None, slo_tpot: float | None = None,
               output: str | Path | None = None, executor=None) -> tuple[Path | None, dict]:
    """`executor`: reuse one built earlier (several replays on one loaded model; see `LLM`); it is left open."""
    import gc

    from testbed.llm import LLM
    check_slos(slo_ttft, slo_tpot)
    if output is not None:
        check_output(output)
    trace = load_trace(trace_path, request_rate=request_rate, burstiness=burstiness, seed=config.seed,
                       limit=limit, fmt=trace_format)
    llm = LLM(model, load_format=load_format, dtype=dtype, device=device, skip_tokenizer_init=True,
              executor=executor, **config.to_dict())
    gc.collect()
    gc.freeze()  # the model and the trace stay alive: keep full collections from pausing steps mid-replay
    try:
        vocab = llm.executor.vocab_size
        reserved = min(RESERVED_TOKEN_IDS, vocab // 10)
        prompts = [synthesize_prompt(tr, vocab, config.seed, reserved=reserved) for tr in trace]
        llm.reset_clock()
        wall0 = time.perf_counter()
        i = 0
        while i < len(trace) or llm.has_unfinished_requests():
            now = llm.now()
            while i < len(trace) and trace[i].arrival_s <= now:
                tr = trace[i]
                sp = SamplingParams(max_tokens=tr.output_tokens, ignore_eos=True, temperature=0.0)
                llm.add_request(tr.id, prompts[i], sp, arrival_time=tr.arrival_s, priority=tr.priority)
                i += 1
            if llm.has_unfinished_requests():
                llm.step(now)  # scheduled at the admission time: what `--cost-model recorded:` replays
            elif i < len(trace):
                time.sleep(max(0.0, trace[i].arrival_s - llm.now()))
        wall = time.perf_counter() - wall0
        rec = llm.engine.records
        bm = llm.engine.block_manager
        summary = summarize(rec.request_columns(), rec.step_columns(), rec.itl, slo_ttft, slo_tpot,
                            bm.prefix_queries, bm.prefix_hits)
        run_dir = None
        if output is not None:
            ex = llm.executor
            manifest = {
                "mode": "real", "config": config.to_dict(), "num_gpu_blocks": ex.num_gpu_blocks,
                "max_model_len": ex.max_model_len,
                "trace": {"path": str(trace_path), "format": trace_format, "num_requests": len(trace),
                          "request_rate": request_rate, "burstiness": burstiness, "limit": limit},
                "model": {"name": model or "SmolLM2-135M-Instruct", "path": ex.model_path, "load_format": load_format,
                          **{k: ex.hf_config.get(k) for k in (
                              "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "vocab_size")}},
                "hardware": hardware_info(ex.device), "dtype": str(ex.runner.dtype), "seed": config.seed,
                "wall_time_s": wall, **environment_info(),
            }
            run_dir = write_run(output, manifest, rec, summary)
    finally:
        gc.unfreeze()
        if executor is None:
            llm.executor.shutdown()  # TP: end the worker processes and the process group
    return run_dir, summary
