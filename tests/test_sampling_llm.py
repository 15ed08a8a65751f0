"""Sampling parameters end to end through the offline LLM on the bundled SmolLM2 (CPU, fp32), against
transformers' `generate` with the same logits processors: penalties, logit_bias, bad words, allowed
token ids, min_tokens and min_p; prompt logprobs against transformers' log-softmax (chunked prefill,
prefix cache, n > 1); structured outputs that always validate; the front-end fields."""
from __future__ import annotations

import json
import re

import pytest
import torch

from testbed import LLM, SamplingParams
from testbed.engine.params import StructuredOutputsParams

from llm_helpers import OpenAIPenalties, hf_greedy

BUDGET = 32  # max_num_batched_tokens: longer prompts are prefilled in chunks
NEW = 16
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "In machine learning, a transformer is",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and"]


@pytest.fixture(scope="module")
def smol_dir() -> str:
    from testbed.worker.smollm2 import default_model_dir
    return str(default_model_dir())


@pytest.fixture(scope="module")
def smol(smol_dir) -> LLM:
    return LLM(smol_dir, max_model_len=512, max_num_batched_tokens=BUDGET, max_num_seqs=8, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf(smol_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_ref(hf):
    """transformers' greedy tokens for a case, `hf_greedy(hf, prompt, NEW, **kw)`, computed once a module: both
    scheduling modes compare with the same references. `key` names the case whole (prompt and parameters)."""
    refs: dict = {}

    def ref(key, prompt: list[int], kw: dict) -> list[int]:
        if key not in refs:
            refs[key] = hf_greedy(hf, prompt, NEW, **kw)
        return refs[key]
    return ref


@pytest.fixture(scope="module")
def tok(smol):
    return smol.get_tokenizer()


def _engine(smol: LLM, async_scheduling: bool) -> LLM:
    """The module's engine, or a fresh one with async scheduling over the same executor."""
    if not async_scheduling:
        return smol
    return LLM(executor=smol.executor, max_model_len=512, max_num_batched_tokens=BUDGET, max_num_seqs=8,
               enable_prefix_caching=True, async_scheduling=True)


def _greedy(max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_processed_greedy_matches_transformers_generate(smol, hf_ref, tok, async_scheduling):
    """One batch, every row with its own processing, as transformers' generate applies the same processors
    (async scheduling: the rows with bad words read the token still in flight)."""
    llm = _engine(smol, async_scheduling)
    ids = [tok.encode(p) for p in PROMPTS]
    base = llm.generate(ids, _greedy())
    first = [o.outputs[0].token_ids[0] for o in base]
    pair = base[3].outputs[0].token_ids[4:6]  # a two-token word the plain output contains
    word = tok.encode(" Paris", add_special_tokens=False)
    cases = [  # (prompt, our params, transformers generate kwargs)
        (ids[0], _greedy(repetition_penalty=1.6), dict(repetition_penalty=1.6)),
        (ids[1], _greedy(repetition_penalty=0.8), dict(repetition_penalty=0.8)),
        (ids[0], _greedy(logit_bias={first[0]: -100, 13: 4.0}), dict(sequence_bias=[[[first[0]], -100.0], [[13], 4.0]])),
        (ids[2], _greedy(bad_words_token_ids=[[first[2]], [28]]), dict(bad_words_ids=[[first[2]], [28]])),
        (ids[3], _greedy(bad_words_token_ids=[pair]), dict(bad_words_ids=[pair])),
        (ids[3], _greedy(allowed_token_ids=list(range(200, 900))),
         dict(prefix_allowed_tokens_fn=lambda b, i: list(range(200, 900)))),
        (ids[2], _greedy(frequency_penalty=1.5, presence_penalty=0.5),
         dict(logits_processor=[OpenAIPenalties(len(ids[2]), 1.5, 0.5)])),
        (ids[1], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=NEW, seed=5), {}),  # only the argmax survives
    ]
    outs = llm.generate([p for p, _, _ in cases], [sp for _, sp, _ in cases])
    for i, ((prompt, sp, kw), out) in enumerate(zip(cases, outs)):
        assert out.outputs[0].token_ids == hf_ref((i, tuple(prompt), repr(sp)), prompt, kw), sp
    changed = [o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, [base[0], base[1], base[0],
                                                                                     base[2], base[3], base[3], base[2]])]
    assert all(changed), changed  # every processed row differs from plain greedy
    # bad words given as text become token ids through the tokenizer, both forms of the word
    (o,) = llm.generate([ids[0]], [_greedy(bad_words=["Paris"])])
    assert word[-1] not in o.outputs[0].token_ids and "Paris" not in o.outputs[0].text


def test_min_tokens_keeps_eos_away_as_min_new_tokens_does(smol, hf, tok):
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(chat, add_special_tokens=False)
    eos = smol.eos_token_id
    short = smol.generate([prompt], _greedy(max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos
    m = len(short.token_ids) + 6
    (out,) = smol.generate([prompt], [_greedy(max_tokens=m + 8, min_tokens=m)])
    c = out.outputs[0]
    assert len(c.token_ids) >= m and eos not in c.token_ids[:m]
    assert c.token_ids == hf_greedy(hf, prompt, m + 8, min_new_tokens=m, eos_token_id=eos)


@pytest.mark.parametrize("slice_rows", [1024, 5])
def test_prompt_logprobs_match_transformers(smol, hf, tok, monkeypatch, slice_rows):
    """Chunked prefill (prompts longer than the token budget), a repeated prompt (the prefix cache must not
    skip positions) and n > 1 (the first sequence computes them): every prompt token but the first. With
    5-row LM-head slices, slices cut across the sampled rows and the prompt rows of a step."""
    from testbed.worker import model_runner
    monkeypatch.setattr(model_runner, "LOGIT_SLICE_ROWS", slice_rows)
    long = tok.encode(PROMPTS[3] * 3)
    assert len(long) > 2 * BUDGET
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
              SamplingParams(temperature=0.8, max_tokens=2, prompt_logprobs=1, n=2, seed=1)]
    first = smol.generate([long], params[:1])[0]
    outs = smol.generate([long, long, tok.encode(PROMPTS[0])], params)
    for o, sp in zip([first, *outs], [params[0], *params]):
        ids = o.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        plp = o.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for j, d in enumerate(plp[1:]):  # vLLM's {token id: Logprob}: the prompt token, then the top N
            row, t = ref[j], ids[j + 1]
            lp, rank = d[t].logprob, d[t].rank
            top = [i for i, v in sorted(d.items(), key=lambda kv: kv[1].rank) if v.rank <= sp.prompt_logprobs]
            assert next(iter(d)) == t and d[t].decoded_token == tok.decode([t])
            assert lp == pytest.approx(row[t].item(), abs=2e-4)
            eps = 2e-4  # our fp32 forward and transformers' differ by ~1e-5: near-ties may swap places
            assert int((row >= row[t] + eps).sum()) + 1 <= rank <= int((row >= row[t] - eps).sum())
            assert top == row.topk(sp.prompt_logprobs).indices.tolist()[:len(top)]
            assert len(top) == sp.prompt_logprobs
        first = o.outputs[0]
        assert first.logprobs is None or first.logprobs[0][first.token_ids[0]].rank >= 1


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_structured_outputs_always_validate_at_temperature_1(smol, tok, async_scheduling):
    """Eight seeds at temperature 1 within 64 tokens: every output is complete, stops at EOS, and validates
    (async scheduling: each matcher first takes the token still in flight)."""
    import jsonschema
    chat = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                   add_generation_prompt=True, tokenize=False)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = _engine(smol, async_scheduling).generate([chat] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured_outputs=so)
                                      for s in range(8)])
    texts = []
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.append(c.text)
    assert len(set(texts)) > 1  # really sampled


