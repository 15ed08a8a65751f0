"""Multi-LoRA benchmark: the Triton kernels against the torch path, and offline throughput with 1, 4 and 16
adapters against the base model; on a CPU, the real runs notebook 08 plots beside its simulations.

    python benchmarks/lora.py kernels [--out FILE]                 # GPU: Triton shrink/expand vs torch, times
    python benchmarks/lora.py throughput --model M [--load-format dummy] [--adapters 1 4 16] [--out FILE]
    python benchmarks/lora.py throughput --model M [--load-format dummy] --lora-off  # the base, LoRA off
    python benchmarks/lora.py agree [--model M]                      # GPU: graph vs eager tokens with adapters
    python benchmarks/lora.py cpu-runs --out-dir benchmarks/results/lora/DATE_SHA_cpu   # notebook 08's real points

`kernels` checks lora_shrink/lora_expand (SGMV: blocks of one slot's tokens against that slot's matrices) on random slot mixes with base
rows, Llama-3.1-8B's projection shapes and rank 16, against kernels/lora.py's torch path, and times both (CUDA
events, median), also as one replayed CUDA graph, whose output is checked after a new slot mix is copied into its
index buffer; it exits 1 when any check fails. `throughput` makes random PEFT adapters of rank 16 on every
projection for the model's shape (in a temporary folder), then generates the same prompts (fixed lengths, greedy,
ignore_eos) with the base model, and with the prompts spread evenly over N adapters and --max-loras N: output
tokens per second of each, and each against the base. `cpu-runs` replays a Zipf-popular adapter trace on the
bundled SmolLM2 with `testbed replay` at several --max-loras, writing run directories (with the trace) that
notebook 08 reads.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

RANK = 16


def _time_ms(fn, reps: int = 50) -> float:
    import torch
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cmd_kernels(args) -> dict:
    import torch
    from testbed.kernels.lora import lora_apply_ref, lora_plan
    from testbed.kernels.lora_triton import lora_expand, lora_shrink
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"qkv (8B)": (4096, [4096, 1024, 1024]), "o (8B)": (4096, [4096]), "gate_up (8B)": (4096, [14336, 14336]),
              "down (8B)": (14336, [4096])}
    out = {}
    for name, (k, slices) in shapes.items():
        for tokens in (1, 16, 64, 256, 1024):
            slots = 8
            x = torch.randn(tokens, k, device=dev, dtype=dt, generator=g)
            a = torch.randn(slots, len(slices) * RANK, k, device=dev, dtype=dt, generator=g) * 0.05
            b = torch.randn(slots, sum(slices), RANK, device=dev, dtype=dt, generator=g) * 0.05
            idx = torch.randint(-1, slots, (tokens,), device=dev, generator=g)
            y0 = torch.randn(tokens, sum(slices), device=dev, dtype=dt, generator=g)
            want = lora_apply_ref(y0.clone(), x, a, b, lora_plan(idx), slices)
            got = y0.clone()
            lora_expand(got, lora_shrink(x, a, idx), b, idx, slices)
            err = (got.float() - want.float()).abs().max().item()
            ok = err <= 2e-2 * max(1.0, want.float().abs().max().item())
            y = y0.clone()
            triton_ms = _time_ms(lambda: lora_expand(y, lora_shrink(x, a, idx), b, idx, slices))
            plan = lora_plan(idx)
            torch_ms = _time_ms(lambda: lora_apply_ref(y, x, a, b, plan, slices))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                lora_expand(y, lora_shrink(x, a, idx), b, idx, slices)
            # the replay reads each token's slot from idx's memory (a static buffer, as the engine's graphs): a new
            # mix of slots and base rows copied into it is what the replay must compute
            idx.copy_(torch.randint(-1, slots, (tokens,), device=dev, generator=g))
            y.copy_(y0)
            graph.replay()
            want = lora_apply_ref(y0.clone(), x, a, b, lora_plan(idx), slices)
            graph_err = (y.float() - want.float()).abs().max().item()
            graph_ok = graph_err <= 2e-2 * max(1.0, want.float().abs().max().item())
            graph_ms = _time_ms(graph.replay)
            out[f"{name} T={tokens}"] = {"max_abs_error": err, "graph_max_abs_error": graph_err, "ok": ok and graph_ok,
                                         "triton_ms": triton_ms, "triton_graph_ms": graph_ms, "torch_ms": torch_ms}
            print(f"{name:14s} T={tokens:5d}  err {err:.2e} {'ok' if ok else 'FAIL'}  graph (new slots) err "
                  f"{graph_err:.2e} {'ok' if graph_ok else 'FAIL'}  triton {triton_ms:.3f} ms  graph {graph_ms:.3f} ms  "
                  f"torch {torch_ms:.3f} ms", flush=True)
    if not all(v["ok"] for v in out.values()):
        print("FAILED: the Triton kernels (eager or replayed in a graph) disagree with the torch path", file=sys.stderr)
    return out


def write_adapters(hf_config: dict, folder: Path, n: int, seed: int = 0) -> list[str]:
    """n random PEFT adapters of rank RANK on every projection for a model of this config (bf16); their folders."""
    import torch
    from testbed.profiling.lora_measure import write_random_adapter
    return [write_random_adapter(hf_config, folder / f"adapter{i}", RANK, seed + i, torch.bfloat16) for i in range(n)]


def _throughput(llm, prompts, params, loras) -> dict:
    """Output tokens per second of one timed generate call."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    return {"output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "seconds": dt}


