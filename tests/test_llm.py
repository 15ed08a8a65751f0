"""The offline `LLM` API on the real engine (CPU, fp32) against Hugging Face transformers.

Greedy tokens must equal transformers' `generate` while our engine batches continuously: requests
arriving at different steps, chunked prefill under a small token budget, prefix-cache hits on
repeated prompts and preemption under a tiny KV cache. Plus the vLLM-shaped outputs, stop
handling, sampling options, logprobs and the errors for bad input.
"""
from __future__ import annotations

import pytest
import torch

from llm_helpers import hf_greedy, random_prompts, run_staggered, save_tiny_llama
from testbed import LLM, SamplingParams

NEW_TOKENS = 32
MAX_LEN = 512
BUDGET = 32  # max_num_batched_tokens: long prompts are prefilled in chunks

TEXT_PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level in degrees Celsius?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
    "and his three children. One day,",
    "The following is a list of the planets of the solar system, ordered by their distance from the sun, "
    "with a short description of each one. Mercury is the smallest planet and the closest to the sun; a year "
    "there lasts only 88 days, and its surface is covered with craters like the surface of our moon. Venus",
    "In machine learning, a transformer is",
]
ARRIVAL_STEPS = [0, 0, 0, 2, 3, 5, 9, 20]




@pytest.fixture(scope="module")
def smol_dir() -> str:
    from testbed.worker.smollm2 import default_model_dir
    return str(default_model_dir())


@pytest.fixture(scope="module")
def smol(smol_dir) -> LLM:
    return LLM(smol_dir, max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET, max_num_seqs=8,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smol_prompts(smol) -> list[list[int]]:
    tok = smol.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about autumn."}],
                                   add_generation_prompt=True, tokenize=False)
    return [tok.encode(p) for p in TEXT_PROMPTS] + [tok.encode(chat, add_special_tokens=False)]


@pytest.fixture(scope="module")
def hf_refs(hf_smol, smol_prompts) -> list[list[int]]:
    return [hf_greedy(hf_smol, p, NEW_TOKENS) for p in smol_prompts]


def _greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _check_batched_steps(llm: LLM, first_step: int) -> None:
    """The run really batched: several requests per step, prefill and decode mixed, budget kept."""
    steps = llm.engine.records.steps[first_step:]
    assert max(s[3] for s in steps) >= 4, "never more than 3 requests in one step"
    assert any(s[4] > 0 and s[5] > 0 for s in steps), "no step mixed a prefill chunk with decodes"
    assert all(s[4] + s[5] <= llm.config.max_num_batched_tokens for s in steps)


# ---- greedy parity with transformers under continuous batching ------------------------------------

