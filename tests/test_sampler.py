"""The Sampler on synthetic logits: greedy, temperature, top-k, top-p, per-request seeds and logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from testbed.engine.params import InvalidParam, SamplingParams, child_seed
from testbed.worker.sampler import Sampler

CPU = torch.device("cpu")
PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]  # token i has probability PROBS[i] at temperature 1
LOGITS = torch.tensor(PROBS).log()




def _draw(params: SamplingParams, n: int = 3000, logits: torch.Tensor = LOGITS, seed: int = 0) -> Counter:
    """n independent draws for one row (as n rows of one step)."""
    tokens, _ = Sampler(CPU, seed)(logits.repeat(n, 1), [params] * n, [str(i) for i in range(n)])
    return Counter(tokens)


def _freq_close(counts: Counter, probs: list[float], n: int) -> None:
    for tok, p in enumerate(probs):
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[tok] / n - p) < 5 * sd + 1e-9, (tok, counts[tok] / n, p)


def test_greedy_rows_are_argmax_whatever_else_is_in_the_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=2.0, top_p=0.5),
              SamplingParams(temperature=0.0, seed=4)]
    tokens, logprobs = Sampler(CPU)(logits, params, list("abcde"))
    assert logprobs is None
    for i in (0, 2, 4):
        assert tokens[i] == logits[i].argmax().item()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    n = 4000
    counts = _draw(SamplingParams(temperature=temperature), n)
    scaled = torch.softmax(LOGITS / temperature, dim=-1).tolist()
    _freq_close(counts, scaled, n)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_keeps_the_k_most_likely_renormalised(k):
    n = 3000
    counts = _draw(SamplingParams(temperature=1.0, top_k=k), n)
    assert set(counts) == set(range(k))
    kept = PROBS[:k]
    _freq_close(counts, [p / sum(kept) for p in kept], n)


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.41, 2), (0.64, 2), (0.66, 3), (0.95, 5), (1.0, 6)])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    counts = _draw(SamplingParams(temperature=1.0, top_p=top_p), 3000)
    assert set(counts) == set(range(kept))


def test_top_k_then_top_p_per_row():
    """As vLLM: top-p applies to the distribution renormalised over the top k (0.5, 0.31, 0.19 for k=3)."""
    n = 600
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.45), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=3, top_p=0.9), SamplingParams(temperature=1.0, top_k=1)]
    tokens, _ = Sampler(CPU)(LOGITS.repeat(4 * n, 1), params * n, [str(i) for i in range(4 * n)])
    assert [set(tokens[i::4]) for i in range(4)] == [{0}, set(range(6)), {0, 1, 2}, {0}]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(CPU, seed=0)
    seq_alone = [alone(logits, [seeded], ["r"])[0][0] for _ in range(20)]
    busy = Sampler(CPU, seed=123)
    others = torch.randn(3, 40)
    seq_busy = []
    for step in range(20):  # the seeded row moves around among unseeded and greedy rows
        batch = torch.cat([others[: step % 3], logits, others[step % 3:]])
        k = step % 3
        params = [SamplingParams(temperature=1.0)] * k + [seeded] + [SamplingParams(temperature=0.0)] * (3 - k)
        ids = [f"o{j}" for j in range(step % 3)] + ["r"] + [f"g{j}" for j in range(3 - step % 3)]
        seq_busy.append(busy(batch, params, ids)[0][step % 3])
    assert seq_busy == seq_alone
    assert len(set(seq_alone)) > 1
    # a request's generator is its own: another id with the same seed starts the same sequence
    assert alone(logits, [seeded], ["other"])[0][0] == seq_alone[0]
    alone.forget(["r"])  # a finished request's generator is dropped; a new one with its id starts over
    assert alone(logits, [seeded], ["r"])[0][0] == seq_alone[0]


def test_unseeded_rows_follow_the_engine_seed():
    a = _draw(SamplingParams(temperature=1.0), 200, seed=5)
    b = _draw(SamplingParams(temperature=1.0), 200, seed=5)
    assert a == b


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.5, top_k=3, logprobs=0, seed=1),
              SamplingParams(temperature=0.0)]
    tokens, logprobs = Sampler(CPU)(logits, params, ["a", "b", "c"])
    raw = torch.log_softmax(logits, dim=-1)
    chosen, rank, top = logprobs[0]
    assert chosen == pytest.approx(raw[0, tokens[0]].item(), abs=1e-6) and rank == 1
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist() and top[0][0] == tokens[0]
    assert [lp for _, lp in top] == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    chosen, rank, top = logprobs[1]  # not rescaled by temperature nor renormalised by top-k
    assert top == [] and chosen == pytest.approx(raw[1, tokens[1]].item(), abs=1e-6)
    assert tokens[1] in raw[1].topk(3).indices.tolist()
    assert rank == raw[1].argsort(descending=True).tolist().index(tokens[1]) + 1  # 1 = the most likely token
    assert logprobs[2] is None


@pytest.mark.parametrize("vocab", [128256, 49152, 320, 100])
def test_chunked_argmax_equals_argmax_with_ties(vocab):
    from testbed.worker.sampler import argmax
    g = torch.Generator().manual_seed(vocab)
    for n in (1, 3, 70):
        x = torch.randn(n, vocab, generator=g).to(torch.bfloat16)
        x[0, [5, vocab // 2, vocab - 1]] = 50.0  # ties across chunks: the first index wins
        x[n - 1, [vocab - 2, vocab - 1]] += 60.0 * (n > 1)
        assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x)[0] == 5


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 1.0}, "n"),
    ({"temperature": -1e-9}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 2**63}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"stop": ""}, "stop"), ({"stop": ["ok", "a\ud800"]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**63]}, "stop_token_ids"),
])
def test_sampling_params_rejects_out_of_range_values(kwargs, param):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and isinstance(e.value, ValueError)


def test_sampling_params_normalises_and_checks_the_vocabulary():
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=9.9e-6).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5 and SamplingParams(top_k=-1).top_k == 0
    SamplingParams(top_k=100, stop_token_ids=[99]).verify(100)
    with pytest.raises(InvalidParam, match=r"top_k must be -1, 0 \(off\) or in \[1, 100\]"):
        SamplingParams(top_k=101).verify(100)
    with pytest.raises(InvalidParam, match=r"token id 100 is outside the vocabulary \[0, 100\)"):
        SamplingParams(stop_token_ids=[5, 100]).verify(100)
    sp = SamplingParams()
    sp.top_k = 2**63  # changed after construction: verify checks everything again
    with pytest.raises(InvalidParam, match="top_k"):
        sp.verify(100)
    assert child_seed(None, 3) is None and child_seed(7, 2) == 9
    assert child_seed(2**63 - 1, 1) == -2**63 and child_seed(-2**63, 0) == -2**63


def test_extreme_valid_values_sample_the_most_likely_token():
    """A top_p below float32's smallest number once masked every token (NaN probabilities); a top_k above
    the vocabulary once overflowed the tensor of ks."""
    for params in (SamplingParams(temperature=1.0, top_p=1e-46), SamplingParams(temperature=1.0, top_p=5e-324),
                   SamplingParams(temperature=1.0, top_k=1, top_p=1e-46), SamplingParams(temperature=5e-324)):
        assert set(_draw(params, 200)) == {0}, params
    assert set(_draw(SamplingParams(temperature=1.0, top_k=2**62), 3000)) == set(range(len(PROBS)))
