"""The cost of structured outputs in the sampler: grammar compile time, and per step the host and device
time a row under a grammar adds (matcher advance, bitmask fill, copy, unpack, mask) over the fast path.

Each step masks random logits [batch, vocab] for `batch` requests that all carry the same JSON schema,
takes the argmax of the masked rows as the next tokens (so every matcher follows a valid JSON path to its
end) and times LogitsProcessors.apply against the same step without grammars (per row: host and device
together), and the host part alone (matcher advance and bitmask fill, per row). On a GPU the host part is
what a step waits for; it is `GRAMMAR_ROW_S` in testbed/sim/cost_model.py, charged per structured row per step.

    python benchmarks/grammar.py                       # CPU, the bundled SmolLM2's tokenizer
    python benchmarks/grammar.py --device cuda --model /path/to/Llama-3.1-8B-Instruct
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
from testbed.engine.params import SamplingParams, StructuredOutputsParams
from testbed.worker.logits_processors import LogitsProcessors, RowContext

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(tokenizer, vocab: int, batch: int, steps: int, device: torch.device) -> dict[str, float]:
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, structured_outputs=so)] * batch
    ids = [f"r{i}" for i in range(batch)]
    procs = LogitsProcessors(lambda: tokenizer)
    eos = tokenizer.eos_token_id
    outputs: list[list[int]] = [[] for _ in range(batch)]
    t0 = time.perf_counter()
    procs.grammars.bitmask(["warm"], params[:1], [[]], [eos], vocab)  # tokenizer info + compile, first time
    first_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    procs.grammars.bitmask(["warm2"], params[:1], [[]], [eos], vocab)  # cached compile
    cached_compile = time.perf_counter() - t0
    g = torch.Generator(device=device).manual_seed(0)
    masked, plain, fill = [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=g, device=device)
        ctx = [RowContext((), out, len(out), eos) for out in outputs]
        shadow = [f"s{i}" for i in range(batch)]  # matchers in step with the real ones, for the host-only time
        t0 = time.perf_counter()
        procs.grammars.bitmask(shadow, params, outputs, [eos] * batch, vocab)
        fill.append(time.perf_counter() - t0)
        _sync(device)
        t0 = time.perf_counter()
        x = procs.apply(logits.clone(), params, ids, ctx)
        _sync(device)
        masked.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        logits.clone()
        _sync(device)
        plain.append(time.perf_counter() - t0)
        for out, tok in zip(outputs, x.argmax(dim=-1).tolist()):
            out.append(tok)
    extra = statistics.median(masked) - statistics.median(plain)
    return {"first_compile_s": first_compile, "cached_compile_s": cached_compile, "step_extra_s": extra,
            "per_row_s": extra / batch, "host_fill_per_row_s": statistics.median(fill) / batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder whose tokenizer to use (default: bundled SmolLM2)")
    ap.add_argument("--vocab", type=int, default=None, help="logits width (default: the tokenizer's, padded to 64)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the sampler's host side "
                                                            "runs on one core; more only adds barrier waits)")
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from testbed.worker.loader import load_tokenizer
    if args.model is None:
        from testbed.worker.smollm2 import default_model_dir
        args.model = str(default_model_dir())
    tok = load_tokenizer(args.model)
    vocab = args.vocab or -(-len(tok) // 64) * 64
    device = torch.device(args.device)
    rows = []
    print(f"model {args.model}  vocab {vocab}  device {device}")
    print(f"{'batch':>6} {'first compile ms':>17} {'cached compile ms':>18} {'step extra ms':>14} {'per row us':>11} "
          f"{'host fill per row us':>21}")
    for b in (int(x) for x in args.batch.split(",")):
        r = measure(tok, vocab, b, args.steps, device)
        rows.append({"batch": b, **r})
        print(f"{b:>6} {r['first_compile_s'] * 1e3:>17.2f} {r['cached_compile_s'] * 1e3:>18.3f} "
              f"{r['step_extra_s'] * 1e3:>14.3f} {r['per_row_s'] * 1e6:>11.1f} {r['host_fill_per_row_s'] * 1e6:>21.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "vocab": vocab, "device": str(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
