"""What `testbed bench serve` sends: a trace replayed (synthesized token-id prompts, the trace's
arrivals or a gamma process), vLLM's `random` dataset, or a ShareGPT conversation file.

Each request carries its own `arrival_s` (seconds after the start) and `max_tokens`; prompts are
token ids except for ShareGPT (text, measured with the server's /tokenize).
Invariant: every request fits the server: input + output <= max_model_len (traces are clipped and
the count reported; ShareGPT conversations that do not fit are skipped, as vLLM does).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from testbed.workload.trace import gamma_arrivals, load_trace, synthesize_prompt

RESERVED_IDS = 100  # low ids are special tokens in many vocabularies: random prompts avoid them


@dataclass(slots=True)
class BenchRequest:
    id: str
    arrival_s: float
    prompt: list[int] | str
    input_tokens: int
    max_tokens: int


def from_trace(path: str, *, vocab_size: int, max_model_len: int, request_rate: float | None, burstiness: float,
               seed: int, limit: int | None, fmt: str = "auto") -> tuple[list[BenchRequest], int]:
    """(requests, how many were clipped to fit max_model_len)."""
    reqs, clipped = [], 0
    for r in load_trace(path, request_rate=request_rate, burstiness=burstiness, seed=seed, limit=limit, fmt=fmt):
        out = min(r.output_tokens, max_model_len - 1)
        ids = synthesize_prompt(r, vocab_size, seed, min(RESERVED_IDS, vocab_size - 1)).tolist()
        if len(ids) + out > max_model_len:
            ids = ids[:max_model_len - out]
        clipped += (out, len(ids)) != (r.output_tokens, r.input_tokens)
        reqs.append(BenchRequest(r.id, r.arrival_s, ids, len(ids), out))
    return reqs, clipped


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, *, vocab_size: int,
                   max_model_len: int, request_rate: float, burstiness: float, seed: int) -> list[BenchRequest]:
    """vLLM's `random`: lengths uniform in [len * (1 - r), len * (1 + r)], uniform random token ids."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)

    def lengths(base: int) -> np.ndarray:
        lo, hi = max(1, int(base * (1 - range_ratio))), int(base * (1 + range_ratio))
        return rng.integers(lo, hi + 1, size=n)

    ins, outs = lengths(input_len), lengths(output_len)
    if int(ins.max()) + int(outs.max()) > max_model_len:
        raise ValueError(f"random requests reach {int(ins.max()) + int(outs.max())} tokens but the server's "
                         f"max_model_len is {max_model_len}; lower --random-input-len / --random-output-len")
    low = min(RESERVED_IDS, vocab_size - 1)
    arrivals = gamma_arrivals(n, request_rate, burstiness, seed)
    return [BenchRequest(f"random-{i}", arrivals[i], rng.integers(low, vocab_size, size=int(ins[i])).tolist(),
                         int(ins[i]), int(outs[i])) for i in range(n)]


def sharegpt_dataset(path: str, n: int, *, tokenize: Callable[[str], int], max_model_len: int,
                     request_rate: float, burstiness: float, seed: int) -> list[BenchRequest]:
    """vLLM's `sharegpt`: first human turn as the prompt, the reply's token count as max_tokens;
    conversations shorter than 4 tokens either way, or longer than 1024 / 2048 total, are skipped."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e}); --dataset sharegpt wants a ShareGPT conversation file") from None
    if not isinstance(data, list):
        raise ValueError(f"{p}: expected a JSON list of {{'conversations': [...]}} entries")
    convs = [d["conversations"] for d in data
             if isinstance(d, dict) and isinstance(d.get("conversations"), list) and len(d["conversations"]) >= 2]
    random.Random(seed).shuffle(convs)
    picked: list[tuple[str, int, int]] = []
    for conv in convs:
        if len(picked) == n:
            break
        prompt, reply = conv[0].get("value"), conv[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        n_in, n_out = tokenize(prompt), tokenize(reply)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > min(2048, max_model_len):
            continue
        picked.append((prompt, n_in, n_out))
    if not picked:
        raise ValueError(f"{p}: no usable conversation (need a human turn then a reply, 4..1024 tokens)")
    arrivals = gamma_arrivals(len(picked), request_rate, burstiness, seed)
    return [BenchRequest(f"sharegpt-{i}", arrivals[i], text, n_in, n_out)
            for i, (text, n_in, n_out) in enumerate(picked)]
