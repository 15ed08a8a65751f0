"""Helpers for the real-engine tests (test_llm, test_tp, test_replay): tiny random HF checkpoints,
Hugging Face greedy references (with logits processors), and a driver that staggers request arrivals across engine steps."""
from __future__ import annotations

import random
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch

SMALL_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=320,
                    max_position_embeddings=256, rms_norm_eps=1e-6, head_dim=16,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_tiny_llama(folder: Path, heads: int, kv_heads: int, seed: int = 0, **overrides):
    """Save a random tiny Llama (every weight random, norms near 1) as a HF folder; returns the HF model.

    No EOS token, so greedy generation always runs to max_tokens in both engines."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**{**SMALL_COMMON, **overrides}, num_attention_heads=heads, num_key_value_heads=kv_heads)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    hf.save_pretrained(folder)
    return hf


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


def hf_greedy(hf, prompt: Sequence[int], max_new_tokens: int, **processors) -> list[int]:
    """transformers' `generate` (do_sample=False) with these logits-processor arguments: new tokens, ending
    with EOS where the model emits it."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, **processors)
    return out[0, len(prompt):].tolist()


class OpenAIPenalties:
    """OpenAI's frequency and presence penalties over the generated tokens, as a transformers logits
    processor (transformers has none)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for tok, n in Counter(input_ids[0, self.prompt_len:].tolist()).items():
            scores[0, tok] -= self.frequency * n + self.presence
        return scores


def run_staggered(llm, prompts: Sequence[Sequence[int]], arrival_steps: Sequence[int], params, prefix: str = "r",
                  max_steps: int = 10_000) -> tuple[dict[str, list[int]], dict[str, int], dict[str, str]]:
    """Add prompt i before engine step arrival_steps[i] (ids f"{prefix}{i}") and step until all finish.

    Returns (tokens, num_cached_tokens, finish_reason) per request id. Every request must finish."""
    pending = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for step in range(max_steps):
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.pop(0)
            rejected = llm.add_request(f"{prefix}{i}", list(prompts[i]), params)
            assert rejected is None, rejected
            tokens[f"{prefix}{i}"] = []
        if not pending and not llm.has_unfinished_requests():
            return tokens, cached, reasons
        for o in llm.step():
            tokens[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    raise AssertionError(f"requests not finished after {max_steps} steps")


def save_peft_adapter(folder: Path, hf, rank: int, targets: Sequence[str], alpha: float = 16.0, seed: int = 0,
                      std: float = 0.05) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write a random LoRA adapter for the HF model `hf` in PEFT's format (the product's writer,
    profiling/lora_measure.py), both A and B random so it changes the outputs; returns
    {HF weight name: (A [r, in], B [out, r])}."""
    from safetensors.torch import load_file

    from testbed.profiling.lora_measure import PEFT_MODULES, write_random_adapter
    write_random_adapter(hf.config, folder, rank, seed, targets=targets, alpha=alpha, std=std)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    mats = {}
    for i in range(hf.config.num_hidden_layers):
        for module in targets:
            key = f"base_model.model.model.layers.{i}.{PEFT_MODULES[module]}.{module}"
            mats[f"model.layers.{i}.{PEFT_MODULES[module]}.{module}.weight"] = (
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"])
    return mats


@contextmanager
def merged(hf, mats: dict[str, tuple[torch.Tensor, torch.Tensor]] | None, scaling: float = 1.0):
    """`hf` with each adapter delta merged into its weight, W + scaling * B A (what PEFT's merge_and_unload
    computes), inside the block; the base weights come back after it."""
    params = dict(hf.named_parameters())
    saved = {name: params[name].detach().clone() for name in mats or {}}
    with torch.no_grad():
        for name, (a, b) in (mats or {}).items():
            params[name] += scaling * (b @ a)
    try:
        yield hf
    finally:
        with torch.no_grad():
            for name, w in saved.items():
                params[name].copy_(w)


def hf_greedy_logprobs(hf, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the logprob of each under the model."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, lps
