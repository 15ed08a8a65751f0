"""Building blocks of Llama-family models: RMSNorm, rotary embedding, SiluAndMul, tensor-parallel layers.

TP follows Megatron/vLLM: column-parallel layers split the output dim, row-parallel layers split
the input dim and all-reduce their output, the vocabulary is split across ranks. Every parameter
carries `weight_loader(param, full_tensor, shard_id=None)` that copies THIS rank's shard of the
FULL checkpoint tensor, so one checkpoint loads at any tensor-parallel size.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from testbed.kernels import silu_and_mul
from testbed.kernels.cpu_gemv import MAX_ROWS as GEMV_MAX_ROWS, bf16_shadow, gemv_bf16
from testbed.kernels.lora import lora_apply, lora_step_plan
from testbed.kernels.reference import rope_ref
from testbed.worker.context import get_context
from testbed.worker.pipeline import get_parallel_state
from testbed.worker.tp_all_reduce import all_reduce as tp_all_reduce, fused_for, gemm_push_for

_TP_OVERRIDE: tuple[int, int] | None = None


@contextmanager
def tp_override(rank: int, size: int) -> Iterator[None]:
    """Build layers as rank `rank` of `size` without processes (tests). With no process group,
    collectives are skipped, so `forward` returns this rank's partial result."""
    global _TP_OVERRIDE
    if not 0 <= rank < size:
        raise ValueError(f"tp_override: rank {rank} is not in [0, {size})")
    previous, _TP_OVERRIDE = _TP_OVERRIDE, (rank, size)
    try:
        yield
    finally:
        _TP_OVERRIDE = previous


def get_tp() -> tuple[int, int]:
    """(tp_rank, tp_size): the override, else this process's place in its pipeline stage's tensor-parallel
    group, else the torch.distributed world (one TP group), else (0, 1)."""
    if _TP_OVERRIDE is not None:
        return _TP_OVERRIDE
    state = get_parallel_state()
    if state is not None:
        return state.tp_rank, state.tp_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def tp_collectives(tp_size: int) -> bool:
    """Whether layers of this TP size sum across ranks (a process group exists; tp_override builds without one)."""
    return tp_size > 1 and dist.is_available() and dist.is_initialized()


def _divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {tp_size}")
    return n // tp_size


def _shard(loaded: torch.Tensor, dim: int, start: int, size: int, full: int) -> torch.Tensor:
    """Rows [start, start+size) along `dim` of a full checkpoint tensor that must be `full` long there."""
    if loaded.dim() <= dim or loaded.size(dim) != full:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} should have size {full} in dim {dim}: "
                         "config and weights disagree")
    return loaded.narrow(dim, start, size)


def _copy(dst: torch.Tensor, src: torch.Tensor, param: nn.Parameter) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint shard of shape {tuple(src.shape)} does not fit parameter slice of shape "
                         f"{tuple(dst.shape)} (parameter {tuple(param.shape)}): config and weights disagree")
    dst.copy_(src)


def fused_on_gpu(fn):
    """`fn` as written for CPU tensors; on CUDA, compiled once by torch.compile (dynamic shapes) so its
    chain of elementwise ops becomes one Triton kernel. TESTBED_COMPILE=0 turns this off."""
    compiled = None

    def run(*args):
        nonlocal compiled
        if args[0].is_cuda and os.environ.get("TESTBED_COMPILE", "1") != "0":
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True)
            return compiled(*args)
        return fn(*args)

    run.__doc__ = fn.__doc__
    run.__wrapped__ = fn
    return run


