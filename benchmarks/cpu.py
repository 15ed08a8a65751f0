"""CPU real mode against transformers on the bundled SmolLM2-135M in fp32.

  python benchmarks/cpu.py [--repeats 3] [--threads N] [--skip-offline] [--skip-serve] [--breakdown] [--kernel]
                            [--out cpu.json]

1. Offline, in one process: `testbed.LLM.generate` and transformers' `generate` (the whole batch in one call,
   left-padded) on the same prompts, greedy, every request running to its token count; each round runs both,
   alternating which goes first; the median of the rounds. Timed from the prompt strings to the output
   strings (tokenization and detokenization included) for 64 prompts x 12 tokens and 1 prompt x 32 tokens.
2. Serving: `testbed serve` (fp32) with 64 concurrent streaming completions of 12 tokens from the official
   openai client against 127.0.0.1: the wall time of each round (median) and the mean time to first token.
3. --breakdown: where the time of 1 prompt x 32 tokens goes, `repeats` runs of each: both engines with their
   matmuls timed inside the run (testbed's linear layers, transformers' F.linear), and testbed once more with the
   bf16 kernel reading only the first 64 rows of each weight (wrong tokens, the same ops around it): what the
   other ops cost when the weights have not just streamed through the caches.
4. --kernel: the matmuls of one model step alone, at 1, 2, 4 and 8 rows: SmolLM2's 121 weight shapes (q/k/v, o,
   gate/up, down per layer; the LM head) with random bf16-valued weights, torch's float32 matmul on column-major
   weights (the CPU layout) against the bf16 kernel; the median of `repeats` x 3 passes each.
--threads N: torch intra-op threads of both engines (and OMP_NUM_THREADS of the server); default: torch's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from server_proc import free_port, wait_healthy
from testbed import LLM, SamplingParams
from testbed.worker.smollm2 import default_model_dir

SUBJECTS = ["the ocean", "a small village", "the history of Rome", "machine learning", "a cup of coffee",
            "the moon landing", "an old lighthouse", "the stock market", "a rainy afternoon", "the French language",
            "volcanoes", "a chess tournament", "the human heart", "a train journey", "honey bees", "the printing press"]
TEMPLATES = ["Write one sentence about {}.", "Here is a short story about {}: Once upon a time,",
             "Q: What is the most surprising fact about {}?\nA:",
             "The following paragraph explains {} to a ten-year-old child, using simple words and one example "
             "from everyday life, so that the idea is easy to remember:"]


def prompts(n: int) -> list[str]:
    """n prompts of 8 to 40 tokens, cycling templates x subjects (the same list for both engines)."""
    every = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    return [every[i % len(every)] for i in range(n)]


def run_testbed(llm: LLM, texts: list[str], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(texts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == tokens for o in out)
    return dt


def run_transformers(hf, tok, texts: list[str], tokens: int) -> float:
    t = time.perf_counter()
    with torch.inference_mode():
        enc = tok(texts, return_tensors="pt", padding=True)
        out = hf.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          pad_token_id=tok.pad_token_id)
        tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return time.perf_counter() - t


def offline(llm: LLM, hf, tok, n: int, tokens: int, repeats: int) -> dict:
    """Both engines `repeats` times on n prompts x tokens, alternating which goes first; medians and the ratio."""
    texts = prompts(n)
    run_testbed(llm, texts, tokens), run_transformers(hf, tok, texts, tokens)  # warm-up
    times: dict[str, list[float]] = {"testbed": [], "transformers": []}
    for r in range(repeats):
        order = ("testbed", "transformers") if r % 2 == 0 else ("transformers", "testbed")
        for name in order:
            dt = run_testbed(llm, texts, tokens) if name == "testbed" else run_transformers(hf, tok, texts, tokens)
            times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"prompts": n, "tokens": tokens, "times": times, "median_testbed_s": med["testbed"],
           "median_transformers_s": med["transformers"], "ratio": med["testbed"] / med["transformers"]}
    print(json.dumps(res), flush=True)
    return res


class _Timed:
    """Wraps `owner.name` (a function) to add its wall time to `total` while active."""

    def __init__(self, owner, name: str, limit_rows: int | None = None) -> None:
        self.owner, self.name, self.raw, self.total, self.calls = owner, name, getattr(owner, name), 0.0, 0
        self.limit_rows = limit_rows

    def __call__(self, *args, **kwargs):
        if self.limit_rows is not None:  # gemv_bf16(x, ldx, w, y, ldy, M, N, K, threads): only N's first rows
            args = (*args[:6], min(args[6], self.limit_rows), *args[7:])
        t = time.perf_counter()
        out = self.raw(*args, **kwargs)
        self.total += time.perf_counter() - t
        self.calls += 1
        return out

    def __enter__(self):
        setattr(self.owner, self.name, self)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.raw)


def breakdown(llm: LLM, hf, tok, repeats: int) -> dict:
    """1 prompt x 32 tokens: each engine's total and its matmuls' share; testbed with 64-row weights."""
    import torch.nn.functional as F

    import testbed.worker.layers as layers
    from testbed.kernels import cpu_gemv
    texts, res = prompts(1), {"testbed": [], "transformers": [], "testbed_64_rows": []}
    run_testbed(llm, texts, 32), run_transformers(hf, tok, texts, 32)  # warm-up
    for _ in range(repeats):
        with _Timed(layers, "linear") as mm:
            total = run_testbed(llm, texts, 32)
        res["testbed"].append({"total_s": total, "matmul_s": mm.total, "matmul_calls": mm.calls})
        with _Timed(F, "linear") as mm:
            total = run_transformers(hf, tok, texts, 32)
        res["transformers"].append({"total_s": total, "matmul_s": mm.total, "matmul_calls": mm.calls})
        if cpu_gemv.available():
            with _Timed(cpu_gemv._lib, "gemv_bf16", limit_rows=64) as mm:
                total = run_testbed(llm, texts, 32)
            res["testbed_64_rows"].append({"total_s": total, "kernel_s": mm.total, "kernel_calls": mm.calls})
    print(json.dumps(res), flush=True)
    return res


def kernel(repeats: int) -> dict:
    """Milliseconds of one pass over a SmolLM2 step's weights: torch float32 matmul against the bf16 kernel."""
    import torch.nn.functional as F

    from testbed.kernels import cpu_gemv
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    hidden, inter, heads, kv = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads"))
    head_dim = hidden // heads
    shapes = [((heads + 2 * kv) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
              (hidden, inter)] * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]
    weights = [torch.randn(n, k).bfloat16().float().t().contiguous().t() for n, k in shapes]  # distinct: streamed
    copies = [cpu_gemv.bf16_shadow(w) for w in weights]
    res = {}
    for rows in (1, 2, 4, 8, 16):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        passes = {"torch_float32": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                  "bf16_kernel": lambda: [cpu_gemv.gemv_bf16(xs[w.shape[1]], w) for w in copies]}
        times: dict[str, list[float]] = {k: [] for k in passes}
        for _ in range(3 * repeats):
            for name, run in passes.items():
                t = time.perf_counter()
                run()
                times[name].append(1e3 * (time.perf_counter() - t))
        res[rows] = {name: statistics.median(v) for name, v in times.items()}
    print(json.dumps({"kernel_ms": res}), flush=True)
    return res


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo on Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


