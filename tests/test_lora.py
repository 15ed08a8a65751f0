"""Multi-LoRA in real mode: one batch mixes base rows and several PEFT adapters (different ranks and target
modules), each row equal to transformers' output of the base model or of the model with that adapter merged
into its weights (fp32, greedy tokens and logprobs); tensor parallelism over gloo; bad adapters refused."""
from __future__ import annotations

import pytest
import torch

from testbed import LLM, LoRARequest, SamplingParams
from llm_helpers import hf_greedy_logprobs, merged, random_prompts, save_peft_adapter, save_tiny_llama

NEW_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0)


def _refs(hf, adapters: dict, prompts, loras) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and logprobs of each prompt under its adapter merged ({name: (mats, scaling)})."""
    refs = [None] * len(prompts)
    for name in {None} | set(adapters):
        with merged(hf, *adapters.get(name, (None,))) as model:
            for i, (p, lr) in enumerate(zip(prompts, loras)):
                if (lr and lr.lora_name) == name:
                    refs[i] = hf_greedy_logprobs(model, p, NEW_TOKENS)
    return refs


def _check_rows(outs, refs) -> None:
    for i, (o, (tokens, lps)) in enumerate(zip(outs, refs)):
        c = o.outputs[0]
        assert c.token_ids == tokens, f"row {i}"
        got = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        assert got == pytest.approx(lps, abs=2e-4), f"row {i}"


@pytest.mark.smollm2
def test_one_batch_mixes_base_and_two_adapters_like_merged_models(tmp_path):
    """SmolLM2 (fp32): adapters of rank 8 (q, v) and 16 (o, gate, up, down) beside base rows in one generate call."""
    from transformers import AutoModelForCausalLM
    from testbed.worker.smollm2 import default_model_dir
    base_dir = str(default_model_dir())
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    m1 = save_peft_adapter(tmp_path / "a1", hf, 8, ["q_proj", "v_proj"], alpha=16, seed=1)
    m2 = save_peft_adapter(tmp_path / "a2", hf, 16, ["o_proj", "gate_proj", "up_proj", "down_proj"], alpha=8, seed=2,
                           std=0.03)
    a1, a2 = LoRARequest("a1", 1, str(tmp_path / "a1")), LoRARequest("a2", 2, str(tmp_path / "a2"))
    prompts = random_prompts([9, 14, 5, 11, 7], 49152, seed=3)
    loras = [None, a1, a2, None, a1]
    refs = _refs(hf, {"a1": (m1, 16 / 8), "a2": (m2, 8 / 16)}, prompts, loras)
    assert refs[1][0] != hf_greedy_logprobs(hf, prompts[1], NEW_TOKENS)[0]  # the adapters change the outputs
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=64,
              max_num_seqs=8, skip_tokenizer_init=True)
    _check_rows(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), refs)
    assert llm.engine.records.steps[0][3] == 5  # one step held every row: base, a1 and a2 together


def test_tensor_parallel_shards_adapters_like_the_base_layers(tmp_path):
    """A tiny Llama at TP=2 (gloo) with adapters on every projection kind (column, merged, row-parallel) gives
    the merged models' tokens, with one slot and one host entry, so adapters swap in and out between steps."""
    hf = save_tiny_llama(tmp_path / "base", 4, 2, seed=4)
    m1 = save_peft_adapter(tmp_path / "a1", hf, 8, ["q_proj", "k_proj", "down_proj"], seed=5, std=0.2)
    m2 = save_peft_adapter(tmp_path / "a2", hf, 1, ["v_proj", "o_proj", "gate_proj", "up_proj"], seed=6, std=0.3)
    a1, a2 = LoRARequest("a1", 1, str(tmp_path / "a1")), LoRARequest("a2", 2, str(tmp_path / "a2"))
    prompts = random_prompts([10, 6, 13, 8], 320, seed=7)
    loras = [a2, None, a1, a2]
    refs = _refs(hf, {"a1": (m1, 2.0), "a2": (m2, 16.0)}, prompts, loras)
    llm = LLM(str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, max_model_len=64, max_num_seqs=4)
    try:
        _check_rows(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), refs)
        assert llm.engine.scheduler.lora.num_disk_loads == 2  # a2's rows, then a1's in its slot (a2 left the host)
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_with_reasons(tmp_path):
    hf = save_tiny_llama(tmp_path / "base", 4, 2, seed=8)
    save_peft_adapter(tmp_path / "big", hf, 32, ["q_proj"])
    save_peft_adapter(tmp_path / "ok", hf, 8, ["q_proj"])
    cfg = (tmp_path / "ok" / "adapter_config.json")
    (tmp_path / "emb").mkdir()
    (tmp_path / "emb" / "adapter_model.safetensors").write_bytes((tmp_path / "ok" / "adapter_model.safetensors").read_bytes())
    (tmp_path / "emb" / "adapter_config.json").write_text(cfg.read_text().replace('["q_proj"]', '["q_proj", "embed_tokens"]'))
    llm = LLM(str(tmp_path / "base"), dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16,
              max_model_len=64)
    with pytest.raises(ValueError, match="rank 32 exceeds --max-lora-rank 16"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 1, str(tmp_path / "big")))
    with pytest.raises(ValueError, match="'embed_tokens'.*supported target modules"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("emb", 2, str(tmp_path / "emb")))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 3, str(tmp_path / "nowhere")))
    base = LLM(executor=llm.executor, skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(ValueError, match="LoRA is off"):
        base.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("ok", 4, str(tmp_path / "ok")))