@fused_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@fused_on_gpu
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the next norm in one kernel on a GPU."""
    h = x + residual
    return rms_norm.__wrapped__(h, weight, eps), h


apply_rope = fused_on_gpu(rope_ref)  # the profiling run's rotary embedding (no cache to store into)


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back (as HF Llama does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda p, w, shard_id=None: _copy(p.data, w, p)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, partial: bool = False,
                next_weight: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the add fused into the norm. `partial`:
        x is this rank's partial sum of a row-parallel layer (one that did not reduce), all-reduced here first,
        in the same kernel where the GPU allows (tp_all_reduce.FusedAllReduceNorm), which pulls the start of
        `next_weight` (the GEMM after this norm) into L2 while it waits on the peers."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        if partial:
            fused = fused_for(x)
            if fused is not None:
                return fused(x, residual, self.weight, self.eps, next_weight)
            x = tp_all_reduce(x)
        return add_rms_norm(x, residual, self.weight, self.eps)


class SiluAndMul(nn.Module):
    """[.., 2I] (gate | up) -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def _scaled_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict | None) -> torch.Tensor:
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind == "llama3":
        factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE as in HF Llama: the float32 cos/sin cache indexed by position, which
    attention applies (fused with the KV store on a GPU; `rope_ref` defines the math)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        inv_freq = _scaled_inv_freq(inv_freq, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)