@pytest.mark.smollm2
def test_smollm2_continuous_batching_matches_hf_generate(smol, smol_prompts, hf_refs):
    assert max(len(p) for p in smol_prompts) > 2 * BUDGET, "some prompt must need several prefill chunks"
    assert len({len(p) for p in smol_prompts}) >= 6
    first = len(smol.engine.records.steps)
    arrivals = ARRIVAL_STEPS + [1]
    tokens, _, reasons = run_staggered(smol, smol_prompts, arrivals, _greedy(), prefix="cb")
    _check_batched_steps(smol, first)
    for i, ref in enumerate(hf_refs):
        assert tokens[f"cb{i}"] == ref, f"prompt {i} ({TEXT_PROMPTS[i] if i < len(TEXT_PROMPTS) else 'chat'!r})"
        assert reasons[f"cb{i}"] == ("length" if len(ref) == NEW_TOKENS and ref[-1] != smol.eos_token_id else "stop")
    assert sum(len(r) == NEW_TOKENS for r in hf_refs) >= 6, "most references should run the full 32 tokens"

    # Repeats of the long prompts hit the prefix cache (mixed with fresh arrivals) and give the same tokens.
    repeat = [i for i, p in enumerate(smol_prompts) if len(p) > smol.config.block_size]
    assert len(repeat) >= 3
    again = [smol_prompts[i] for i in repeat] + [smol_prompts[0]]
    tokens2, cached, _ = run_staggered(smol, again, [2 * (j // 2) for j in range(len(again))], _greedy(), prefix="pc")
    for j, i in enumerate(repeat):
        assert cached[f"pc{j}"] > 0, f"repeat of prompt {i} ({len(smol_prompts[i])} tokens) missed the prefix cache"
        assert cached[f"pc{j}"] % smol.config.block_size == 0 and cached[f"pc{j}"] < len(smol_prompts[i])
        assert tokens2[f"pc{j}"] == hf_refs[i], f"repeat of prompt {i}"
    assert tokens2[f"pc{len(repeat)}"] == hf_refs[0]


@pytest.mark.smollm2
@pytest.mark.parametrize("width", [2, 4])
def test_smollm2_beam_search_matches_transformers(smol, hf_smol, smol_prompts, width):
    """With EOS ignored and a fixed length, the beams (best first) and their cumulative logprobs are transformers'
    generate(num_beams=width, do_sample=False), for several prompts (one beam group each, batched together)."""
    import copy
    from testbed import BeamSearchParams
    picked, new = [0, 8], 6
    copied = lambda: int(smol.engine.records.step_columns()["blocks_copied"].sum())  # noqa: E731
    before = copied()
    outs = smol.beam_search([{"prompt_token_ids": smol_prompts[i]} for i in picked],
                            BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True))
    # the beams forked inside blocks they shared (the prompts end mid-block): the worker ran those copies on write
    assert all(len(smol_prompts[i]) % smol.config.block_size for i in picked) and copied() > before
    config = copy.deepcopy(hf_smol.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0  # ignore EOS, as the beams do
    for i, out in zip(picked, outs):
        ids = smol_prompts[i]
        with torch.no_grad():
            ref = hf_smol.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   generation_config=config, num_beams=width, num_return_sequences=width,
                                   do_sample=False, max_new_tokens=new, length_penalty=1.0, output_scores=True,
                                   return_dict_in_generate=True)
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist(), f"prompt {i}"
        # transformers scores a beam by its logprob sum / generated length (length_penalty 1)
        assert [s.cum_logprob for s in out.sequences] == pytest.approx((ref.sequences_scores * new).tolist(), abs=1e-3)
        best = out.sequences[0]
        assert best.text == smol.get_tokenizer().decode(best.tokens) and len(best.logprobs) == new
        assert all(best.tokens[len(ids) + j] in best.logprobs[j] for j in range(new))
    bm = smol.engine.block_manager
    assert bm.num_used_blocks == 0 and not smol.engine.beam_owner
    bm.check_invariants()


@pytest.mark.smollm2
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_smollm2_preemption_keeps_greedy_tokens(smol_dir, smol_prompts, hf_refs, mode):
    # 9 blocks of 16 tokens: the longest request needs 6, so running several forces preemption: by recompute, or
    # by swapping the victim's blocks to the CPU pool and back (the greedy tokens are the unpreempted ones either way)
    picked = [6, 0, 5, 1]
    llm = LLM(smol_dir, max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET, max_num_seqs=4, num_gpu_blocks=9,
              enable_prefix_caching=True, preemption_mode=mode, swap_space=0.01)
    try:
        outs = llm.generate([smol_prompts[i] for i in picked], _greedy())
        preemptions = sum(r[10] for r in llm.engine.records.requests)
        assert preemptions > 0, "the tiny cache should have forced preemptions"
        swapped = llm.engine.records.step_columns()["blocks_swapped_in"].sum()
        assert (swapped > 0 and llm.engine.scheduler.num_swap_preemptions == preemptions) if mode == "swap" else \
            swapped == 0
        assert llm.engine.block_manager.num_cpu_blocks == (0 if mode == "recompute" else
                                                          int(0.01 * 2**30 // llm.executor.runner.block_bytes))
        for i, out in zip(picked, outs):
            assert out.outputs[0].token_ids == hf_refs[i], f"prompt {i}"
        llm.engine.block_manager.check_invariants()
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.executor.shutdown()


TINY_GQA = {1: (4, 4, 64), 3: (6, 2, 48), 4: (8, 2, 64)}  # heads, KV heads, hidden size


@pytest.mark.parametrize("ratio", sorted(TINY_GQA))
def test_tiny_llama_matches_hf_generate(ratio, tmp_path):
    heads, kv_heads, hidden = TINY_GQA[ratio]
    hf = save_tiny_llama(tmp_path, heads, kv_heads, seed=ratio, hidden_size=hidden)
    vocab = hf.config.vocab_size
    prompts = random_prompts([3, 9, 17, 33, 50, 70, 12, 1], vocab, seed=ratio)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(r) == NEW_TOKENS for r in refs)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=8,
              enable_prefix_caching=True, block_size=8)
    try:
        tokens, _, reasons = run_staggered(llm, prompts, [0, 0, 1, 1, 3, 6, 10, 11], _greedy(), prefix="g")
        _check_batched_steps(llm, 0)
        for i, ref in enumerate(refs):
            assert tokens[f"g{i}"] == ref, f"prompt {i} (length {len(prompts[i])})"
            assert reasons[f"g{i}"] == "length"
        tokens2, cached, _ = run_staggered(llm, prompts[3:6], [0, 0, 2], _greedy(), prefix="pc")
        for j, i in enumerate(range(3, 6)):
            assert cached[f"pc{j}"] > 0 and tokens2[f"pc{j}"] == refs[i], f"repeat of prompt {i}"
    finally:
        llm.executor.shutdown()
    # A cache too small for all of them at once: recompute preemptions, same tokens.
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=8, block_size=8,
              num_gpu_blocks=14)
    try:
        outs = llm.generate(prompts, _greedy())
        assert sum(r[10] for r in llm.engine.records.requests) > 0, "no preemption happened"
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.executor.shutdown()


@pytest.mark.parametrize("ratio", [4])
def test_async_scheduling_matches_hf_and_overlaps(ratio, tmp_path):
    """With one step in flight, decodes run on placeholders filled on the device from the previous step's
    tokens; greedy tokens still equal transformers' under batching, prefix hits and preemption."""
    heads, kv_heads, hidden = TINY_GQA[ratio]
    hf = save_tiny_llama(tmp_path, heads, kv_heads, seed=5, hidden_size=hidden)
    prompts = random_prompts([3, 9, 17, 33, 50, 70, 12, 1], hf.config.vocab_size, seed=5)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for blocks in (None, 14):  # roomy, then so small that requests are preempted with tokens in flight
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=8, block_size=8,
                  enable_prefix_caching=True, num_gpu_blocks=blocks, async_scheduling=True)
        runner = llm.executor.runner
        placeholders = []
        prepare = runner.prepare

        def spy(so, *args, prepare=prepare, placeholders=placeholders):
            placeholders.append(sum(b + n > r.num_tokens for r, b, n in
                                    zip(so.requests, so.num_computed_before, so.num_new_tokens)))
            return prepare(so, *args)
        runner.prepare = spy
        try:
            tokens, _, reasons = run_staggered(llm, prompts, [0, 0, 1, 1, 3, 6, 10, 11], _greedy(), prefix="a")
            assert [tokens[f"a{i}"] for i in range(len(prompts))] == refs
            assert set(reasons.values()) == {"length"}
            assert sum(placeholders) > 100, "decodes should mostly run on in-flight tokens"
            if blocks:
                assert sum(r[10] for r in llm.engine.records.requests) > 0, "no preemption happened"
            else:
                _check_batched_steps(llm, 0)
            llm.engine.block_manager.check_invariants()
            assert llm.engine.block_manager.num_used_blocks == 0 and llm.stepper.in_flight is None
        finally:
            llm.executor.shutdown()