@torch.inference_mode()
def test_a_padded_lora_step_equals_the_eager_one():
    """The CUDA-graph layout with LoRA on, on the CPU: a step mixing two adapter slots and base rows, padded into
    the graphs' static buffers (the slot index padded with -1), gives the eager step's hidden rows; a step with no
    adapter leaves the whole index at -1, and the graphs captured without the LoRA kernels serve it the same."""
    import dataclasses
    import random

    from test_cuda_graphs import BS, TINY, attach_cache, make_step
    from testbed.engine.config import EngineConfig
    from testbed.worker.context import get_context, reset_context, set_context
    from testbed.worker.cuda_graphs import CudaGraphs, pad_into
    from testbed.worker.loader import build_model, init_dummy_weights
    from testbed.worker.lora import WorkerLoRA
    model = build_model(TINY, torch.float32, "cpu")
    init_dummy_weights(model, 0)
    attach_cache(model, 96)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, block_size=BS,
                          enable_lora=True, max_loras=2, max_lora_rank=8)
    lora = WorkerLoRA(model, config, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(3)
    for modules in lora.layers:
        for lin in modules.values():
            lin.lora_a.normal_(0, 0.3, generator=g)
            lin.lora_b.normal_(0, 0.3, generator=g)
    graphs = CudaGraphs(model, config, 256, torch.device("cpu"))
    tables = {"free": list(range(96))}
    x = make_step(random.Random(1), tables, {}, [7, 5, 9], 64)
    x = dataclasses.replace(x, lora_idx=torch.tensor([0] * 7 + [-1] * 5 + [1] * 9))
    set_context(x.is_decode, x.slot_mapping, x.block_tables, x.seq_lens, x.cu_seqlens_q, lora_idx=x.lora_idx)
    try:
        eager = model(x.input_ids, x.positions)
    finally:
        reset_context()
    _, n = graphs.size_for(x)
    pad_into(graphs.buf, x, n, graphs.num_seqs(n))
    assert graphs.buf.lora_idx[:21].tolist() == x.lora_idx.tolist() and (graphs.buf.lora_idx[21:n] == -1).all()
    graphs.buf.set_context(False, n, graphs.num_seqs(n))
    try:
        padded = model(graphs.buf.input_ids[:n], graphs.buf.positions[:n])
    finally:
        reset_context()
    assert torch.allclose(padded[:21], eager, atol=1e-5, rtol=1e-5)
    set_context(x.is_decode, x.slot_mapping, x.block_tables, x.seq_lens, x.cu_seqlens_q)  # no adapter at all
    try:
        plain = model(x.input_ids, x.positions)
    finally:
        reset_context()
    changed = (plain - eager).abs().amax(dim=1) > 1e-4
    assert changed[:7].all() and changed[12:].all()  # the adapter rows (base rows attend over the same cache)
    y = make_step(random.Random(2), tables, {}, [4, 3], 64)
    pad_into(graphs.buf, y, n, graphs.num_seqs(n))
    assert (graphs.buf.lora_idx[:n] == -1).all()
    # such a step replays the graph captured without the LoRA kernels (each size is captured both ways), whose
    # context runs no adapter, and gives what the graph with them gives over an index of -1
    assert graphs.lora_variants == (True, False)
    out = {}
    for with_lora in graphs.lora_variants:
        graphs.buf.set_context(False, n, graphs.num_seqs(n), with_lora)
        try:
            assert (get_context().lora_idx is None) != with_lora
            out[with_lora] = model(graphs.buf.input_ids[:n], graphs.buf.positions[:n])
        finally:
            reset_context()
    assert torch.allclose(out[True][:7], out[False][:7], atol=1e-5, rtol=1e-5)
