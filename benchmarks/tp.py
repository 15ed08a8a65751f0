"""Tensor-parallel benchmark (needs 2 GPUs): the all-reduce, and TP=1 against TP=2 with CUDA graphs on every rank.

  python benchmarks/tp.py --model Llama-3.1-8B --out tp.json [--cases 1g,2g,2e] [--rounds 2]
1. All-reduce microbenchmark (2 ranks, bf16) over the sizes a step all-reduces (tokens x hidden): NCCL eager,
   the symmetric-memory one-shot and two-shot all-reduces of worker/tp_all_reduce.py replayed inside a CUDA
   graph; each checked against the sum (and a chain of 20 dependent all-reduces in one graph against NCCL's),
   timed over replays and fitted as time = latency + bytes / bw.
   Up to FUSED_MAX_ROWS tokens also the all-reduce fused with the residual add and RMSNorm after it, against the
   two apart, each in a graph (20 dependent calls).
2. Engine cases (dummy bf16 weights, max_model_len 4096), each in a process of its own so its GPU memory is
   gone before the next case profiles: TP size + g (CUDA graphs) or e (eager), + a for async scheduling, + u for
   the all-reduce apart from the norm (TESTBED_TP_FUSED_NORM=0); `--rounds N` runs the list N times, alternating,
   and compares medians. Per case: median decode step at
   batch 1, 64 and 256 (512-token prompts); median mixed step of one 512-token chunk beside 32 decodes; offline
   output tok/s on the 256-request workload of benchmarks/e2e.py; greedy tokens and logprobs of 8 prompts, so
   graph and eager (and TP=1 and TP=2) outputs are compared.
Every case has a wall-clock bound (--case-timeout); a case that passes it is killed and reported, the rest run.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import sys
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
MIXED_DECODES, MIXED_CHUNK = 32, 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_ms(fn, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _ar_worker(rank: int, port: int, hidden: int, q) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from testbed.worker import tp_all_reduce as tar
    symm = tar.init_tp_all_reduce(max(SIZES_TOKENS), hidden, torch.bfloat16, torch.device("cuda", rank))
    rows = []

    def inputs(t: int, r: int) -> torch.Tensor:
        return torch.randn(t, hidden, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(r))

    for t in SIZES_TOKENS:
        x = inputs(t, rank)
        want = sum(inputs(t, r).float() for r in range(2))
        row = {"tokens": t, "bytes": x.numel() * 2}
        y = x.clone()
        dist.all_reduce(y)
        row["nccl_max_err"] = float((y.float() - want).abs().max())
        row["nccl_eager_us"] = _time_ms(lambda: dist.all_reduce(y), 50) * 1e3
        for name in ("one_shot", "two_shot") if symm else ():
            fn = getattr(tar._symmetric, name)
            row[f"{name}_max_err"] = float((fn(x).float() - want).abs().max())
            # a chain in a graph: each message depends on the last, so a region rewritten too early shows
            chain, ref = x.clone(), x.clone()
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                c = chain
                for i in range(20):
                    c = fn(c, first=(i == 0)) * 0.5
                chain_out = c
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            for i in range(20):
                dist.all_reduce(ref)
                ref = ref * 0.5
            row[f"{name}_graph_chain_max_err"] = float((chain_out.float() - ref.float()).abs().max())
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2, capture_error_mode="thread_local"):
                for i in range(20):
                    fn(x, first=(i == 0))
            g2.replay()
            row[f"{name}_graph_us"] = _time_ms(g2.replay, 10) * 1e3 / 20
        if tar.fused_for(x) is not None:
            row.update(_fused_rows(tar, x, inputs, t, hidden))
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        q.put({"symmetric_memory": symm, "one_shot_max_bytes": tar.ONE_SHOT_MAX_BYTES, "rows": rows})
    tar.close_tp_all_reduce()
    dist.destroy_process_group()


def _fused_rows(tar, x: torch.Tensor, inputs, t: int, hidden: int) -> dict:
    """The fused all-reduce + residual add + RMSNorm (tp_all_reduce.FusedAllReduceNorm) on x: its error against
    NCCL's sum followed by layers.add_rms_norm, a chain of 20 dependent calls in one graph against the same chain
    unfused, and the time of a call in a graph against the unfused pair (the symmetric all-reduce, then the
    compiled add + norm) in a graph."""
    from testbed.worker.layers import add_rms_norm
    eps = 1e-5
    res = inputs(t, 7)
    w = 1 + 0.1 * inputs(1, 9).view(-1)[:hidden]
    ref = x.clone()
    dist.all_reduce(ref)
    want = add_rms_norm(ref, res, w, eps)
    tar.begin_forward()
    got = tar.fused_for(x)(x, res, w, eps)
    row = {"fused_max_err": max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, want))}

    def chain(fused: bool):
        h, r = x, res
        for i in range(20):
            if fused:
                h, r = tar.fused_for(h)(h, r, w, eps)
            else:
                h, r = add_rms_norm(tar.all_reduce(h, first=(i == 0)), r, w, eps)
            h = h * 0.5
        return h, r

    graphs, outs = {}, {}
    for fused in (True, False):
        tar.begin_forward()
        chain(fused)  # warm-up: torch.compile's kernel, Triton's
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        dist.barrier()
        tar.begin_forward()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            outs[fused] = chain(fused)
        graphs[fused] = g
    for fused in (True, False):
        graphs[fused].replay()
    torch.cuda.synchronize()
    # the chain's residual grows to ~100x its inputs; the two round at different places (the compiled pair
    # keeps x + residual in fp32 inside its kernel), so their difference is a few units in the last place of it
    row["fused_graph_chain_max_rel_err"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                               for a, b in zip(outs[True], outs[False]))
    for fused, key in ((True, "fused_graph_us"), (False, "unfused_graph_us")):
        dist.barrier()
        row[key] = _time_ms(graphs[fused].replay, 10) * 1e3 / 20
    return row


def _fit(rows: list[dict], key: str) -> dict:
    b = np.array([r["bytes"] for r in rows], dtype=float)
    t = np.array([r[key] for r in rows]) * 1e-6
    slope, lat = np.polyfit(b, t, 1)  # t = latency + bytes * slope
    return {"latency_s": float(max(lat, 0.0)), "bandwidth": float(1.0 / slope)}


def on_two_ranks(worker, *args):
    """What `worker(rank, port, *args, queue)` puts on the queue, run on 2 spawned ranks (one GPU each)."""
    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def allreduce_bench(hidden: int) -> dict:
    res = on_two_ranks(_ar_worker, hidden)
    for key in ("nccl_eager_us", "one_shot_graph_us", "two_shot_graph_us"):
        if all(key in r for r in res["rows"]):
            res[f"fit_{key.removesuffix('_us')}"] = _fit(res["rows"], key)
    return res


def decode_step_ms(llm: LLM, batch: int, out_len: int = 64, prompt_len: int = 512) -> float:
    return float(np.median(decode_steps(llm, batch, prompt_len, out_len)[0]) * 1e3)


def mixed_step_ms(llm: LLM, reps: int = 20) -> float:
    """Median step of one 512-token prefill chunk beside 32 requests in decode."""
    steps = llm.engine.records
    for i in range(MIXED_DECODES):
        llm.add_request(f"dec{i}", [1000 + (i * 13 + j) % 20000 for j in range(128)],
                        SamplingParams(temperature=0, max_tokens=4 * reps + 64, ignore_eos=True))
    for _ in range(8):  # the decodes' prompts are prefilled
        llm.step()
    times = []
    for r in range(reps):
        llm.add_request(f"chunk{r}", [2000 + (r * 31 + j) % 20000 for j in range(MIXED_CHUNK)],
                        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        start = len(steps.steps)
        llm.step()
        llm.step()  # under async scheduling the chunk's step is recorded when the next one is scheduled
        cols = steps.step_columns()
        sel = slice(start, None)
        # async scheduling: the step may also hold the last chunk request's final (discarded) token
        hit = (cols["num_prefill_tokens"][sel] == MIXED_CHUNK) & (cols["num_reqs"][sel] >= MIXED_DECODES + 1)
        times.extend(cols["duration"][sel][hit].tolist())
    for i in range(MIXED_DECODES):
        llm.abort_request(f"dec{i}")
    while llm.has_unfinished_requests():
        llm.step()
    return float(np.median(times) * 1e3) if times else float("nan")


def greedy_outputs(llm: LLM, vocab: int) -> list[dict]:
    """Greedy tokens of 8 prompts with their logprobs, and the top 5 logprobs of each first token."""
    prompts = [[(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(64 + 16 * i)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append({"tokens": list(c.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    "first_top5": {str(t): v.logprob for t, v in c.logprobs[0].items()}})
    return res


def kernel_breakdown(llm: LLM, batch: int = 64, steps: int = 20, prompt_len: int = 512) -> dict:
    """Where a decode step of `batch` requests spends its time on rank 0: the device time of each kernel over
    `steps` pure decode steps (torch.profiler over CUPTI, which lists the kernels a CUDA graph replays too)
    against the steps' wall time. A step whose kernels add up to much less than its wall time waits on the host
    or on its peers; the largest kernels say what the device spends the rest on."""
    from torch.profiler import ProfilerActivity, profile
    for i in range(batch):
        llm.add_request(f"kb{i}", [1000 + (i * 7 + j) % 20000 for j in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True))
    recs = llm.engine.records
    while True:  # until every prompt is prefilled and the steps are pure decodes of the whole batch
        start = len(recs.steps)
        llm.step()
        c = recs.step_columns()
        if len(c["num_reqs"]) > start and c["num_prefill_tokens"][-1] == 0 and c["num_reqs"][-1] == batch:
            break
    start = len(recs.steps)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
        sync()
    c = recs.step_columns()
    ends = c["start"][start:] + c["duration"][start:]
    n = len(ends)
    for i in range(batch):
        llm.abort_request(f"kb{i}")
    while llm.has_unfinished_requests():
        llm.step()
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = getattr(e, "self_cuda_time_total", 0.0) if t is None else t
        if t > 0:
            kernels.append((t / 1e3 / max(n, 1), e.count / max(n, 1), e.key[:100]))
    kernels.sort(reverse=True)
    return {"steps": n, "step_ms": float((ends[-1] - c["start"][start]) / n * 1e3) if n else None,
            "device_busy_ms": sum(k[0] for k in kernels),
            "top": [{"ms_per_step": k[0], "calls_per_step": k[1], "kernel": k[2]} for k in kernels[:20]]}


def engine_case(model: str, case: str, n_requests: int, max_num_batched_tokens: int, breakdown: bool = False) -> dict:
    """One engine: `case` is the TP size, then g (CUDA graphs) or e (eager), then a for async scheduling, u
    for the all-reduce unfused from the norm after it, n for no L2 prefetch of the next GEMM's weight beside the
    fused all-reduce (l: the prefetch's "load" way instead of "bulk"; j: joined after each call), p for cuBLAS
    row-parallel GEMMs whose rows the fused call pushes (not the GEMM's own tiles); `breakdown`:
    also the kernel breakdown of a decode step at batch 64."""
    spec = get_model_spec(model)
    tp, eager, async_ = int(case[0]), case[1] == "e", "a" in case[2:]
    if "u" in case[2:]:  # the all-reduce and the norm after it as two kernels (set before the TP workers start)
        os.environ["TESTBED_TP_FUSED_NORM"] = "0"
    if "n" in case[2:] or "l" in case[2:]:  # no L2 prefetch beside the fused all-reduce, or the "load" way
        os.environ["TESTBED_TP_PREFETCH"] = "off" if "n" in case[2:] else "load"
    if "j" in case[2:]:  # each fused call's stream waits for its prefetch (not only the forward's end)
        os.environ["TESTBED_TP_PREFETCH_JOIN"] = "call"
    if "p" in case[2:]:  # cuBLAS for the row-parallel GEMMs, the fused call pushes (not the GEMM's own tiles)
        os.environ["TESTBED_TP_GEMM_PUSH"] = "0"
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, enforce_eager=eager, max_num_seqs=256,
              max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096, gpu_memory_utilization=0.85,
              async_scheduling=async_)
    res = {"case": case, "tp": tp, "eager": eager, "async_scheduling": async_, "load_s": time.perf_counter() - t0,
           "num_gpu_blocks": llm.executor.num_gpu_blocks}
    graphs = llm.executor.runner.graphs
    if graphs is not None:
        res["capture_s"], res["capture_gib"] = graphs.capture_s, graphs.capture_bytes / 2**30
        res["graphs"] = len(graphs.decode) + len(graphs.mixed)
    print(json.dumps(res), flush=True)
    res["greedy"] = greedy_outputs(llm, spec.vocab_size)
    for b in (1, 64, 256):
        res[f"decode_ms_b{b}"] = decode_step_ms(llm, b)
    res["mixed_512_ms"] = mixed_step_ms(llm)
    if breakdown:
        try:
            res["kernels_b64"] = kernel_breakdown(llm)
        except Exception as e:  # a diagnostic: the case's other numbers stand without it
            res["kernels_b64"] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res["kernels_b64"]), flush=True)
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
    print(json.dumps({k: v for k, v in res.items() if k != "greedy"}), flush=True)
    return res


def _case_main(args: tuple, conn: Connection) -> None:
    faulthandler.dump_traceback_later(args[-1] - 5, exit=True)  # a stuck case shows where it is stuck
    conn.send(engine_case(*args[:-1]))


def engine_case_in_process(model: str, case: str, n_requests: int, mnbt: int, timeout: float,
                           breakdown: bool = False) -> dict:
    """`engine_case` in a fresh spawned process with a wall-clock bound: the GPU memory its engine held is
    released when the process ends, so every case sees the same free memory whatever ran before it."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_case_main, args=((model, case, n_requests, mnbt, breakdown, timeout), send),
                       name=f"tp-case-{case}")
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise TimeoutError(f"case {case} did not finish in {timeout:g} s")
        return recv.recv()
    except EOFError:  # the case process ended without a result
        proc.join()
        raise RuntimeError(f"case {case} failed (exit code {proc.exitcode}); its error is above") from None
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
            proc.join()
        for child in mp.active_children():  # a killed case's TP workers
            child.kill()


def agreement(a: dict, b: dict) -> dict:
    """How far two cases' greedy outputs on the same prompts are apart: the first token (computed from the same
    prompt by both: the logits' difference) and, over whole outputs, matching tokens up to the first
    difference (a near-tie flips greedy decoding on random weights) with their largest logprob difference."""
    first = [x["tokens"][0] == y["tokens"][0] for x, y in zip(a["greedy"], b["greedy"])]
    top = [abs(x["first_top5"][t] - y["first_top5"][t]) for x, y in zip(a["greedy"], b["greedy"])
           for t in x["first_top5"] if t in y["first_top5"]]
    same, total, diff = 0, 0, 0.0
    for x, y in zip(a["greedy"], b["greedy"]):
        total += len(x["tokens"])
        for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])):
            if s != t:
                break
            same += 1
            diff = max(diff, abs(x["logprobs"][i] - y["logprobs"][i]))
    return {"first_token_match": sum(first) / len(first), "first_top5_max_logprob_diff": max(top, default=None),
            "prefix_token_match": same / max(total, 1), "max_logprob_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--cases", default="1g,2g,1ga,2ga,2e",
                    help="TP size + g (CUDA graphs) or e (eager) [+ a: async scheduling] [+ u: the all-reduce and "
                         "the norm after it apart] [+ n: no L2 prefetch beside the fused all-reduce; l: its load "
                         "way; j: joined after each call], comma-separated")
    ap.add_argument("--case-timeout", type=float, default=240)
    ap.add_argument("--rounds", type=int, default=1, help="run the cases this many times, alternating; each "
                                                             "ratio then compares medians over the rounds")
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="each case: the kernels of a decode step at batch 64 "
                                                             "(device time per kernel against the step's wall time)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = get_model_spec(args.model)
    out = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "model": spec.name, "date": time.strftime("%Y-%m-%d"),
           "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                  "TESTBED_TP_ALL_REDUCE", "TESTBED_TP_PREFETCH", "TESTBED_TP_GEMM_PUSH",
                                                  "TESTBED_TP_PREFETCH_MB")}}
    if not args.skip_allreduce:
        out["allreduce"] = ar = allreduce_bench(spec.hidden_size)
        print(json.dumps(ar), flush=True)
    cases, rounds = {}, {}
    for r in range(args.rounds):  # A B A B: round 2's cases are keyed case@2
        for c in args.cases.split(","):
            key = c if r == 0 else f"{c}@{r + 1}"
            try:
                cases[key] = engine_case_in_process(args.model, c, args.num_requests, args.max_num_batched_tokens,
                                                    args.case_timeout, args.breakdown)
                rounds.setdefault(c, []).append(cases[key])
            except (RuntimeError, TimeoutError) as e:
                print(f"case {key}: {e}", file=sys.stderr, flush=True)
                cases[key] = {"error": str(e)}
    out["cases"] = cases
    ok = {c: {k: float(np.median([x[k] for x in runs])) if k.endswith(("_ms", "_tok_s")) or "_ms_b" in k else v
              for k, v in runs[0].items()} for c, runs in rounds.items()}  # each number the median over rounds
    pairs = [("1g", "2g"), ("1ga", "2ga"), ("2gau", "2ga"), ("1ga", "2gau"), ("1ga", "2gan"), ("2gan", "2ga"),
             ("1ga", "2gal"), ("2gan", "2gal"), ("2gaj", "2ga"), ("2gan", "2gaj"), ("1ga", "2gap"),
             ("2gap", "2ga")]  # (A, B): B / A
    for a, b in pairs:  # TP=2 over TP=1 (dummy weights differ between them: no agreement)
        if a in ok and b in ok:
            one, two = ok[a], ok[b]
            r = {f"decode_b{n}": two[f"decode_ms_b{n}"] / one[f"decode_ms_b{n}"] for n in (1, 64, 256)}
            r["mixed_512"] = two["mixed_512_ms"] / one["mixed_512_ms"]
            r["throughput"] = two["throughput_output_tok_s"] / one["throughput_output_tok_s"]
            out[f"{b}_over_{a}"] = r
    for a, b in (("2g", "2e"), ("2ga", "2e"), ("2ga", "2gau"), ("2ga", "2gan"), ("2gal", "2gan"), ("2ga", "2gaj"),
                 ("2ga", "2gap")):
        if a in ok and b in ok:
            out[f"agreement_{a}_{b}"] = agreement(ok[a], ok[b])
    print(json.dumps({k: v for k, v in out.items() if k not in ("allreduce", "cases")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
