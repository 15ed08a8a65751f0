"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) on tensor-parallel layers and paged attention.

Module and parameter names match Hugging Face (`model.layers.N.self_attn.o_proj.weight`, ...)
except the packed `qkv_proj` and `gate_up_proj`; `packed_modules_mapping` tells the loader
which checkpoint tensors go into which packed shard, so HF checkpoints load by name.

A pipeline stage (worker/pipeline.py) builds only its own layers (specs/partition.py), under their global
indices (the others are parameterless MissingLayers), the embedding on the first stage, the final norm and the
LM head on the last; `checkpoint_target` maps a checkpoint tensor's name to this stage's parameter or None.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from testbed.specs.partition import get_pp_indices
from testbed.kernels import (paged_attention_batched, paged_decode_attention, paged_prefill_attention,
                             rope_store_batched, rope_store_kvcache, step_plan, use_triton)
from testbed.worker.context import get_context
from testbed.worker.pipeline import pipeline_stage
from testbed.worker.tp_all_reduce import all_reduce as tp_all_reduce, begin_forward, end_forward
from testbed.worker.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                                   RotaryEmbedding, RowParallelLinear, SiluAndMul, VocabParallelEmbedding, apply_rope,
                                   get_tp, tp_collectives)

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ModelConfig:
    """Attribute view of a HF config (PretrainedConfig or config.json dict) with Llama-family defaults
    filled in; reads both the old (`rope_theta`/`rope_scaling`) and new (`rope_parameters`) rope fields."""

    def __init__(self, config) -> None:
        d = dict(config) if isinstance(config, Mapping) else config.to_dict() if hasattr(config, "to_dict") else vars(config)
        self.raw = d
        arch = (d.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(d.get("model_type"))])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} (model_type {d.get('model_type')!r}); "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.architecture = arch
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if d.get(key) is None:
                raise ValueError(f"model config lacks required field {key!r}")
            setattr(self, key, int(d[key]))
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
        self.num_key_value_heads = int(d.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim = int(d.get("head_dim") or self.hidden_size // self.num_attention_heads)
        self.rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        self.max_position_embeddings = int(d.get("max_position_embeddings", 4096))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        rope = d.get("rope_parameters") or {}
        self.rope_theta = float(d.get("rope_theta") or rope.get("rope_theta", 10000.0))
        self.rope_scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        bias = bool(d.get("attention_bias", False))
        self.qkv_bias = {"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(arch, bias)
        self.o_bias = bias if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else False
        self.mlp_bias = bool(d.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False
        self.qk_norm = arch == "Qwen3ForCausalLM"
        window = d.get("sliding_window") if arch == "MistralForCausalLM" or d.get("use_sliding_window") else None
        if window and window < self.max_position_embeddings:
            logger.warning("%s: sliding_window=%d is not applied; attention is exact only up to %d tokens",
                           arch, window, window)


class Attention(nn.Module):
    """Stores this step's K/V in the layer's paged cache and attends over it.

    The model runner sets `k_cache`/`v_cache` ([num_blocks, block_size, num_kv_heads, head_dim]).
    While they are None or empty (profiling run) attention is plain causal within each sequence
    of the step, which then must have no cached prefix. On a GPU the Triton kernels run; on a CPU the
    first layer builds the step's AttentionPlan into the context and every layer runs batched over it.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of q and k, the K/V store and attention; q and k may be rotated in place."""
        ctx = get_context()
        if self.k_cache is None or self.k_cache.numel() == 0:
            q, k = apply_rope(positions, q, k, cos_sin_cache)
            return self._uncached(q, k, v, ctx)
        if not use_triton(q):  # the torch path: batched over the step, its indices built by the first layer
            if ctx.attn_plan is None:
                ctx.attn_plan = step_plan(ctx.is_decode, positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens,
                                          ctx.cu_seqlens_q, cos_sin_cache, self.k_cache, self.num_heads, q.dtype)
            q, k = rope_store_batched(ctx.attn_plan, q, k, v, self.k_cache, self.v_cache)
            return paged_attention_batched(ctx.attn_plan, q, self.k_cache, self.v_cache, self.scale,
                                           None if ctx.is_decode else k, None if ctx.is_decode else v)
        q, k = rope_store_kvcache(positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_decode:
            return paged_decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens, self.scale)
        return paged_prefill_attention(q, k, v, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens,
                                       ctx.block_tables, self.scale, ctx.num_live)

    def _uncached(self, q, k, v, ctx) -> torch.Tensor:
        cu = ctx.cu_seqlens_q.tolist() if ctx.cu_seqlens_q is not None else [0, q.size(0)]
        q_lens = [b - a for a, b in zip(cu, cu[1:])]
        if ctx.seq_lens is not None and ctx.seq_lens.tolist() != q_lens:
            raise ValueError("attention has no KV cache attached but the step reads cached tokens "
                             f"(seq_lens {ctx.seq_lens.tolist()} != query lengths {q_lens})")
        out = torch.empty_like(q)
        for a, b in zip(cu, cu[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                                      enable_gqa=True).transpose(0, 1)
        return out


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, hd ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = self.qkv_proj(x).split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, p.head_dim), k.view(-1, self.num_kv_heads, p.head_dim)
        v = v.reshape(-1, self.num_kv_heads, p.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary_emb.cos_sin_cache).flatten(1), reduce)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)), reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary_emb)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                deferred: bool = False, x_partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two, so each
        residual add runs inside a norm kernel (as vLLM's layers do). `deferred` (tensor parallelism): this
        layer's row-parallel outputs stay this rank's partial sums, which the norm after each reduces (fused with
        it on GPUs, tp_all_reduce.FusedAllReduceNorm); `x_partial`: x is the previous layer's such output."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual, x_partial, self.self_attn.qkv_proj.weight)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x, not deferred), residual, deferred,
                                                    self.mlp.gate_up_proj.weight)
        return self.mlp(x, not deferred), residual


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, never run."""

    def forward(self, *args):
        raise RuntimeError("a decoder layer of another pipeline stage was called")


class LlamaModel(nn.Module):
    """The decoder, or the layers [start_layer, end_layer) of one pipeline stage of it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pp_rank, self.pp_size = pipeline_stage()
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.start_layer, self.end_layer = get_pp_indices(cfg.num_hidden_layers, self.pp_rank, self.pp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary_emb) if self.start_layer <= i < self.end_layer
                                    else MissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        self.tp_size = get_tp()[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Final hidden states on the last stage; elsewhere (hidden, residual) for the next stage, which passes
        them in as `intermediate`."""
        deferred = tp_collectives(self.tp_size)  # row-parallel outputs stay partial sums until the next norm
        begin_forward()
        if self.is_first:
            h, residual = self.embed_tokens(input_ids), None
        else:
            h, residual = intermediate
        partial = False  # the embedding's output and a received stream are summed
        for layer in self.layers[self.start_layer:self.end_layer]:
            h, residual = layer(positions, h, residual, deferred, partial)
            partial = deferred
        if not self.is_last:  # the next stage receives the summed stream
            out = (tp_all_reduce(h) if partial else h), residual
        else:
            out = self.norm(h, residual, partial)[0]
        end_forward()
        return out


class LlamaForCausalLM(nn.Module):
    """The whole decoder (or one pipeline stage of it); `forward` runs one flat step described by the
    attention context."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config if isinstance(config, ModelConfig) else ModelConfig(config)
        self.model = LlamaModel(self.config)
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size) if self.model.is_last else None
        if self.config.tie_word_embeddings and self.model.is_first and self.model.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """input_ids [T], positions [T] -> final hidden states [T, hidden] (a stage before the last: its
        (hidden, residual) for the next stage, which passes them as `intermediate`)."""
        return self.model(input_ids, positions, intermediate)

    def checkpoint_target(self, name: str) -> str | None:
        """This stage's parameter name for checkpoint tensor `name`, or None when another stage holds it. A
        last stage without the embedding but with tied embeddings loads its LM head from the embedding's tensor."""
        m = self.model
        if name.startswith("model.layers."):
            return name if m.start_layer <= int(name.split(".", 3)[2]) < m.end_layer else None
        if name.startswith("model.embed_tokens."):
            if m.is_first:
                return name
            return name.replace("model.embed_tokens.", "lm_head.") if m.is_last and self.config.tie_word_embeddings \
                else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if m.is_last else None
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rows of hidden [n, hidden] -> logits [n, vocab] in the model's dtype (None on TP ranks other
        than 0); the sampler upcasts to float32 only where it needs probabilities."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """The per-layer attention modules of this stage, in layer order, whose k_cache/v_cache the runner sets."""
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start_layer:self.model.end_layer]]