@pytest.mark.smollm2
def test_async_scheduling_same_outputs_as_sync(smol, smol_dir, smol_prompts):
    """Stops (EOS, stop ids, stop strings that abort mid-flight), seeded sampling and logprobs: the same
    outputs whether the next step is scheduled before or after this one's tokens are applied."""
    params = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=24,
                                                                              stop=[" the", "\n"]),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[28, 30], logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, max_tokens=16)]
    prompts = [smol_prompts[i] for i in (0, 5, 7, 3, 4)]
    llm = LLM(smol_dir, max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET, max_num_seqs=8,
              enable_prefix_caching=True, async_scheduling=True)
    try:
        for a, b in zip(smol.generate(prompts, params), llm.generate(prompts, params)):
            x, y = a.outputs[0], b.outputs[0]
            assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (x.text, x.token_ids, x.finish_reason,
                                                                             x.stop_reason)
            assert (x.logprobs is None) == (y.logprobs is None)
            for dx, dy in zip(x.logprobs or [], y.logprobs or []):  # one {token id: Logprob} per position
                assert list(dy) == list(dx) and [v.rank for v in dy.values()] == [v.rank for v in dx.values()]
                assert [v.logprob for v in dy.values()] == pytest.approx([v.logprob for v in dx.values()], abs=1e-4)
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.executor.shutdown()


