"""Pipeline-parallel benchmark (needs 2 GPUs of one host): PP=2 against TP=2 against DP=2, real and simulated.

  python benchmarks/pp.py --model Llama-3.1-8B --out pp_results/ [--rate 6 --limit 400] [--parity-only]

1. Parity: greedy tokens and logprobs of 8 prompts, each alone, at PP=2 against PP=1, both eager (dummy bf16
   weights: each parameter is seeded by its name, so both engines hold the same model); the tokens must agree and
   the logprobs be equal (the same kernels on the same shapes; only the stage boundary's copy is new).
2. Send/recv microbenchmark (2 ranks, NCCL, bf16): one stage-to-stage message of a step's activations
   ([2, tokens, hidden]) over the token counts a step has, timed and fitted as time = latency + bytes / bandwidth:
   the numbers the simulator's transfer term takes (sim/pipeline.py: p2p_latency_s, p2p_bandwidth).
3. Engine cases (dummy weights, max_model_len 4096), each in a process of its own so its GPU memory is gone
   before the next one profiles: pp2 (2 stages, eager), tp2 (2 ranks, CUDA graphs), dp2 (2 replicas, CUDA graphs).
   Per case: the decode cycle at batch 64 (512-token prompts; the time for each of the 64 requests to get a token,
   from the pure decode steps' span: under PP two microbatches overlap, so no one step holds the batch) except
   DP, and offline output tok/s on benchmarks/e2e.py's 256-request workload; with graphs against every step eager
   in the same engine, the greedy outputs of part 1's prompts.
4. Serving: `testbed replay` of the Azure conversation trace at one rate (`--rate`, `--limit` requests) for each
   layout, then `testbed simulate` of the same requests with the shipped profile (or the roofline where none
   ships), and the simulator's error on throughput and TTFT/TPOT mean and p50 (what RESULTS reports).
Everything lands under --out (results.json, the run directories, logs).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from e2e import batch_steps, workload  # benchmarks/e2e.py: the same 256-request workload and decode batch
from tp import _fit, on_two_ranks  # benchmarks/tp.py: the same fit and 2 ranks
from testbed import LLM, SamplingParams
from testbed.specs.presets import get_model_spec

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
LAYOUTS = {"pp2": ["-pp", "2"], "tp2": ["-tp", "2"], "dp2": ["-dp", "2"]}


def _p2p_worker(rank: int, port: int, hidden: int, q) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for n in TOKENS:
        buf = torch.randn(2, n, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        torch.cuda.synchronize()
        dist.barrier()
        reps = 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        end.record()
        torch.cuda.synchronize()
        if rank == 1:  # the receiver's view: until the message is there
            rows.append({"tokens": n, "bytes": buf.numel() * 2, "send_recv_us": start.elapsed_time(end) / reps * 1e3})
    if rank == 1:
        q.put(rows)
    dist.destroy_process_group()


def p2p_bench(hidden: int) -> dict:
    rows = on_two_ranks(_p2p_worker, hidden)
    return {"rows": rows, "fit": _fit(rows, "send_recv_us")}


def greedy(llm: LLM, vocab: int) -> list[dict]:
    """Greedy tokens and logprobs of 8 prompts, each generated alone: a batch of one has the same shapes at any PP
    size, so the same kernels see the same inputs (batched, bf16 sums over other rows would differ in rounding,
    and dummy weights' near-uniform logits make greedy ties fragile)."""
    res = []
    for i in range(8):
        prompt = [(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(64 + 16 * i)]
        c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
                         use_tqdm=False)[0].outputs[0]
        res.append({"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
    return res


def parity_case(model: str, pp: int) -> list[dict]:
    """PP=1 runs eager too: pipeline stages do, and a CUDA graph pads a step to its capture size."""
    llm = LLM(model, load_format="dummy", pipeline_parallel_size=pp, enforce_eager=True, max_num_seqs=64,
              max_model_len=4096, gpu_memory_utilization=0.85)
    try:
        return greedy(llm, get_model_spec(model).vocab_size)
    finally:
        llm.shutdown()


def decode_cycle_ms(llm: LLM, batch: int, prompt_len: int = 512, out_len: int = 64) -> float:
    """Time for every one of `batch` decoding requests to get one token: batch x (span of the pure decode steps,
    first end to last end) / (tokens those steps made after the first). Under PP the batch queue splits the
    requests into microbatches whose steps overlap, so no single step holds the batch; without PP this is the
    mean decode step, gaps included."""
    c = batch_steps(llm, batch, prompt_len, out_len)
    dec = c["num_prefill_tokens"] == 0
    ends = (c["start"] + c["duration"])[dec]
    tokens = c["num_decode_tokens"][dec]
    return float(batch * (ends[-1] - ends[0]) / tokens[1:].sum() * 1e3) if len(ends) > 1 else float("nan")


def graph_vs_eager(llm: LLM, vocab: int) -> dict:
    """The engine's greedy outputs of `greedy`'s prompts with its CUDA graphs, then with every step eager on every
    rank (the runner's eager_steps, which the executor passes on to each rank with the step): the first token of
    each (from the prompt's forward: the same inputs) and whole outputs (decode graphs use the split-K kernel,
    which sums in another order, so random weights' near-ties may flip a later token)."""
    graphed = greedy(llm, vocab)
    llm.executor.runner.eager_steps = True
    try:
        eager = greedy(llm, vocab)
    finally:
        llm.executor.runner.eager_steps = False
    return {"first_token_equal": [g["tokens"][0] == e["tokens"][0] for g, e in zip(graphed, eager)],
            "first_logprob_diff": max(abs(g["logprobs"][0] - e["logprobs"][0]) for g, e in zip(graphed, eager)),
            "tokens_equal": [g["tokens"] == e["tokens"] for g, e in zip(graphed, eager)]}


def engine_case(model: str, layout: str, n_requests: int) -> dict:
    kw = {"pp2": dict(pipeline_parallel_size=2), "tp2": dict(tensor_parallel_size=2),
          "dp2": dict(data_parallel_size=2)}[layout]
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
              gpu_memory_utilization=0.85, **kw)
    res = {"layout": layout, "load_s": time.perf_counter() - t0}
    try:
        if layout != "dp2":
            res["num_gpu_blocks"] = llm.executor.num_gpu_blocks
            res["decode_ms_b64"] = decode_cycle_ms(llm, 64)
            res["graph_vs_eager"] = graph_vs_eager(llm, get_model_spec(model).vocab_size)
        prompts, outs = workload(n_requests, get_model_spec(model).vocab_size)
        t = time.perf_counter()
        r = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs])
        dt = time.perf_counter() - t
        res["throughput_output_tok_s"] = sum(len(x.outputs[0].token_ids) for x in r) / dt
    finally:
        llm.shutdown()
    print(json.dumps(res), flush=True)
    return res


