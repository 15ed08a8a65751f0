"""CPU real mode against transformers on the bundled SmolLM2-135M in fp32.

  python benchmarks/cpu.py [--repeats 3] [--threads N] [--skip-offline] [--skip-serve] [--out cpu.json]

1. Offline, in one process: `testbed.LLM.generate` and transformers' `generate` (the whole batch in one call,
   left-padded) on the same prompts, greedy, every request running to its token count; each round runs both,
   alternating which goes first; the median of the rounds. Timed from the prompt strings to the output
   strings (tokenization and detokenization included) for 64 prompts x 12 tokens and 1 prompt x 32 tokens.
2. Serving: `testbed serve` (fp32) with 64 concurrent streaming completions of 12 tokens from the official
   openai client against 127.0.0.1: the wall time of each round (median) and the mean time to first token.
--threads N: torch intra-op threads of both engines (and OMP_NUM_THREADS of the server); default: torch's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch

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


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo on Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("testbed serve did not come up") from None
                time.sleep(0.5)
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
    if not args.skip_offline:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder = str(default_model_dir())
        llm = LLM(folder, dtype="float32")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
        tok.pad_token = tok.pad_token or tok.eos_token
        out["offline"] = [offline(llm, hf, tok, 64, 12, args.repeats), offline(llm, hf, tok, 1, 32, args.repeats)]
        llm.shutdown()
    if not args.skip_serve:
        out["serve"] = serve(64, 12, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