# ---- the vLLM-shaped API ---------------------------------------------------------------------------

@pytest.mark.smollm2
def test_outputs_are_vllm_shaped_for_strings_and_token_ids(smol, smol_prompts, hf_refs):
    tok = smol.get_tokenizer()
    outs = smol.generate([TEXT_PROMPTS[1], smol_prompts[1], {"prompt_token_ids": smol_prompts[1]}],
                         _greedy(max_tokens=12))
    assert len(outs) == 3 and len({o.request_id for o in outs}) == 3
    assert outs[0].prompt == TEXT_PROMPTS[1] and outs[1].prompt is None
    for o in outs:
        assert o.prompt_token_ids == smol_prompts[1] and o.finished
        assert len(o.outputs) == 1
        c = o.outputs[0]
        assert c.index == 0 and c.token_ids == hf_refs[1][:12]
        assert c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) and c.text.strip()
        assert c.logprobs is None and c.cumulative_logprob is None
    single = smol.generate(TEXT_PROMPTS[1], _greedy(max_tokens=3))  # one prompt, not in a list
    assert len(single) == 1 and single[0].outputs[0].token_ids == hf_refs[1][:3]
    ids_only = smol.generate(smol_prompts[1], _greedy(max_tokens=3))  # one token-id list
    assert len(ids_only) == 1 and ids_only[0].outputs[0].token_ids == hf_refs[1][:3]


@pytest.mark.smollm2
def test_chat_answers_paris(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}], _greedy(max_tokens=24))
    assert len(out) == 1
    assert "Paris" in out[0].outputs[0].text
    # a batch of conversations: each answered as if alone (the 135M model believes Italy's capital is
    # "Il Coriobella", as transformers' generate does too, so only France's answer is checked for content)
    two = smol.chat([[{"role": "user", "content": "What is the capital of Italy?"}],
                     [{"role": "user", "content": "What is the capital of France?"}]], _greedy(max_tokens=24))
    assert two[1].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert two[0].outputs[0].finish_reason == "stop" and two[0].outputs[0].text