class LinearBase(nn.Module):
    """y = x W^T (+ b) with this rank's [out_local, in_local] weight; subclasses define the sharding.

    With LoRA slots attached (`lora_a`, `lora_b`: kernels/lora.py's layout, worker/lora.py attaches them),
    each token of a step adds its adapter's delta, read from the step context's `lora_idx`; the shards of A
    and B follow the base weight's (row-parallel layers add their partial delta before the all-reduce, which
    sums it exactly as it sums the base output)."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: tuple[int, int]) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        if bias:
            self.bias.weight_loader = self.weight_loader
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.weight_bf16: torch.Tensor | None = None  # set by cpu_weight_layout where exact

    @property
    def lora_slices(self) -> list[tuple[object, int]]:
        """(shard id, local output rows) of each output slice a LoRA adapter targets separately."""
        return [(None, self.weight.shape[0])]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def _lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y plus the step's LoRA deltas (unchanged when LoRA is off or the step runs no adapter)."""
        if self.lora_a is None:
            return y
        ctx = get_context()
        if ctx.lora_idx is None:
            return y
        if ctx.lora_plan is None:
            ctx.lora_plan = lora_step_plan(ctx.lora_idx, self.lora_a.shape[0])
        return lora_apply(y, x, self.lora_a, self.lora_b, ctx.lora_idx, ctx.lora_plan,
                          [n for _, n in self.lora_slices])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._lora(linear(x, self.weight, self.bias, self.weight_bf16), x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_bf16: torch.Tensor | None
           ) -> torch.Tensor:
    """x W^T (+ b); with a bf16 copy of W (exactly W's values), a step of few rows reads it instead of W through
    the CPU matrix-vector kernel: half the bytes, the same products summed in float32."""
    if weight_bf16 is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.float32:
        y = gemv_bf16(x, weight_bf16)
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def cpu_weight_layout(model: nn.Module) -> None:
    """On a CPU, store every matmul weight [out, in] column-major (its transpose contiguous; shape, values and
    loaders unchanged): MKL's sgemm reads x @ W^T faster so, 7% on a one-token decode step of SmolLM2-135M and
    11% at 64 tokens (20% on its LM head alone). The tied embedding table shares the LM head's layout.
    A float32 weight whose values are all bf16 numbers (a bf16 checkpoint run in float32) also gets a bf16 copy,
    `weight_bf16`, that steps of up to GEMV_MAX_ROWS rows read instead (kernels/cpu_gemv.py). Call it after the
    weights are loaded: the copy is not updated when the weight changes."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (LinearBase, ParallelLMHead)) and not weight.is_cuda:
            if weight.stride(0) != 1:
                weight.data = weight.data.t().contiguous().t()
            module.weight_bf16 = bf16_shadow(weight)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; each rank keeps rows [rank*n, (rank+1)*n) of W."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tp()
        super().__init__(input_size, _divide(output_size, tp[1], "output size"), bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.size(0)
        _copy(param.data, _shard(loaded, 0, self.tp_rank * n, n, n * self.tp_size), param)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matmul (gate_up_proj); shard_id = index of the part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tp()[1]
        self.local_sizes = [_divide(s, tp_size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)

    @property
    def lora_slices(self) -> list[tuple[object, int]]:
        return list(enumerate(self.local_sizes))

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in [0, {len(self.local_sizes)}), got {shard_id!r}")
        size = self.local_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.local_sizes[:shard_id]), size)
        _copy(dst, _shard(loaded, 0, self.tp_rank * size, size, size * self.tp_size), param)


class QKVParallelLinear(LinearBase):
    """q, k, v projections packed in one matmul, query heads split across ranks. KV heads are split
    when tp_size <= num_kv_heads and replicated (tp_size / num_kv_heads ranks share one) otherwise."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        rank, tp_size = get_tp()
        if total_num_heads % tp_size:
            raise ValueError(f"--tensor-parallel-size {tp_size} must divide the number of attention heads "
                             f"({total_num_heads}); pick a divisor of {total_num_heads}")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(f"--tensor-parallel-size {tp_size} must be a multiple of the number of KV heads "
                                 f"({total_num_kv_heads}) when larger than it")
            self.num_kv_heads, self.kv_head_start = 1, rank // (tp_size // total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.kv_head_start = rank * self.num_kv_heads
        self.head_dim, self.num_heads = head_dim, total_num_heads // tp_size
        self.total_num_kv_heads = total_num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, (rank, tp_size))

    @property
    def lora_slices(self) -> list[tuple[object, int]]:
        return [("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)]

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id == "q":
            offset, size, start, full = 0, self.q_size, self.tp_rank * self.q_size, self.q_size * self.tp_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
            full = self.total_num_kv_heads * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), _shard(loaded, 0, start, size, full), param)


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial outputs are summed by an all-reduce (bias added once, on rank 0)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tp()
        super().__init__(_divide(input_size, tp[1], "input size"), output_size, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: replicated
            return _copy(param.data, loaded, param)
        n = param.size(1)
        _copy(param.data, _shard(loaded, 1, self.tp_rank * n, n, n * self.tp_size), param)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The summed output; with reduce=False this rank's partial sum (vLLM's reduce_results), which the next
        RMSNorm(partial=True) reduces (on GPUs, pushed to the peers by the GEMM itself where it can:
        tp_all_reduce.FusedAllReduceNorm.gemm)."""
        if not reduce and self.lora_a is None and self.bias is None:  # the same on every rank: they pair up
            fused = gemm_push_for(x, self.weight)
            if fused is not None:
                return fused.gemm(x, self.weight)
        y = self._lora(linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.weight_bf16), x)
        return tp_all_reduce(y) if reduce and tp_collectives(self.tp_size) else y


class VocabParallelEmbedding(nn.Module):
    """Vocabulary split in ceil(V / tp) rows per rank (last rank zero-padded); lookups outside this
    rank's range give zeros and the all-reduce sums the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = max(self.vocab_start, min(self.vocab_start + self.rows_per_rank, num_embeddings))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if loaded.size(0) != self.num_embeddings:
            raise ValueError(f"checkpoint has {loaded.size(0)} vocabulary rows, config says vocab_size={self.num_embeddings}")
        n = self.vocab_end - self.vocab_start
        _copy(param.data[:n], loaded[self.vocab_start:self.vocab_end], param)
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start).masked_fill(~mine, 0), self.weight)
        y = y.masked_fill(~mine.unsqueeze(-1), 0)
        return tp_all_reduce(y, first=True) if tp_collectives(self.tp_size) else y


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocabulary slice, gathered to rank 0 (others get None) or,
    with gather_to_all, to every rank. Without a process group it returns the local slice."""

    def __init__(self, num_embeddings: int, embedding_dim: int, gather_to_all: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.gather_to_all = gather_to_all
        self.weight_bf16: torch.Tensor | None = None  # set by cpu_weight_layout where exact

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden, self.weight, None, self.weight_bf16)
        if not tp_collectives(self.tp_size):
            return logits[..., : self.vocab_end - self.vocab_start]
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        state = get_parallel_state()
        group = state.tp_group if state is not None else None  # the last stage's ranks: global 0 is their first
        if self.gather_to_all:
            dist.all_gather(parts, logits, group=group)
        else:
            dist.gather(logits, parts if self.tp_rank == 0 else None, dst=0, group=group)
            if self.tp_rank != 0:
                return None
        return torch.cat(parts, dim=-1)[..., : self.num_embeddings]
