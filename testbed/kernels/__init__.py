"""Paged KV-cache kernels: KV store, paged decode attention (split-K), paged prefill/extend attention, and the
MLP's silu-and-mul.

Each entry point runs the Triton kernel when the tensors are on CUDA or when TRITON_INTERPRET=1 is set
(the Triton interpreter, for tests on CPU), else torch: the KV store and the MLP's activation as their
references, attention batched over the whole step (batched.py; the per-sequence references in reference.py
define its semantics). The Triton modules are imported lazily so that CPU-only installs without triton work
and TRITON_INTERPRET is read when they are first used.
"""

import os

import torch

from testbed.kernels.batched import (AttentionPlan, decode_plan, paged_attention_batched, prefill_plan,
                                     rope_store_batched, step_plan)
from testbed.kernels.reference import (paged_decode_attention_ref, paged_prefill_attention_ref,
                                       rope_store_kvcache_ref, silu_and_mul_ref, store_kvcache_ref)

__all__ = ["store_kvcache", "rope_store_kvcache", "paged_decode_attention", "paged_prefill_attention",
           "store_kvcache_ref", "rope_store_kvcache_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref",
           "silu_and_mul", "silu_and_mul_ref", "use_triton", "AttentionPlan", "decode_plan", "prefill_plan", "step_plan",
           "rope_store_batched", "paged_attention_batched"]


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernels should run for tensors like ``t``."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the paged cache; slot -1 is skipped."""
    if use_triton(key):
        from testbed.kernels.kv_store import store_kvcache_triton
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)


def rope_store_kvcache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, Hq, D] and k [T, Hk, D], then the rotated k and v into the paged cache,
    in one kernel on a GPU (q and k rotated in place there); returns the rotated (q, k)."""
    if use_triton(q):
        from testbed.kernels.kv_store import store_kvcache_triton
        store_kvcache_triton(k, v, k_cache, v_cache, slot_mapping, (positions, q, cos_sin_cache))
        return q, k
    return rope_store_kvcache_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence over its seq_lens[i] cached positions; returns a tensor like q."""
    if use_triton(q):
        from testbed.kernels.decode_attention import paged_decode_attention_triton
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    plan = decode_plan(block_tables, seq_lens, k_cache.shape[1], q.shape[1] // k_cache.shape[2])
    return paged_attention_batched(plan, q, k_cache, v_cache, scale)


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, num_live: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Causal attention of each sequence's last q_len positions over its cached prefix (positions below
    seq_len - q_len, from the paged cache) and this step's keys/values k/v [num_tokens, num_kv_heads, head_dim].
    num_live (a device scalar, optional): the sequences past it have no query (it only saves work)."""
    if use_triton(q):
        from testbed.kernels.prefill_attention import paged_prefill_attention_triton
        return paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                              num_live=num_live)
    plan = prefill_plan(cu_seqlens_q, block_tables, seq_lens, k_cache.shape[1], q.shape[1] // k_cache.shape[2])
    return paged_attention_batched(plan, q, k_cache, v_cache, scale, k, v)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
    if use_triton(x):
        from testbed.kernels.activation import silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
