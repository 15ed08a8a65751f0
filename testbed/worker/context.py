"""The attention context: one step's flat batch metadata, set by the model runner before `forward`.

Keeping it module-level (as nano-vllm does) keeps `forward(input_ids, positions)` free of
attention plumbing. Invariant: every tensor here describes the same step as the `input_ids`
being run; the runner calls `set_context` before and `reset_context` after each forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from testbed.kernels import AttentionPlan
from testbed.kernels.lora import LoRAPlan

if TYPE_CHECKING:  # the Triton module is imported only where its kernels run
    from testbed.kernels.lora_triton import LoRASegments


@dataclass
class Context:
    """Flat metadata of one step.

    is_decode: every sequence has exactly one query token (q_len == 1).
    slot_mapping: [num_tokens] int, cache slot (block_id * block_size + offset) per token; -1 skips.
    block_tables: [num_seqs, max_blocks] int32, the physical blocks of each sequence.
    seq_lens: [num_seqs] int32, tokens in the cache per sequence after this step's tokens are stored.
    cu_seqlens_q: [num_seqs + 1] int32, prefix sums of the query lengths in `input_ids`.
    num_live: [1] int32 or None, the sequences with queries (a CUDA graph's padding ones after them have none).
    attn_plan: the torch path's batched-attention indices, built by the first layer and shared by the rest.
    lora_idx: [num_tokens] int64 or None, each token's LoRA slot (-1: the base model); None: no adapter runs.
    lora_plan: the step's tokens grouped by LoRA slot (kernels/lora.py `lora_step_plan`: the Triton path's sort on the
        device, or the torch path's token rows per slot), built by the first LoRA layer and shared by the rest.
    """

    is_decode: bool = False
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    num_live: torch.Tensor | None = None
    attn_plan: AttentionPlan | None = None
    lora_idx: torch.Tensor | None = None
    lora_plan: LoRAPlan | LoRASegments | None = None


_CONTEXT = Context()


def get_context() -> Context:
    """The metadata of the step being run (a default, empty `Context` when none was set)."""
    return _CONTEXT


def set_context(is_decode: bool, slot_mapping: torch.Tensor | None = None,
                block_tables: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                cu_seqlens_q: torch.Tensor | None = None, num_live: torch.Tensor | None = None,
                lora_idx: torch.Tensor | None = None) -> None:
    """Install the metadata for the next forward."""
    global _CONTEXT
    _CONTEXT = Context(is_decode, slot_mapping, block_tables, seq_lens, cu_seqlens_q, num_live, lora_idx=lora_idx)


def reset_context() -> None:
    """Forget the step's metadata so that stale tensors are never reused by the next step."""
    global _CONTEXT
    _CONTEXT = Context()
