"""CacheEngine: the worker's KV block moves, as vLLM's cache engine makes them before a step's forward.

It holds the CPU swap pool (one K and one V tensor per layer, pinned on a CUDA host, shaped like the device
cache) and runs a step's `blocks_to_swap_out` (device -> CPU), `blocks_to_swap_in` (CPU -> device) and
`blocks_to_copy` (device -> device, copy on write) in that order. Every copy is queued on the current stream,
so it is ordered after the previous step's kernels (which may still write the blocks being swapped out) and
before this step's: no synchronisation is needed, and the host never reads the CPU pool. Runs of consecutive
block ids on both sides move as one copy, so a request's contiguous blocks cost one copy per layer.
"""
from __future__ import annotations

from typing import Sequence

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) runs covering the (source, destination) pairs: consecutive
    ids on both sides join one run. Sorted by source; each pair is in exactly one run."""
    runs: list[tuple[int, int, int]] = []
    for s, d in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _move(src: KVCaches, dst: KVCaches, pairs: Sequence[tuple[int, int]]) -> None:
    runs = block_runs(pairs)
    non_blocking = any(t.is_cuda for t in (src[0][0], dst[0][0]))
    for (sk, sv), (dk, dv) in zip(src, dst):
        for s, d, n in runs:
            dk[d:d + n].copy_(sk[s:s + n], non_blocking=non_blocking)
            dv[d:d + n].copy_(sv[s:s + n], non_blocking=non_blocking)


class CacheEngine:
    """The CPU swap pool of one worker (one tensor-parallel rank) next to its device KV caches."""

    def __init__(self, device_caches: KVCaches, num_cpu_blocks: int) -> None:
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.device_caches = device_caches
        self.num_cpu_blocks = num_cpu_blocks
        pin = bool(device_caches) and device_caches[0][0].is_cuda
        self.cpu_caches: KVCaches = [
            tuple(torch.zeros((num_cpu_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
                  for t in layer) for layer in device_caches]  # type: ignore[misc]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (device block, CPU block) pairs to the CPU pool."""
        if pairs:
            _move(self.device_caches, self.cpu_caches, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (CPU block, device block) pairs back to the device."""
        if pairs:
            _move(self.cpu_caches, self.device_caches, pairs)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (source, destination) device blocks (copy on write). A destination is never a source of the
        same step (it was just allocated), so the order of the copies does not matter."""
        if pairs:
            _move(self.device_caches, self.device_caches, pairs)

    def run(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]],
            copy: Sequence[tuple[int, int]]) -> None:
        """One step's block moves, in the order the scheduler made them valid: out, in, copy."""
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy(copy)
