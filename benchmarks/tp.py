"""Tensor-parallel benchmark (needs 2 GPUs): NCCL all-reduce cost, TP=1 vs TP=2 decode latency and throughput.

  python benchmarks/tp.py --model Llama-3.1-8B --out tp.json
1. All-reduce microbenchmark (2 ranks, bf16) over the sizes a step all-reduces (tokens x hidden):
   latency and bus bandwidth (2(n-1)/n x bytes / time), fitted as time = latency + bytes / bus_bw.
2. TP=1 and TP=2 engines (dummy bf16 weights), each eager and with CUDA graphs: median decode step at batch 1 and 64, and offline output tok/s on the 256-request
   workload of benchmarks/e2e.py (imported from it). Estimated all-reduce time per step = 2 x layers x fit(bytes).
   Each case runs in a process of its own, so its engine's weights and KV cache leave the GPUs before the next
   case profiles their free memory.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from e2e import decode_steps, workload  # benchmarks/e2e.py: the same 256-request workload
from testbed import LLM, SamplingParams
from testbed.specs.presets import get_model_spec

SIZES_TOKENS = (1, 8, 64, 256, 1024, 4096, 8192)


def _ar_worker(rank: int, port: int, hidden: int, q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for t in SIZES_TOKENS:
        x = torch.randn(t, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        n = 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        sec = start.elapsed_time(end) / 1e3 / n
        nbytes = x.numel() * 2
        rows.append({"tokens": t, "bytes": nbytes, "seconds": sec, "bus_bw": 2 * (2 - 1) / 2 * nbytes / sec})
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def allreduce_bench(hidden: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ar_worker, args=(r, port, hidden, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    b = np.array([r["bytes"] for r in rows], dtype=float)
    t = np.array([r["seconds"] for r in rows])
    slope, lat = np.polyfit(b, t, 1)  # t = lat + bytes * slope; bus bw for a ring of 2 = bytes / (bytes*slope)
    return {"rows": rows, "latency_s": float(max(lat, 0.0)), "bus_bandwidth": float(1.0 / slope)}


def decode_step_ms(llm: LLM, batch: int, out_len: int = 128, prompt_len: int = 512) -> float:
    return float(np.median(decode_steps(llm, batch, prompt_len, out_len)[0]) * 1e3)


def engine_case(model: str, tp: int, eager: bool, n_requests: int) -> dict:
    spec = get_model_spec(model)
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, enforce_eager=eager, max_num_seqs=256,
              max_num_batched_tokens=16384, max_model_len=4096, gpu_memory_utilization=0.85)
    load_s = time.perf_counter() - t0
    res = {"tp": tp, "eager": eager, "load_s": load_s, "num_gpu_blocks": llm.executor.num_gpu_blocks}
    res["decode_ms_b1"] = decode_step_ms(llm, 1)
    res["decode_ms_b64"] = decode_step_ms(llm, 64)
    prompts, outs = workload(n_requests, spec.vocab_size)
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = llm.generate(prompts, sps)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    res["throughput_output_tok_s"] = sum(len(x.outputs[0].token_ids) for x in r) / dt
    res["throughput_seconds"] = dt
    llm.shutdown()
    print(json.dumps(res), flush=True)
    return res


def _case_main(model: str, tp: int, eager: bool, n_requests: int, conn: Connection) -> None:
    conn.send(engine_case(model, tp, eager, n_requests))


def engine_case_in_process(model: str, tp: int, eager: bool, n_requests: int) -> dict:
    """`engine_case` in a fresh spawned process: the GPU memory its engine held is released when the process
    ends, so every case sees the same free memory whatever ran before it."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_case_main, args=(model, tp, eager, n_requests, send), name=f"tp-case-{tp}")
    proc.start()
    send.close()
    try:
        return recv.recv()
    except EOFError:  # the case process ended without a result
        proc.join()
        raise RuntimeError(f"the TP={tp} {'eager' if eager else 'CUDA graphs'} case failed (exit code "
                           f"{proc.exitcode}); its error is above") from None
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
            proc.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--cases", default="1g,1e,2e,2g", help="TP size + g (CUDA graphs) or e (eager), comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = get_model_spec(args.model)
    out = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "model": spec.name, "date": time.strftime("%Y-%m-%d"),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    out["allreduce"] = ar = allreduce_bench(spec.hidden_size)
    print(json.dumps({k: v for k, v in ar.items() if k != "rows"}), flush=True)
    cases = {}
    for c in args.cases.split(","):  # e.g. 1g = TP 1 with CUDA graphs, 2e = TP 2 eager
        cases[c] = engine_case_in_process(args.model, int(c[:-1]), c[-1] == "e", args.num_requests)
    out["cases"] = list(cases.values())
    per_ar = {b: ar["latency_s"] + b * spec.hidden_size * 2 / ar["bus_bandwidth"] for b in (1, 64)}
    out["allreduce_ms_per_step"] = {f"batch{b}": 2 * spec.num_hidden_layers * t * 1e3 for b, t in per_ar.items()}
    for name, (a, b) in {"graphs": ("1g", "2g"), "eager": ("1e", "2e")}.items():
        if a not in cases or b not in cases:
            continue
        e1, e2 = cases[a], cases[b]
        out[f"scaling_efficiency_throughput_{name}"] = e2["throughput_output_tok_s"] / (2 * e1["throughput_output_tok_s"])
        out[f"speedup_decode_b1_{name}"] = e1["decode_ms_b1"] / e2["decode_ms_b1"]
        out[f"speedup_decode_b64_{name}"] = e1["decode_ms_b64"] / e2["decode_ms_b64"]
    print(json.dumps({k: v for k, v in out.items() if k not in ("allreduce", "cases")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