async def stream_all(base_url: str, n: int, tokens: int) -> tuple[float, float]:
    """(wall seconds, mean seconds to the first token) of n concurrent streaming completions."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

    async def one(text: str, t0: float) -> float:
        first = None
        stream = await client.completions.create(model="default", prompt=text, max_tokens=tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            first = first or time.perf_counter() - t0
        return first

    t0 = time.perf_counter()
    firsts = await asyncio.gather(*(one(p, t0) for p in prompts(n)))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, statistics.mean(firsts)


def serve(n: int, tokens: int, repeats: int) -> dict:
    """`testbed serve` in a child process; one warm-up round, then `repeats` rounds of n streams."""
    port = free_port()
    cmd = [sys.executable, "-m", "testbed.cli", "serve", "--dtype", "float32", "--port", str(port),
           "--served-model-name", "default", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd)
    try:
        wait_healthy(proc, port, 300)
        base = f"http://127.0.0.1:{port}/v1"
        asyncio.run(stream_all(base, n, tokens))
        rounds = [asyncio.run(stream_all(base, n, tokens)) for _ in range(repeats)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    res = {"requests": n, "tokens": tokens, "wall_s": [w for w, _ in rounds], "mean_ttft_s": [f for _, f in rounds],
           "median_wall_s": statistics.median(w for w, _ in rounds)}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server's engine process (worker/threads.py)
    import transformers
    out = {"cpu": cpu_name(), "cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d")}
    if args.kernel:
        out["kernel_ms"] = kernel(args.repeats)
    if not args.skip_offline:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder = str(default_model_dir())
        llm = LLM(folder, dtype="float32")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
        tok.pad_token = tok.pad_token or tok.eos_token
        out["offline"] = [offline(llm, hf, tok, 64, 12, args.repeats), offline(llm, hf, tok, 1, 32, args.repeats)]
        if args.breakdown:
            out["breakdown"] = breakdown(llm, hf, tok, args.repeats)
        llm.shutdown()
    if not args.skip_serve:
        out["serve"] = serve(64, 12, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
