"""CUDA graphs for every step (GPU): step time eager vs graphs against the step's device time, stability, logits
agreement, and offline throughput before/after, all in one run on one machine.

  python benchmarks/graphs.py --models Llama-3.2-1B Qwen3-0.6B Llama-3.1-8B --out graphs.json

1. Step time. For each model (dummy bf16 weights) and each shape (b decode rows of 512 cached tokens plus one
   prefill chunk of c tokens after a 256-token prefix; b in --decode, c in --chunks), the runner's forward
   for that step, repeated back to back (--reps) and timed by wall clock over the whole run, eager (as
   --enforce-eager runs it) and through the step's CUDA graph (pad_into + replay), alternating eager, graph,
   eager, graph. `device_ms`: the summed kernel time of the eager step (torch.profiler), the floor both are
   measured against; `graph / device` <= 1.15 is the target for steps of <= 512 tokens. Logits of each
   sequence's last token through the graph and eagerly: max abs difference and greedy agreement.
2. Stability: 300 steps of three mixed shapes in turn, each synchronised as a serving loop is; p90/p10 per shape.
3. Offline throughput of benchmarks/e2e.py's 256-request workload on two engines of the first model side by side
   (--enforce-eager and graphs), alternating eager, graphs, eager, graphs, sync and async scheduling.
Writes JSON (--out) and prints one table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from testbed import LLM, SamplingParams
from testbed.worker.model_runner import StepInputs

CTX_DECODE, CTX_CHUNK = 512, 256


def make_step(runner, b: int, c: int, seed: int) -> StepInputs:
    """b decode rows with CTX_DECODE cached tokens and (c > 0) one chunk of c tokens after CTX_CHUNK cached ones,
    on random distinct blocks of the runner's cache (their contents are whatever is there: timing only)."""
    bs, dev = runner.block_size, runner.device
    g = torch.Generator().manual_seed(seed)
    lens = [CTX_DECODE + 1] * b + ([CTX_CHUNK + c] if c else [])
    q_lens = [1] * b + ([c] if c else [])
    need = [-(-n // bs) for n in lens]
    blocks = torch.randperm(runner.num_gpu_blocks, generator=g)[:sum(need)].tolist()
    width = max(need)
    tables, slots, positions, off = [], [], [], 0
    for n, q, k in zip(lens, q_lens, need):
        row = blocks[off:off + k]
        off += k
        tables.append(row + [0] * (width - k))
        for p in range(n - q, n):
            positions.append(p)
            slots.append(row[p // bs] * bs + p % bs)
    T = sum(q_lens)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    ids = torch.randint(1, 30000, (T,), generator=g).to(dev)
    sample = [x - 1 for x in cu[1:]]
    return StepInputs(ids, i64(positions), i64(slots), i32(tables), i32(lens), i32(cu), i64(sample), c == 0)


def forward(runner, x: StepInputs, graphs: bool) -> torch.Tensor:
    saved = runner.graphs
    runner.graphs = saved if graphs else None
    try:
        return runner.forward(x)
    finally:
        runner.graphs = saved


def wall_ms(runner, x: StepInputs, graphs: bool, reps: int) -> float:
    forward(runner, x, graphs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        forward(runner, x, graphs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def device_ms(runner, x: StepInputs) -> float:
    """Summed kernel time of one eager step (median of 3 profiled steps)."""
    from torch.autograd import DeviceType
    times = []
    for _ in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            forward(runner, x, False)
            torch.cuda.synchronize()
        total = 0.0
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        times.append(total / 1e3)
    return statistics.median(times)


def logits_agreement(runner, x: StepInputs) -> dict:
    idx = x.sample_idx
    eager = runner.model.compute_logits(forward(runner, x, False).index_select(0, idx)).float()
    graph = runner.model.compute_logits(forward(runner, x, True).index_select(0, idx)).float()
    return {"max_abs_diff": float((eager - graph).abs().max()),
            "greedy_agree": float((eager.argmax(-1) == graph.argmax(-1)).float().mean())}


@torch.inference_mode()
def bench_model(model: str, args) -> dict:
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(4096, CTX_CHUNK + max(args.chunks)),
              gpu_memory_utilization=args.gpu_memory_utilization)
    runner = llm.executor.runner
    g = runner.graphs
    out = {"model": model, "capture_s": g.capture_s, "capture_gib": g.capture_bytes / 2**30,
           "decode_sizes": g.decode_sizes, "mixed_sizes": g.mixed_sizes, "steps": []}
    print(f"{model}: {len(g.decode)} decode + {len(g.mixed)} mixed graphs in {g.capture_s:.1f} s, "
          f"{g.capture_bytes / 2**30:.2f} GiB", flush=True)
    for c in args.chunks:
        for b in args.decode:
            if b + c == 0 or b + c > args.max_num_batched_tokens:
                continue
            x = make_step(runner, b, c, seed=b * 100003 + c)
            reps = max(5, min(args.reps, int(args.reps * 512 / max(b + c, 512))))
            eager, graph = [], []
            for _ in range(2):
                eager.append(wall_ms(runner, x, False, reps))
                graph.append(wall_ms(runner, x, True, reps))
            fit = g.size_for(x)
            row = {"decode": b, "chunk": c, "tokens": b + c, "eager_ms": min(eager), "graph_ms": min(graph),
                   "device_ms": device_ms(runner, x), "graph_size": None if fit is None else fit[1],
                   "graph_kind": None if fit is None else ("decode" if fit[0] else "mixed"), **logits_agreement(runner, x)}
            row["eager_over_device"] = row["eager_ms"] / row["device_ms"]
            row["graph_over_device"] = row["graph_ms"] / row["device_ms"]
            out["steps"].append(row)
            print(f"  b={b:4d} c={c:5d}  eager {row['eager_ms']:7.3f}  graph {row['graph_ms']:7.3f}  device "
                  f"{row['device_ms']:7.3f} ms  graph/device {row['graph_over_device']:5.2f}  eager/device "
                  f"{row['eager_over_device']:5.2f}  [{row['graph_kind']} {row['graph_size']}]  logits diff "
                  f"{row['max_abs_diff']:.3g} agree {row['greedy_agree']:.3f}", flush=True)
    shapes = [(16, 64), (64, 256), (128, 512)]
    xs = [make_step(runner, b, c, seed=7 + i) for i, (b, c) in enumerate(shapes)]
    for graphs in (False, True):
        times = {s: [] for s in shapes}
        for i in range(300):
            s = i % 3
            torch.cuda.synchronize()
            t = time.perf_counter()
            forward(runner, xs[s], graphs)
            torch.cuda.synchronize()
            times[shapes[s]].append((time.perf_counter() - t) * 1e3)
        key = "stability_graph" if graphs else "stability_eager"
        out[key] = []
        for s, ts in times.items():
            q = statistics.quantiles(ts, n=10)
            out[key].append({"decode": s[0], "chunk": s[1], "p10_ms": q[0], "p50_ms": statistics.median(ts),
                             "p90_ms": q[-1], "p90_over_p10": q[-1] / q[0]})
        print(f"  {key}: " + ", ".join(f"b={r['decode']} c={r['chunk']} p50 {r['p50_ms']:.2f} ms p90/p10 "
                                        f"{r['p90_over_p10']:.3f}" for r in out[key]), flush=True)
    del llm, runner
    torch.cuda.empty_cache()
    return out


def _engine_worker(conn, model: str, enforce_eager: bool, kw: dict) -> None:
    """One engine in a process of its own (an engine's GPU memory stays until its process ends): runs the
    workload whenever asked (the message says whether under async scheduling), None ends it."""
    import os

    from e2e import bench_ours, workload
    from testbed.specs.presets import get_model_spec
    from testbed.worker.resolve import SHARED_GPU_ENV
    os.environ[SHARED_GPU_ENV] = "1"  # size the KV cache from this engine's share, as DP replicas sharing a GPU do
    llm = LLM(model, enforce_eager=enforce_eager, **kw)
    prompts, outs = workload(256, get_model_spec(model).vocab_size)
    conn.send("ready")
    while (mode := conn.recv()) is not None:
        llm.stepper.async_scheduling = mode
        conn.send(bench_ours(llm, prompts, outs))


def _wait(conn, proc, timeout: float = 300) -> None:
    """Until `conn` has a message; RuntimeError if its process died or took longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"an offline engine process {'died' if not proc.is_alive() else 'hung'} (its error is above)")


def offline_pair(model: str, args) -> dict:
    """Offline throughput, eager engine vs graph engine side by side (a process each), alternating A B A B."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    kw = dict(load_format="dummy", skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=8192,
              max_model_len=4096, gpu_memory_utilization=0.4)
    conns, procs = {}, []
    for name in ("eager", "graphs"):  # one after the other: the second sizes its cache next to the first
        here, there = ctx.Pipe()
        p = ctx.Process(target=_engine_worker, args=(there, model, name == "eager", kw), daemon=True)
        p.start()
        procs.append(p)
        conns[name] = here
        _wait(here, p)
        assert here.recv() == "ready"
    rows = []
    for mode in (False, True):
        for name in ("eager", "graphs", "eager", "graphs"):
            conns[name].send(mode)
            _wait(conns[name], procs[0 if name == "eager" else 1])
            r = conns[name].recv()
            rows.append({"engine": name, "async_scheduling": mode, **r})
            print(f"  offline {name:6s} async={mode}: {r['output_tok_s']:.0f} tok/s", flush=True)
    for c in conns.values():
        c.send(None)
    for p in procs:
        p.join(60)
    return {"model": model, "runs": rows}


def in_process(fn, *a):
    """fn(*a) in a spawned process, so its engine's GPU memory is gone before the next one starts."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(fn, *a).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["Llama-3.2-1B", "Qwen3-0.6B", "Llama-3.1-8B"])
    ap.add_argument("--decode", type=int, nargs="+", default=[0, 16, 64, 128])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 16, 64, 256, 512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "models": []}
    for i, m in enumerate(args.models):
        result["models"].append(in_process(bench_model, m, args))
        if i == 0 and not args.skip_offline:  # the first model's offline pair before the larger models
            try:
                result["offline"] = offline_pair(m, args)
            except RuntimeError as e:
                print(f"offline pair failed: {e}", flush=True)
        if args.out:
            json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