@pytest.mark.smollm2
def test_stop_strings_truncate_text(smol, smol_prompts, hf_refs):
    prompt = smol_prompts[5]  # the fairy tale: a long, plain continuation
    full = smol.generate([prompt], _greedy())[0].outputs[0]
    assert full.token_ids == hf_refs[5]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    assert cut > 0
    out = smol.generate([prompt], _greedy(stop=[stop, "no such string in the output"]))[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    kept = smol.generate([prompt], _greedy(stop=stop))[0].outputs[0]  # a single string works as well
    assert kept.text == out.text and kept.stop_reason == stop


@pytest.mark.smollm2
def test_stop_token_ids_and_max_tokens(smol, smol_prompts, hf_refs):
    ref = hf_refs[6]
    k = 7
    stop_id = ref[k]
    first = ref.index(stop_id)
    out = smol.generate([smol_prompts[6]], _greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ref[:first + 1]  # the stop token is the last output token, as in vLLM
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = smol.generate([smol_prompts[6]], _greedy(max_tokens=5))[0].outputs[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length" and out.stop_reason is None


@pytest.mark.smollm2
def test_eos_finishes_with_stop_unless_ignored(smol, smol_prompts, hf_refs):
    ended = [i for i, r in enumerate(hf_refs) if r[-1] == smol.eos_token_id]
    if not ended:
        pytest.skip("no reference prompt ends with EOS within 32 tokens")
    i = ended[0]
    out = smol.generate([smol_prompts[i]], _greedy())[0].outputs[0]
    assert out.token_ids == hf_refs[i] and out.finish_reason == "stop" and out.stop_reason is None
    more = smol.generate([smol_prompts[i]], _greedy(max_tokens=len(hf_refs[i]) + 3, ignore_eos=True))[0].outputs[0]
    assert more.token_ids[:len(hf_refs[i])] == hf_refs[i] and len(more.token_ids) == len(hf_refs[i]) + 3
    assert more.finish_reason == "length"


@pytest.mark.smollm2
def test_n_sequences_and_seeded_sampling(smol, smol_prompts):
    prompt = smol_prompts[7]
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10)
    out = smol.generate([prompt], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "3 seeded samples at temperature 1 all equal"
    again = smol.generate([prompt], sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # sample k of n uses seed + k: the same as a lone request with that seed, alone or in a busy batch
    alone = smol.generate([prompt], SamplingParams(temperature=1.0, seed=12, max_tokens=10))[0].outputs[0]
    assert alone.token_ids == out.outputs[1].token_ids
    others = [SamplingParams(temperature=0.0, max_tokens=14), SamplingParams(temperature=1.3, max_tokens=6),
              SamplingParams(temperature=1.0, seed=12, max_tokens=10), SamplingParams(temperature=0.7, top_p=0.9,
                                                                                     seed=5, max_tokens=12)]
    batch = smol.generate([smol_prompts[6], smol_prompts[0], prompt, smol_prompts[2]], others)
    assert batch[2].outputs[0].token_ids == alone.token_ids
    greedy_n = smol.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=6))[0]
    assert greedy_n.outputs[0].token_ids == greedy_n.outputs[1].token_ids


@pytest.mark.smollm2
def test_top_k_1_and_tiny_top_p_are_greedy(smol, smol_prompts, hf_refs):
    prompts = [smol_prompts[3], smol_prompts[4]]
    outs = smol.generate(prompts + prompts, [SamplingParams(temperature=1.0, top_k=1, max_tokens=16)] * 2
                         + [SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=16)] * 2)
    for o, i in zip(outs, [3, 4, 3, 4]):
        assert o.outputs[0].token_ids == hf_refs[i][:16]
    hot = smol.generate(prompts, SamplingParams(temperature=5.0, seed=3, max_tokens=16))
    assert any(o.outputs[0].token_ids != hf_refs[i][:16] for o, i in zip(hot, [3, 4]))


@pytest.mark.smollm2
def test_logprobs_match_hf_log_softmax(smol, smol_prompts, hf_smol):
    prompt = smol_prompts[4]
    outs = smol.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),
                                            SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=8,
                                                           logprobs=0)])
    for out in outs:
        c = out.outputs[0]
        with torch.no_grad():
            logits = hf_smol(torch.tensor([prompt + c.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        assert len(c.logprobs) == len(c.token_ids) == 8
        k = 3 if out is outs[0] else 0  # the logprobs asked for
        for j, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):  # vLLM's {token id: Logprob}, the token first
            assert next(iter(d)) == tok and abs(d[tok].logprob - ref[j, tok].item()) < 1e-4, f"token {j}"
            row, eps = ref[j], 2e-4  # near-ties may swap places between the two forwards
            assert int((row >= row[tok] + eps).sum()) + 1 <= d[tok].rank <= int((row >= row[tok] - eps).sum())
            for tid, lp in d.items():
                assert abs(lp.logprob - ref[j, tid].item()) < 1e-4
                assert lp.decoded_token == smol.get_tokenizer().decode([tid])
            ranked = {lp.rank: tid for tid, lp in d.items() if lp.rank <= k}
            assert [ranked[r] for r in range(1, k + 1)] == ref[j].topk(k).indices.tolist()
        assert abs(c.cumulative_logprob - sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))) < 1e-6
    greedy, sampled = (o.outputs[0] for o in outs)
    assert all(len(d) == 3 and d[tok].rank == 1 for tok, d in zip(greedy.token_ids, greedy.logprobs))
    assert all(list(d) == [tok] for tok, d in zip(sampled.token_ids, sampled.logprobs))
    assert any(d[tok].rank > 1 for tok, d in zip(sampled.token_ids, sampled.logprobs))  # sampled, not greedy