def cmd_throughput(args) -> dict:
    from testbed import LLM, LoRARequest, SamplingParams
    from testbed.worker.loader import model_config
    prompts = [[1000 + (7 * i + j) % 20000 for j in range(args.input_len)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if args.lora_off:  # the base model in an engine without LoRA: what base rows would cost with no LoRA at all
        llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        result = {"base, LoRA off": _throughput(llm, prompts, params, None)}
        print(f"base, LoRA off {result['base, LoRA off']['output_tok_s']:10.1f} tok/s", flush=True)
        llm.shutdown()
        return result
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(model_config(args.model, args.load_format), Path(tmp), max(args.adapters))
        llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, enable_lora=True,
                  max_loras=max(args.adapters), max_lora_rank=RANK, max_cpu_loras=max(args.adapters),
                  max_num_seqs=args.max_num_seqs)
        runs = [("base", 0)] + [(f"{n} adapters", n) for n in args.adapters]
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        for name, n in runs:
            loras = None if n == 0 else [LoRARequest(f"a{i % n}", 1 + i % n, paths[i % n]) for i in range(len(prompts))]
            if n:  # warm the adapters' loads out of the timing
                llm.generate(prompts[:n], params, use_tqdm=False, lora_request=loras[:n])
            results[name] = _throughput(llm, prompts, params, loras)
        base = results["base"]["output_tok_s"]
        for name, r in results.items():
            r["vs_base"] = r["output_tok_s"] / base
            print(f"{name:12s} {r['output_tok_s']:10.1f} tok/s  {r['vs_base']:.3f}x base", flush=True)
        llm.shutdown()
    return results


def cmd_agree(args) -> dict:
    """Greedy tokens of a LoRA engine with CUDA graphs against the same engine eager: base rows and two random
    adapters mixed in one batch (the step's LoRA plan is made inside each graph from its index buffer)."""
    from testbed import LLM, LoRARequest, SamplingParams
    from testbed.worker.loader import model_config
    prompts = [[1000 + (7 * i + j) % 20000 for j in range(40 + 13 * i)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=1)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(model_config(args.model, args.load_format), Path(tmp), 2)
        loras = [None if i % 3 == 0 else LoRARequest(f"a{i % 3}", i % 3, paths[i % 3 - 1]) for i in range(len(prompts))]
        for eager in (True, False):
            llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, enable_lora=True,
                      max_loras=2, max_lora_rank=RANK, enforce_eager=eager)
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            runs[eager] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob)
                           for o in outs]
            llm.shutdown()
    pairs = list(zip(runs[True], runs[False]))
    result = {"prompts": len(prompts), "first_token_equal": sum(a[0][0] == b[0][0] for a, b in pairs),
              "tokens_equal": sum(x == y for a, b in pairs for x, y in zip(a[0], b[0])),
              "tokens": sum(len(a[0]) for a, _ in pairs),
              "max_first_logprob_diff": max(abs(a[1] - b[1]) for a, b in pairs)}
    print(f"graph vs eager with LoRA: first tokens {result['first_token_equal']}/{result['prompts']} equal, "
          f"{result['tokens_equal']}/{result['tokens']} tokens, first logprob within "
          f"{result['max_first_logprob_diff']:.4f}", flush=True)
    return result