def _child(fn, args, conn) -> None:
    faulthandler.dump_traceback_later(590, exit=True)
    conn.send(fn(*args))


def in_child(fn, *args, timeout: float = 600):
    """fn(*args) in a fresh spawned process (its GPU memory is gone when it ends), with a wall-clock bound."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, args, send))
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise TimeoutError(f"{fn.__name__}{args} did not finish in {timeout:g} s")
        return recv.recv()
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
            proc.join()


def testbed(args: list[str], log: Path, timeout: float = 900) -> dict:
    cmd = [sys.executable, "-c", "import sys; from testbed.cli import main; sys.exit(main())", *args, "--format", "json"]
    with open(log, "w") as err:
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"exit code {out.returncode}: {' '.join(args)}\n{log.read_text()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def serving(model: str, gpu: str, rate: float, limit: int, out: Path, res: dict, on_row=lambda: None) -> dict:
    """Fills `res` (layout -> row) as each layout's runs end, calling on_row after each."""
    trace = str(ROOT / "traces" / "azure_conv_10min.jsonl")
    common = ["--request-rate", str(rate), "--limit", str(limit), "--max-model-len", "4096"]
    for layout, flags in LAYOUTS.items():
        try:
            row = serving_row(model, gpu, trace, flags, common, layout, out)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            row = {"error": str(e)[-3000:]}
        res[layout] = row
        print(layout, json.dumps(row), flush=True)
        on_row()
    return res


