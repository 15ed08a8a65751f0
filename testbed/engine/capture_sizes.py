"""The step sizes real mode captures as CUDA graphs (vLLM's `cuda_graph_sizes`), without torch: the runner captures
them (worker/cuda_graphs.py) and the simulator prices a graphed step at the size it is padded to (sim/profiled.py).

Invariant: a step of T tokens that is not a decode-only step of a decode size runs in the mixed graph of the smallest
mixed size >= T, doing that size's linear-layer work; above the largest mixed size it runs eager, unpadded."""
from __future__ import annotations

import bisect

from testbed.engine.config import EngineConfig

MAX_DECODE_GRAPH = 512


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts captured by default: decode batches 1, 2, 4, 8, then every 16 up to max_num_seqs (at
    most 512); mixed steps every 32 tokens up to 512, then in steps of 1/8 of the power of two below
    (64 to 1024, 128 to 2048, ...), up to max_num_batched_tokens. A padded step so does at most 1/8 more
    linear-layer work than its own above 512 tokens, and small steps, whose time hardly depends on their
    token count, pay at most 31 tokens (H100, Llama-3.2-1B: a 272-token step padded to 512 took 1.40x its
    device time, to 288 about 1.1x)."""
    decode_max = min(max_num_seqs, MAX_DECODE_GRAPH)
    sizes = {b for b in (1, 2, 4, 8) if b <= decode_max} | set(range(16, decode_max + 1, 16)) | {decode_max}
    t, step = 32, 32
    while t <= max_num_batched_tokens:
        sizes.add(t)
        if t >= 512 and t & (t - 1) == 0:  # a power of two from 512 on: the step doubles
            step = t // 8
        t += step
    sizes.add(max_num_batched_tokens)
    return sorted(sizes)


def split_sizes(config: EngineConfig) -> tuple[list[int], list[int]]:
    """(decode batch sizes, mixed token sizes) to capture for this engine."""
    sizes = config.cuda_graph_sizes or default_capture_sizes(config.max_num_seqs, config.max_num_batched_tokens)
    decode = sorted({s for s in sizes if s <= min(config.max_num_seqs, MAX_DECODE_GRAPH)})
    mixed = sorted({s for s in sizes if s <= config.max_num_batched_tokens})
    return decode, mixed


def padded_tokens(sizes: list[int], tokens: int) -> int:
    """The tokens a step computes: the smallest of `sizes` (sorted ascending) >= `tokens`, the graph it replays
    (a decode graph's batch, or a mixed graph's tokens for a step with a prefill chunk), or `tokens` itself above
    the largest (an eager step)."""
    i = bisect.bisect_left(sizes, tokens)
    return sizes[i] if i < len(sizes) else tokens