# ---- bad input -------------------------------------------------------------------------------------

@pytest.mark.smollm2
def test_too_long_prompt_raises_and_engine_recovers(smol, smol_prompts, hf_refs):
    long_prompt = (smol_prompts[6] * 10)[:MAX_LEN + 10]
    with pytest.raises(ValueError, match=r"prompt 1: .*exceeds max_model_len \(512\)"):
        smol.generate([smol_prompts[0], long_prompt], _greedy())
    assert not smol.engine.has_unfinished_requests(), "the accepted prompt of the failed call was left running"
    with pytest.raises(ValueError, match="max_model_len"):
        smol.generate([long_prompt[:MAX_LEN - 4]], _greedy(max_tokens=8))
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        smol.generate([smol_prompts[0]], [_greedy(), _greedy()])
    assert smol.generate([smol_prompts[0]], _greedy(max_tokens=4))[0].outputs[0].token_ids == hf_refs[0][:4]


def test_dummy_weights_take_token_ids_only():
    llm = LLM("SmolLM2-135M", load_format="dummy", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    try:
        assert llm.get_tokenizer() is None
        with pytest.raises(ValueError, match="token-id lists"):
            llm.generate(["Hello"], _greedy(max_tokens=4))
        with pytest.raises(ValueError, match="chat needs a tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}])
        with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \[0, 49152\)"):
            llm.generate([[1, 2], [3, 49152]], _greedy(max_tokens=4))
        with pytest.raises(ValueError, match="token id -1 is outside"):
            llm.generate([[1, -1]], _greedy(max_tokens=4))
        assert not llm.engine.has_unfinished_requests()
        outs = llm.generate([[1, 2, 3, 4, 5], [7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        for o in outs:
            c = o.outputs[0]
            assert len(c.token_ids) == 4 and all(0 <= t < 49152 for t in c.token_ids)
            assert c.finish_reason == "length" and c.text == ""
    finally:
        llm.executor.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_failing_in_sampling_ends_with_an_error_and_the_engine_goes_on(async_scheduling):
    """A request's parameters changed after admission (so no validation saw them) make the real sampler
    raise; that request ends with finish_reason "error", the requests batched with it finish with the
    tokens they get alone, and the engine serves the next call."""
    llm = LLM("SmolLM2-135M", load_format="dummy", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              async_scheduling=async_scheduling)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], greedy)]
        llm.add_request("ok0", [1, 2, 3], greedy)
        llm.add_request("bad", [7, 8, 9], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
        llm.add_request("ok1", [4, 5, 6], greedy)
        outs: dict[str, list] = {}
        for step in range(50):
            if step == 2:
                llm.engine.requests["bad"].sampling_params.temperature = 1e-300  # 0 in float32: inf logits, NaN probs
            for o in llm.step():
                outs.setdefault(o.request_id, []).append(o)
            if not llm.has_unfinished_requests():
                break
        bad = outs["bad"][-1]
        assert bad.finish_reason == "error" and "probability tensor" in bad.stop_reason
        assert 1 <= sum(len(o.new_token_ids) for o in outs["bad"]) < 6
        for rid, tokens in zip(("ok0", "ok1"), ref):
            assert [t for o in outs[rid] for t in o.new_token_ids] == tokens and outs[rid][-1].finish_reason == "length"
        assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], greedy)] == ref
        # parameters changed before a call are checked again before anything is batched
        sp = SamplingParams(max_tokens=2)
        sp.top_k = 2**63
        with pytest.raises(ValueError, match="top_k"):
            llm.generate([[1, 2]], sp)
        with pytest.raises(ValueError, match="stop_token_ids"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop_token_ids=[49152]))
        assert not llm.has_unfinished_requests()
    finally:
        llm.executor.shutdown()


def test_the_progress_bar_shows_input_and_output_speeds_as_vllms(capsys):
    from testbed import LLM, SamplingParams
    llm = LLM(max_model_len=256, num_gpu_blocks=64)
    try:
        llm.generate(["Hello there", "One two"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    finally:
        llm.shutdown()
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "est. speed input:" in err and "toks/s, output:" in err, err[-500:]
