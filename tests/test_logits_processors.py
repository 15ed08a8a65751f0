"""Logits processing on synthetic logits against transformers' logits processors on the same logits
(RepetitionPenalty, SequenceBias, NoBadWords, PrefixConstrained, MinNewTokensLength, MinP), and against
OpenAI's definition of the frequency and presence penalties; the per-request device state across steps;
and the grammar bitmask against xgrammar's own masking."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    NoBadWordsLogitsProcessor, PrefixConstrainedLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from testbed.engine.params import InvalidParam, SamplingParams, StructuredOutputsParams
from testbed.worker.logits_processors import LogitsProcessors, RowContext
from testbed.worker.sampler import Sampler

CPU = torch.device("cpu")
VOCAB = 48
EOS = 47


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _ctx(prompt: list[int], out: list[int]) -> RowContext:
    return RowContext(prompt, out, len(out), EOS)


def _apply(logits: torch.Tensor, params: list[SamplingParams], ctxs: list[RowContext]) -> torch.Tensor:
    return LogitsProcessors().apply(logits.clone(), params, [f"r{i}" for i in range(len(params))], ctxs)


def _ids(prompt: list[int], out: list[int]) -> torch.Tensor:
    return torch.tensor([prompt + out])


ROWS = [([1, 2, 3, 4], [5, 5, 6, 2]), ([7, 8], [9, 10, 11, 9, 9]), ([12] * 3, [])]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    logits = _logits(len(ROWS))
    got = _apply(logits, [SamplingParams(repetition_penalty=penalty)] * len(ROWS), [_ctx(p, o) for p, o in ROWS])
    for j, (p, o) in enumerate(ROWS):
        ref = RepetitionPenaltyLogitsProcessor(penalty)(_ids(p, o), logits[j:j + 1].clone())
        torch.testing.assert_close(got[j:j + 1], ref)
    assert not torch.equal(got, logits)


def test_frequency_and_presence_penalties_follow_openai_after_the_repetition_penalty():
    """vLLM's order: repetition (prompt and output tokens), then frequency (times generated) and presence
    (generated at all); prompt tokens never count for the last two."""
    logits = _logits(len(ROWS), 1)
    sp = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.7, presence_penalty=-0.4)
    got = _apply(logits, [sp] * len(ROWS), [_ctx(p, o) for p, o in ROWS])
    for j, (p, o) in enumerate(ROWS):
        ref = RepetitionPenaltyLogitsProcessor(1.2)(_ids(p, o), logits[j:j + 1].clone())[0]
        for tok, n in Counter(o).items():
            ref[tok] -= 0.7 * n - 0.4
        torch.testing.assert_close(got[j], ref)


def test_logit_bias_matches_sequence_bias_and_is_clamped():
    logits = _logits(2, 2)
    bias = {3: 5.0, 9: -100.0, 20: 0.25}
    params = [SamplingParams(logit_bias={str(k): v for k, v in bias.items()}), SamplingParams(logit_bias={4: 1e9})]
    got = _apply(logits, params, [_ctx([1], []), _ctx([1], [])])
    ref = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(_ids([1], []), logits[:1].clone())
    torch.testing.assert_close(got[:1], ref)
    assert got[1, 4] == pytest.approx(logits[1, 4].item() + 100.0)  # OpenAI's range: [-100, 100]


def test_bad_words_match_no_bad_words():
    """A one-token word is always banned; a longer one bans its last token only right after its prefix."""
    words = [[30], [11, 12], [40, 41, 42]]
    rows = [([1, 2], [5, 11]), ([1, 2], [40, 41]), ([1, 2], [41, 40]), ([1, 2], [11, 40, 41])]
    logits = _logits(len(rows), 3)
    got = _apply(logits, [SamplingParams(bad_words_token_ids=words)] * len(rows), [_ctx(p, o) for p, o in rows])
    proc = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)
    for j, (p, o) in enumerate(rows):
        torch.testing.assert_close(got[j:j + 1], proc(_ids(p, o), logits[j:j + 1].clone()))
    assert got[0, 12] == float("-inf") and got[1, 42] == float("-inf") and got[2, 42] != float("-inf")


def test_allowed_token_ids_match_prefix_constrained():
    logits = _logits(1, 4)
    allowed = [3, 17, 29, 3]
    got = _apply(logits, [SamplingParams(allowed_token_ids=allowed)], [_ctx([1], [])])
    ref = PrefixConstrainedLogitsProcessor(lambda b, ids: allowed, 1)(_ids([1], []), logits.clone())
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("n_out", [0, 2, 3, 5])
def test_min_tokens_masks_stop_tokens_like_min_new_tokens(n_out):
    logits = _logits(1, 5)
    prompt, out = [1, 2, 3], list(range(10, 10 + n_out))
    sp = SamplingParams(min_tokens=3, stop_token_ids=[20, 21])
    got = _apply(logits, [sp], [_ctx(prompt, out)])
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [EOS, 20, 21])(_ids(prompt, out), logits.clone())
    torch.testing.assert_close(got, ref)
    assert (got[0, EOS] == float("-inf")) == (n_out < 3)


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_matches_transformers(min_p, temperature):
    logits = _logits(4, 6)
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 4
    got = Sampler._filter(logits / temperature, params)
    ref = MinPLogitsWarper(min_p)(None, logits / temperature)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.isinf(got).any()


def test_every_step_in_vllms_order_on_one_row():
    """allowed_token_ids, bad words, min_tokens, logit_bias, then the penalties, on the same row."""
    logits = _logits(1, 7)
    prompt, out = [1, 2, 3], [5, 11, 5]
    allowed = list(range(0, 40)) + [EOS]
    sp = SamplingParams(allowed_token_ids=allowed, bad_words_token_ids=[[11, 12], [6]], min_tokens=4,
                        logit_bias={7: 3.0, 5: -1.0}, repetition_penalty=1.5, frequency_penalty=0.5,
                        presence_penalty=0.25)
    got = _apply(logits, [sp], [_ctx(prompt, out)])
    ids, ref = _ids(prompt, out), logits.clone()
    ref = PrefixConstrainedLogitsProcessor(lambda b, i: allowed, 1)(ids, ref)
    ref = NoBadWordsLogitsProcessor([[11, 12], [6]], eos_token_id=EOS)(ids, ref)
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 4, [EOS])(ids, ref)
    ref = SequenceBiasLogitsProcessor([[[7], 3.0], [[5], -1.0]])(ids, ref)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(ids, ref)[0]
    for tok, n in Counter(out).items():
        ref[tok] -= 0.5 * n + 0.25
    torch.testing.assert_close(got[0], ref)


def test_penalty_counts_live_on_the_device_across_steps():
    """The sampler counts each sampled token on the device: a context whose output list lags (a token in
    flight under async scheduling) changes nothing. Greedy with a frequency penalty walks down the ranking."""
    logits = torch.zeros(1, VOCAB)
    logits[0, :6] = torch.tensor([10.0, 9.0, 8.0, 7.0, 6.0, 5.0])
    sp = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5)
    sampler = Sampler(CPU)
    got, history = [], []
    for step in range(8):
        tok = sampler(logits, [sp], ["r"], [RowContext([40], [], step)])[0][0]  # outputs never passed
        got.append(tok)
        history.append(tok)
    ref, seen = [], Counter()
    for _ in range(8):
        x = logits[0].clone()
        for t, n in seen.items():
            x[t] -= 2.0 * n + 0.5
        ref.append(int(x.argmax()))
        seen[ref[-1]] += 1
    assert got == ref and len(set(got)) > 2
    sampler.forget(["r"])  # a new request with the same id starts from no counts
    assert sampler(logits, [sp], ["r"], [RowContext([40], [], 0)])[0][0] == 0


def test_processed_rows_beside_fast_rows():
    """Rows without processing keep the raw argmax; processed greedy rows take the processed argmax; random
    rows draw only allowed tokens; logprobs stay those of the raw logits."""
    logits = _logits(3, 8)
    top = int(logits[0].argmax())
    params = [SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.0, logit_bias={top: -100}, logprobs=1),
              SamplingParams(temperature=1.0, allowed_token_ids=[1, 2])]
    logits[1] = logits[0]
    biased = logits[0].clone()
    biased[top] -= 100
    sampler = Sampler(CPU, seed=3)
    for _ in range(20):
        (a, b, c), lps = sampler(logits, params, ["a", "b", "c"], [None, _ctx([1], []), _ctx([1], [])])
        assert a == top and b == int(biased.argmax()) != top
        assert c in (1, 2)
        raw = torch.log_softmax(logits[1], -1)
        assert lps[1][0] == pytest.approx(raw[b].item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_left_with_no_token_is_reported_and_spares_the_others(temperature):
    """allowed_token_ids = [EOS] under min_tokens excludes every token: that row is -1 (never a draw from NaN
    probabilities, which fails on the CPU and asserts on a GPU); the rows beside it sample as usual."""
    logits = _logits(3, 9)
    params = [SamplingParams(temperature=temperature, seed=1, allowed_token_ids=[EOS], min_tokens=2),
              SamplingParams(temperature=temperature, seed=1, allowed_token_ids=[3, EOS], min_tokens=2),
              SamplingParams(temperature=0.0)]
    tokens, _ = Sampler(CPU)(logits, params, ["a", "b", "c"], [_ctx([1], []), _ctx([1], []), None])
    assert tokens == [-1, 3, int(logits[2].argmax())]


@pytest.mark.parametrize("penalty", [1e-4, 1e4])
def test_the_extreme_repetition_penalties_accepted_keep_logits_finite(penalty):
    logits = _logits(len(ROWS)) * 100  # logits of +-100s: the largest a model gives
    got = _apply(logits, [SamplingParams(repetition_penalty=penalty)] * len(ROWS), [_ctx(p, o) for p, o in ROWS])
    assert got.isfinite().all()


def test_a_row_that_needs_processing_needs_a_context():
    with pytest.raises(ValueError, match="RowContext"):
        Sampler(CPU)(_logits(1), [SamplingParams(logit_bias={1: 1.0})], ["a"], [None])


@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty"), ({"repetition_penalty": 1e30}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"structured_outputs": StructuredOutputsParams(json_object=True), "min_tokens": 2}, "min_tokens"),
])
def test_new_fields_are_range_checked(kwargs, param):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_vocabulary_checks_and_bad_words_need_token_ids():
    SamplingParams(logit_bias={99: 1.0}, allowed_token_ids=[0, 99], bad_words_token_ids=[[98, 99]]).verify(100)
    for kwargs, param in (({"logit_bias": {100: 1.0}}, "logit_bias"), ({"allowed_token_ids": [100]}, "allowed_token_ids"),
                          ({"bad_words_token_ids": [[1, 100]]}, "bad_words"), ({"bad_words": ["hi"]}, "bad_words")):
        with pytest.raises(InvalidParam) as e:
            SamplingParams(**kwargs).verify(100)
        assert e.value.param == param
    with pytest.raises(InvalidParam, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(InvalidParam, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


# ---- grammars (xgrammar, with the bundled SmolLM2's tokenizer) ----------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from testbed.worker.loader import load_tokenizer
    from testbed.worker.smollm2 import default_model_dir
    return load_tokenizer(str(default_model_dir()))


def test_bitmask_masks_as_xgrammar_does(tokenizer):
    import xgrammar as xgr
    from testbed.worker.grammar import GrammarStates, unpack_bitmask
    vocab = 49152
    states = GrammarStates(lambda: tokenizer)
    params = [SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
              SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-x"))]
    prefix = tokenizer.encode("12", add_special_tokens=False)
    mask = states.bitmask(["a", "b"], params, [[], prefix], [2, 2], vocab)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, mask)
    ours = logits.masked_fill(~unpack_bitmask(mask, vocab), float("-inf"))
    assert torch.equal(ours, ref)
    allowed_b = torch.isfinite(ours[1]).nonzero().flatten().tolist()
    assert allowed_b and all(tokenizer.decode([t]).startswith("-") for t in allowed_b)


def test_choice_grammar_accepts_exactly_the_choices(tokenizer):
    import xgrammar as xgr
    from testbed.worker.grammar_compile import choice_grammar
    choices = ['say "hi"', "back\\slash", "two\nlines", "café"]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)).compile_grammar(choice_grammar(choices))
    for text in choices + ["say hi", "back\\\\slash"]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.is_completed()) == (text in choices), text


@pytest.mark.parametrize("so, param", [
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(a"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_by_name(so, param):
    from testbed.worker.grammar_compile import check_structured_outputs
    with pytest.raises(InvalidParam) as e:
        check_structured_outputs(so)
    assert e.value.param == param and "does not compile" in str(e.value) and ".cc:" not in str(e.value)


def test_schemas_with_local_references_and_modest_depth_are_accepted():
    local = {"$defs": {"p": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}}
    StructuredOutputsParams(json=local)
    schema: dict = {"type": "string"}
    for _ in range(40):  # 80 JSON levels: deep for a real schema, within the bound
        schema = {"type": "object", "properties": {"a": schema}}
    StructuredOutputsParams(json=schema)
    for bad in ({"$ref": "other.json#/p"}, {"items": [{"$ref": 3}]}):
        with pytest.raises(InvalidParam, match=r"\$ref"):
            StructuredOutputsParams(json=bad)