def serving_row(model: str, gpu: str, trace: str, flags: list[str], common: list[str], layout: str, out: Path) -> dict:
    """One layout's real replay and its simulation: the real and simulated metrics and the simulator's error."""
    real_dir, sim_dir = out / f"real-{layout}", out / f"sim-{layout}"
    real = testbed(["replay", trace, "--model", model, "--load-format", "dummy", *flags, *common,
                    "-o", str(real_dir)], out / f"real-{layout}.log")
    sim = testbed(["simulate", trace, "--model", model, "--gpu", gpu, *flags, *common, "--num-gpu-blocks",
                   str(json.loads((real_dir / "manifest.json").read_text())["num_gpu_blocks"]),
                   "--no-progress", "-o", str(sim_dir)], out / f"sim-{layout}.log")
    row = {"cost_model": sim["cost_model"]}
    for key, q in (("output_throughput", None), ("ttft_s", "mean"), ("ttft_s", "p50"), ("tpot_s", "mean"),
                   ("tpot_s", "p50")):
        r, s = (x[key] if q is None else x[key][q] for x in (real, sim))
        name = key if q is None else f"{key}_{q}"
        row[name] = {"real": r, "sim": s, "error": None if not r else (s - r) / r}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--gpu", default=None, help="the simulator's GPU preset (default: from the device name)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s of the serving runs")
    ap.add_argument("--limit", type=int, default=400, help="requests of the serving runs")
    ap.add_argument("--parity-only", action="store_true")
    ap.add_argument("--no-parity", action="store_true", help="skip part 1 (the eager parity of an earlier run stands)")
    ap.add_argument("--out", default="pp_results")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("benchmarks/pp.py needs 2 GPUs", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from testbed.specs.hardware import get_gpu_spec
    spec = get_model_spec(args.model)
    gpu = args.gpu or get_gpu_spec(torch.cuda.get_device_name().removeprefix("NVIDIA ")).name
    res: dict = {"gpu": torch.cuda.get_device_name(), "model": spec.name, "date": time.strftime("%Y-%m-%d"),
                 "torch": torch.__version__}

    def save() -> None:  # after every part, so a run cut short keeps what it measured
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")

    if not args.no_parity:
        one, two = in_child(parity_case, args.model, 1), in_child(parity_case, args.model, 2)
        res["parity"] = {"tokens_equal": [a["tokens"] == b["tokens"] for a, b in zip(one, two)],
                         "max_logprob_diff": max(float(np.max(np.abs(np.subtract(a["logprobs"], b["logprobs"]))))
                                                 for a, b in zip(one, two) if a["tokens"] == b["tokens"]) if any(
                             a["tokens"] == b["tokens"] for a, b in zip(one, two)) else None}
        print(json.dumps(res["parity"]), flush=True)
    save()
    if not args.parity_only:
        res["p2p"] = p2p_bench(spec.hidden_size)
        print(json.dumps(res["p2p"]["fit"]), flush=True)
        res["cases"] = {}
        for layout in LAYOUTS:
            try:
                res["cases"][layout] = in_child(engine_case, args.model, layout, args.num_requests)
            except (RuntimeError, TimeoutError, EOFError) as e:
                res["cases"][layout] = {"error": str(e)}
            save()
        res["serving"] = {}
        serving(args.model, gpu, args.rate, args.limit, out, res["serving"], on_row=save)
    save()
    print(f"wrote {out / 'results.json'}")
    return 0 if all(res.get("parity", {}).get("tokens_equal", [True])) else 1


if __name__ == "__main__":
    sys.exit(main())
