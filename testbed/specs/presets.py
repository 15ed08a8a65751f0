"""Named model shapes (Hugging Face config fields) shared by the sim cost model and `--load-format dummy`.

Pure data, no torch: `ModelSpec.hf_config()` gives the config.json a real checkpoint of that
shape carries, so the worker builds the same model for dummy weights as for real ones.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-family decoder. Invariant: num_attention_heads % num_key_value_heads == 0."""

    name: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def hf_config(self) -> dict:
        """config.json contents of a checkpoint with this shape."""
        cfg = {k: v for k, v in asdict(self).items() if k not in ("name", "architecture", "qk_norm")}
        cfg["architectures"] = [self.architecture]
        cfg["model_type"] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                             "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}[self.architecture]
        cfg["hidden_act"] = "silu"
        cfg["torch_dtype"] = "bfloat16"
        return {k: v for k, v in cfg.items() if v is not None}


_LLAMA3_SCALING_1B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_SCALING_8B = {**_LLAMA3_SCALING_1B, "factor": 8.0}

MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("SmolLM2-135M", "LlamaForCausalLM", 576, 1536, 30, 9, 3, 64, 49152, True, 100000.0, 8192,
              bos_token_id=1, eos_token_id=2),
    ModelSpec("Qwen3-0.6B", "Qwen3ForCausalLM", 1024, 3072, 28, 16, 8, 128, 151936, True, 1000000.0, 40960,
              rms_norm_eps=1e-6, qk_norm=True, bos_token_id=151643, eos_token_id=151645),
    ModelSpec("Llama-3.2-1B", "LlamaForCausalLM", 2048, 8192, 16, 32, 8, 64, 128256, True, 500000.0, 131072,
              rope_scaling=_LLAMA3_SCALING_1B, bos_token_id=128000, eos_token_id=128001),
    ModelSpec("Llama-3.1-8B", "LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128, 128256, False, 500000.0, 131072,
              rope_scaling=_LLAMA3_SCALING_8B, bos_token_id=128000, eos_token_id=128001),
    ModelSpec("Llama-3.1-70B", "LlamaForCausalLM", 8192, 28672, 80, 64, 8, 128, 128256, False, 500000.0, 131072,
              rope_scaling=_LLAMA3_SCALING_8B, bos_token_id=128000, eos_token_id=128001),
]}

# Accept the hub-style names users type (`meta-llama/Llama-3.1-8B-Instruct`, `HuggingFaceTB/SmolLM2-135M-Instruct`).
_ALIASES = {"smollm2-135m-instruct": "SmolLM2-135M", "llama-3.1-8b-instruct": "Llama-3.1-8B",
            "llama-3.2-1b-instruct": "Llama-3.2-1B", "llama-3.1-70b-instruct": "Llama-3.1-70B", "qwen3-0.6b-base": "Qwen3-0.6B"}


def get_model_spec(name: str) -> ModelSpec:
    """Preset by name, case-insensitive, with or without an `org/` prefix."""
    key = name.rsplit("/", 1)[-1].lower()
    for preset in MODEL_PRESETS.values():
        if preset.name.lower() == key:
            return preset
    if key in _ALIASES:
        return MODEL_PRESETS[_ALIASES[key]]
    raise ValueError(f"unknown model {name!r}; known shapes: {', '.join(MODEL_PRESETS)}; pick one with --model")