def test_regex_choice_grammar_and_json_object(smol, tok):
    kinds = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputsParams(choice=["yes", "no", "maybe"]),
             StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"'), StructuredOutputsParams(json_object=True)]
    outs = smol.generate(["Answer:"] * 4, [SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=k)
                                           for k in kinds])
    a, b, c, d = (o.outputs[0].text for o in outs)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", a) and b in ("yes", "no", "maybe") and re.fullmatch(r"\([a-c]+\)", c)
    if outs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(d), (dict, list))
    else:
        assert d.lstrip()[0] in "{["
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))


def test_front_end_fields(smol, tok):
    ids = tok.encode(PROMPTS[3])
    full, cut = smol.generate([ids, ids], [_greedy(max_tokens=4), _greedy(max_tokens=4, truncate_prompt_tokens=6)])
    assert cut.prompt_token_ids == ids[-6:] and full.prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        smol.generate([ids], _greedy(truncate_prompt_tokens=10_000))
    base = smol.generate(PROMPTS[0], _greedy())[0].outputs[0].text
    stop = base.split()[1]
    kept, dropped = smol.generate([PROMPTS[0]] * 2, [_greedy(stop=[stop], include_stop_str_in_output=True),
                                                     _greedy(stop=[stop])])
    assert kept.outputs[0].text.endswith(stop) and kept.outputs[0].text == dropped.outputs[0].text + stop
    special = dict(max_tokens=3, temperature=0.0, allowed_token_ids=[1, 2], ignore_eos=True)
    shown, hidden = smol.generate([PROMPTS[0]] * 2, [SamplingParams(skip_special_tokens=False, **special),
                                                     SamplingParams(**special)])
    assert hidden.outputs[0].text == "" and shown.outputs[0].text == tok.decode(shown.outputs[0].token_ids)
    assert shown.outputs[0].text.startswith("<|im_")


def test_a_grammar_past_structured_outputs_timeout_is_rejected(smol):
    """A grammar that does not compile within structured_outputs_timeout (a schema of 500 optional properties
    against a 50 ms bound) rejects its request, naming the flag; the engine holds nothing afterwards."""
    llm = LLM(executor=smol.executor, max_model_len=512, max_num_batched_tokens=BUDGET, max_num_seqs=8,
              structured_outputs_timeout=0.05)
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(500)}}
    with pytest.raises(ValueError, match="did not compile within 0.05 s \\(--structured-outputs-timeout\\)"):
        llm.generate("A JSON object:", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=wide)))
    assert not llm.has_unfinished_requests() and llm.engine.records.grammars[-1][3].startswith("structured_outputs:")