def cmd_cpu_runs(args) -> dict:
    """Real CPU replays of a Zipf-popular adapter trace on SmolLM2 at several --max-loras (notebook 08)."""
    import random

    import torch
    torch.set_num_threads(args.threads)  # on a shared machine, OpenMP threads spinning against others cost 10x
    from testbed.cli import main
    from testbed.worker.loader import model_config
    from testbed.worker.smollm2 import default_model_dir
    from testbed.workload.trace import TraceRequest, write_jsonl
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = str(default_model_dir())
    rng = random.Random(args.seed)
    weights = [1 / (i + 1) ** args.zipf for i in range(args.num_adapters)]
    reqs, t = [], 0.0
    for i in range(args.num_requests):
        t += rng.expovariate(args.rate)
        a = rng.choices(range(args.num_adapters), weights)[0]
        reqs.append(TraceRequest(f"r{i}", t, rng.randint(32, 96), rng.randint(8, 24), lora=f"a{a}"))
    trace = out / "trace.jsonl"
    write_jsonl(reqs, trace)
    tmp = tempfile.TemporaryDirectory()  # random adapters: not worth keeping
    paths = write_adapters(model_config(model), Path(tmp.name), args.num_adapters)
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    summaries = {}
    for n in args.max_loras:
        run = out / f"max_loras_{n}"
        rc = main(["replay", str(trace), "--model", model, "--dtype", "float32", "--enable-lora", "--max-loras", str(n),
                   "--max-cpu-loras", str(args.num_adapters), "--max-lora-rank", str(RANK), "--max-num-seqs", "8",
                   "--max-num-batched-tokens", "256", "--max-model-len", "256", "--slo-ttft", str(args.slo_ttft),
                   "--slo-tpot", str(args.slo_tpot), "--lora-modules", *modules, "-o", str(run), "--format", "json"])
        summaries[n] = json.loads((run / "summary.json").read_text()) if rc == 0 else {"error": rc}
    tmp.cleanup()
    return {"trace": str(trace), "runs": {str(k): v.get("goodput") for k, v in summaries.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--out", default=None)
    t = sub.add_parser("throughput")
    t.add_argument("--model", default="Llama-3.1-8B")
    t.add_argument("--load-format", default="dummy")
    t.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    t.add_argument("--num-prompts", type=int, default=256)
    t.add_argument("--input-len", type=int, default=256)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--lora-off", action="store_true",
                   help="only the base model, in an engine started without --enable-lora (run it beside the default "
                        "command: with LoRA on, base rows should cost the same)")
    t.add_argument("--out", default=None)
    a = sub.add_parser("agree")
    a.add_argument("--model", default="Llama-3.2-1B")
    a.add_argument("--load-format", default="dummy")
    a.add_argument("--num-prompts", type=int, default=12)
    a.add_argument("--output-len", type=int, default=8)
    a.add_argument("--out", default=None)
    c = sub.add_parser("cpu-runs")
    c.add_argument("--out-dir", required=True)
    c.add_argument("--num-adapters", type=int, default=8)
    c.add_argument("--max-loras", type=int, nargs="+", default=[1, 2, 4, 8])
    c.add_argument("--num-requests", type=int, default=48)
    c.add_argument("--rate", type=float, default=4.0)
    c.add_argument("--zipf", type=float, default=1.0)
    c.add_argument("--slo-ttft", type=float, default=10.0)
    c.add_argument("--slo-tpot", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    result = {"kernels": cmd_kernels, "throughput": cmd_throughput, "agree": cmd_agree,
              "cpu-runs": cmd_cpu_runs}[args.cmd](args)
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 1 if args.cmd == "kernels" and not all(v["ok"] for v in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
