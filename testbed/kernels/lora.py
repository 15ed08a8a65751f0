"""Multi-LoRA over a mixed batch (Punica / S-LoRA): y += (x A_s^T) B_s^T for each token's adapter slot s.

Every LoRA-enabled linear layer holds its adapters in preallocated slot tensors (worker/lora.py):
  lora_a [slots, n * R, in]   the A matrices of its n output slices (q, k, v or gate, up, or one), stacked
                              along the rank dim, each zero-padded to R = max_lora_rank rows;
  lora_b [slots, out, R]      the B matrices' rows (scaling folded in), slice i's rows read rank columns
                              [i * R, (i + 1) * R) of the shrink output.
`lora_idx` [T] gives each token's slot, -1 for the base model: base rows add nothing and cost nothing.

Two paths, one semantics:
- `lora_apply_ref` (torch; the CPU path and the tests' ground truth): one gather, shrink and expand per slot
  present in the step (at most max_loras), never a loop over requests; its `LoRAPlan` (the token rows of each
  slot) is built once per step and shared by every layer.
- `lora_shrink` / `lora_expand` (Triton, SGMV form: the step's tokens sorted by slot on the device, blocks of
  one slot's tokens against that slot's matrices) read the slot of every token from `lora_idx` on the device,
  so they run unchanged inside a CUDA graph whose static index buffer a step refills (worker/cuda_graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from testbed.kernels import use_triton

if TYPE_CHECKING:  # the Triton module is imported only where its kernels run
    from testbed.kernels.lora_triton import LoRASegments


@dataclass
class LoRAPlan:
    """The token rows of each adapter slot in one step (torch path): [(slot, rows [n] long)], slots ascending."""

    groups: list[tuple[int, torch.Tensor]]


def lora_plan(lora_idx: torch.Tensor) -> LoRAPlan:
    """Group a step's tokens by slot (one host read of the index, once per step)."""
    groups = []
    for slot in torch.unique(lora_idx).tolist():
        if slot >= 0:
            groups.append((slot, (lora_idx == slot).nonzero().flatten()))
    return LoRAPlan(groups)


def lora_apply_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   plan: LoRAPlan, slice_sizes: list[int]) -> torch.Tensor:
    """y [T, out] += LoRA of x [T, in] for the rows of each slot in `plan`; y is updated in place and returned.
    The shrink accumulates in float32 (as the Triton kernels do); the result is cast to y's dtype."""
    rank = lora_b.shape[2]
    for slot, rows in plan.groups:
        s = x.index_select(0, rows).float() @ lora_a[slot].float().t()  # [n, slices * R]
        delta = torch.empty(rows.numel(), y.shape[1], dtype=torch.float32, device=y.device)
        off = 0
        for i, size in enumerate(slice_sizes):
            delta[:, off:off + size] = s[:, i * rank:(i + 1) * rank] @ lora_b[slot, off:off + size].float().t()
            off += size
        y.index_add_(0, rows, delta.to(y.dtype))
    return y


def lora_step_plan(lora_idx: torch.Tensor, num_slots: int) -> LoRAPlan | LoRASegments:
    """What every LoRA layer of one step shares: the Triton path's tokens sorted by slot on the device
    (`LoRASegments`, no host read, so it can run inside a CUDA graph), or the torch path's `LoRAPlan`."""
    if use_triton(lora_idx):
        from testbed.kernels.lora_triton import lora_segments
        return lora_segments(lora_idx, num_slots)
    return lora_plan(lora_idx)


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               lora_idx: torch.Tensor, plan: LoRAPlan | LoRASegments | None, slice_sizes: list[int]) -> torch.Tensor:
    """y += LoRA(x) per token slot: the Triton kernels on a GPU (or under TRITON_INTERPRET=1), else the torch
    path; `plan` is the step's lora_step_plan (made here when None)."""
    if plan is None:
        plan = lora_step_plan(lora_idx, lora_a.shape[0])
    if use_triton(x):
        from testbed.kernels.lora_triton import lora_expand, lora_shrink
        s = lora_shrink(x, lora_a, lora_idx, plan)
        lora_expand(y, s, lora_b, lora_idx, slice_sizes, plan)
        return y
    return lora_apply_ref(y, x, lora_a, lora_b, plan, slice_sizes)
