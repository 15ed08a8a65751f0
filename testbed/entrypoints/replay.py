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
from testbed.runs.finish import finish_run, start_run, trace_record
from testbed.workload.lora import parse_lora_modules, trace_loras
from testbed.workload.trace import load_trace, synthesize_prompt
from testbed.specs.partition import pipeline_manifest

RESERVED_TOKEN_IDS = 1000  # synthetic prompts avoid the low ids where tokenizers keep special tokens


def hardware_info(device) -> dict:
    import torch
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"name": p.name, "memory_bytes": p.total_memory, "device": "cuda", "count": torch.cuda.device_count()}
    import os
    import platform
    return {"name": platform.processor() or platform.machine(), "device": "cpu", "cpus": os.cpu_count()}


def _model_facts(llm, model: str | None, load_format: str, dtype: str, device: str | None) -> dict:
    """What the manifest says of the engine: cache, model, dtype and device (from the executor in process,
    from the replicas' Ready messages and the model's config with data parallelism)."""
    if llm.dp is None:
        ex = llm.executor
        blocks, max_len, path, hf, dt, dev = (ex.num_gpu_blocks, ex.max_model_len, ex.model_path, ex.hf_config,
                                              ex.runner.dtype, ex.device)
        cpu_blocks = llm.engine.block_manager.num_cpu_blocks
    else:
        from testbed.worker.resolve import resolve_device, resolve_dtype
        from testbed.worker.loader import model_config
        ready, path, dev = llm.dp.ready, llm.dp.model_path, resolve_device(device)
        blocks, max_len, hf = ready.num_gpu_blocks, ready.max_model_len, model_config(path, load_format)
        cpu_blocks = ready.num_cpu_blocks
        dt = resolve_dtype(dtype, dev)
    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    return {"num_gpu_blocks": blocks, "num_cpu_blocks": cpu_blocks, "max_model_len": max_len, "dtype": str(dt), "device": dev,
            "model": {"name": model or "SmolLM2-135M-Instruct", "path": path, "load_format": load_format,
                      **{k: hf.get(k) for k in keys}}}


def run_replay(trace_path: str, config: EngineConfig, *, model: str | None = None, load_format: str = "auto",
               dtype: str = "auto", device: str | None = None, request_rate: float | None = None,
               burstiness: float = 1.0, limit: int | None = None, trace_format: str = "auto",
               slo_ttft: float | None = None, slo_tpot: float | None = None,
               output: str | Path | None = None, executor=None, lora_modules: list[str] | None = None
               ) -> tuple[Path | None, dict]:
    """Replay a trace through the real engine (one replica in process, or `data_parallel_size`
    replica processes behind the DP coordinator); writes the run directory when `output` is given.
    `lora_modules`: name=path of each LoRA adapter the trace names (its `lora` field).
    `executor`: reuse one built earlier (several replays on one loaded model; see `LLM`); it is left open."""
    import gc

    from testbed.entrypoints.llm import LLM
    start_run(output, slo_ttft, slo_tpot)
    trace = load_trace(trace_path, request_rate=request_rate, burstiness=burstiness, seed=config.seed,
                       limit=limit, fmt=trace_format)
    paths = {name: path for name, path, _ in parse_lora_modules(lora_modules)}
    loras = trace_loras([tr.lora for tr in trace], config, paths)
    structured = any(tr.structured_output for tr in trace)  # grammars are compiled against the tokenizer
    llm = LLM(model, load_format=load_format, dtype=dtype, device=device, skip_tokenizer_init=not structured,
              executor=executor, **config.to_dict())
    gc.collect()
    gc.freeze()  # the model and the trace stay alive: keep full collections from pausing steps mid-replay
    try:
        facts = _model_facts(llm, model, load_format, dtype, device)
        vocab = llm.vocab_size
        reserved = min(RESERVED_TOKEN_IDS, vocab // 10)
        prompts = [synthesize_prompt(tr, vocab, config.seed, reserved=reserved) for tr in trace]
        llm.reset_clock()
        wall0 = time.perf_counter()
        i = 0
        while i < len(trace) or llm.has_unfinished_requests():
            now = llm.now()
            while i < len(trace) and trace[i].arrival_s <= now:
                tr = trace[i]
                llm.add_request(tr.id, prompts[i], tr.beam_params() or tr.sampling_params(), arrival_time=tr.arrival_s,
                                priority=tr.priority, lora_request=None if tr.lora is None else loras[tr.lora])
                i += 1
            if llm.has_unfinished_requests():
                # in process: scheduled at the admission time, what `--cost-model recorded:` replays;
                # data parallel: the replicas step on their own, this collects outputs until the next arrival
                llm.step(now, timeout=max(0.0, trace[i].arrival_s - llm.now()) if i < len(trace) else None)
            elif i < len(trace):
                time.sleep(max(0.0, trace[i].arrival_s - llm.now()))
        wall = time.perf_counter() - wall0
        if llm.dp is None:
            bm = llm.engine.block_manager
            prefix = (bm.prefix_queries, bm.prefix_hits)
        else:  # the replicas' cumulative counters, as their last outputs reported them
            stats = llm.dp.client.engine_stats.values()
            prefix = (sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats))
    finally:
        gc.unfreeze()
        if executor is None:
            llm.shutdown()  # TP: end the worker processes and the process group; DP: the coordinator and replicas
    manifest = {
        "mode": "real", "config": config.to_dict(), "num_gpu_blocks": facts["num_gpu_blocks"],
        "num_cpu_blocks": facts["num_cpu_blocks"],
        "max_model_len": facts["max_model_len"],
        "trace": trace_record(trace_path, trace_format, len(trace), request_rate, burstiness, limit),
        "model": facts["model"], "hardware": hardware_info(facts["device"]), "dtype": facts["dtype"],
        "seed": config.seed, "wall_time_s": wall,
        **pipeline_manifest(int(facts["model"]["num_hidden_layers"] or 0), config.pipeline_parallel_size),
    }
    return finish_run(llm.records(), output, manifest, slo_ttft, slo_tpot, prefix)
