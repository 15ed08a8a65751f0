"""Embeddings: a pooling request is a prompt-only request through the same scheduler (it ends, with no token, in
the step that computes its last prompt token), `LLM.embed` equals transformers' final hidden states pooled at
the last token or averaged (normalised or not) under chunked prefill and prefix caching, and POST /v1/embeddings
answers the official openai client with the same vectors (floats and base64).
"""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_engine, make_request, run_engine
from server_helpers import metric, running_server
from testbed.engine.config import ConfigError, PoolerConfig
from testbed.engine.params import InvalidParam, PoolingParams
from testbed.engine.request import Request

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["The capital of France is Paris, a city of museums, cafés and bridges over the Seine.",
           "def add(a, b):\n    return a + b\n", "Hi"]


def pooling_request(rid: str, n: int, pooling_type: str = "LAST", arrival: float = 0.0) -> Request:
    tokens = make_request(rid, n).prompt_token_ids
    return Request(rid, tokens, None, arrival, pooling_params=PoolingParams(pooling_type))


# ---- the engine (no model) -------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=6), gen=st.integers(0, 3),
       budget=st.sampled_from([8, 16, 64]), overlap=st.booleans(), caching=st.booleans())
def test_pooling_requests_are_prompt_only(lens, gen, budget, overlap, caching):
    engine = make_engine(num_gpu_blocks=64, max_num_batched_tokens=budget, max_num_seqs=8,
                         async_scheduling=overlap, enable_prefix_caching=caching)
    pooled = [pooling_request(f"p{i}", n, "MEAN" if i % 2 else "LAST", float(i)) for i, n in enumerate(lens)]
    generated = [make_request(f"g{i}", 20, 5, arrival=float(i)) for i in range(gen)]
    steps, outs = run_engine(engine, [(i, r) for i, r in enumerate(pooled)] + [(i, r) for i, r in enumerate(generated)])
    for req in pooled:
        (out,) = outs[req.request_id]  # one output: the end
        assert out.finished and out.finish_reason == "stop" and out.new_token_ids == [] and out.pooling_output is None
        assert req.output_token_ids == [] and req.num_tokens == req.num_prompt_tokens
        rows = [(so.num_computed_before[i], so.num_new_tokens[i]) for so in steps
                for i, r in enumerate(so.requests) if r is req]
        assert sum(n for _, n in rows) + max(req.num_cached_tokens, 0) == req.num_prompt_tokens  # the prompt, once
        assert rows[-1][0] + rows[-1][1] == req.num_prompt_tokens  # its last step computes the last prompt token
        if req.pooling_params.pooling_type == "MEAN":
            assert req.num_cached_tokens == 0  # a mean needs every position's hidden states
    for req in generated:
        assert len(req.output_token_ids) == 5 and outs[req.request_id][-1].finish_reason == "length"
    counts = engine.token_counts
    assert counts.prompt == sum(lens) + 20 * gen and counts.generation == 5 * gen
    assert engine.num_pooling == 0 and engine.block_manager.num_used_blocks == 0


def test_pooling_request_too_long_is_rejected_and_params_are_checked():
    engine = make_engine(num_gpu_blocks=64, max_model_len=32)
    out = engine.add_request(pooling_request("long", 33), 0.0)
    assert out.finish_reason == "rejected" and "max_model_len is 32" in out.stop_reason
    assert engine.add_request(pooling_request("fits", 32), 0.0) is None  # a prompt may fill the context
    with pytest.raises(InvalidParam, match="dimensions is not supported"):
        PoolingParams(dimensions=8)
    with pytest.raises(InvalidParam, match="pooling_type"):
        PoolingParams(pooling_type="CLS")
    with pytest.raises(ValueError, match="exactly one"):
        Request("x", [1, 2], None, 0.0)
    with pytest.raises(ConfigError, match="pooling_type"):
        PoolerConfig.of({"pooling_type": "CLS"})


# ---- LLM.embed against transformers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_dir() -> str:
    from testbed.worker.smollm2 import default_model_dir
    return str(default_model_dir())


@pytest.fixture(scope="module")
def hidden_states(smol_dir):
    """transformers' final (normed) hidden states of each prompt, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smol_dir)
    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.model(torch.tensor([tok(p).input_ids])).last_hidden_state[0] for p in PROMPTS]


def reference(h: torch.Tensor, pooling_type: str, normalize: bool = True) -> torch.Tensor:
    v = h[-1] if pooling_type == "LAST" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


@pytest.mark.smollm2
def test_llm_embed_matches_transformers(smol_dir, hidden_states):
    from testbed import LLM
    llm = LLM(smol_dir, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True,
              pooler_config={"pooling_type": "MEAN"})
    for params, kind, norm in ((None, "MEAN", True), (PoolingParams("LAST"), "LAST", True),
                               (PoolingParams(normalize=False), "MEAN", False)):
        outs = llm.embed(PROMPTS, pooling_params=params)
        assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
        for o, h in zip(outs, hidden_states):
            got = torch.tensor(o.outputs.embedding)
            assert o.outputs.hidden_size == 576 and len(o.prompt_token_ids) == h.shape[0]
            torch.testing.assert_close(got, reference(h, kind, norm), atol=2e-5, rtol=1e-4)
    again = llm.embed(PROMPTS[0], pooling_params=PoolingParams("LAST"))[0]  # its prompt blocks are cached now
    assert again.num_cached_tokens >= 16
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), reference(hidden_states[0], "LAST"),
                               atol=2e-5, rtol=1e-4)
    # generation and embeddings in the same steps: each gets what it asked for
    from testbed import SamplingParams
    llm.add_request("gen", llm.tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=4, temperature=0))
    llm.add_request("emb", llm.tokenizer.encode(PROMPTS[0]), PoolingParams("MEAN"))
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            done.setdefault(o.request_id, []).append(o)
    assert sum(len(o.new_token_ids) for o in done["gen"]) == 4
    torch.testing.assert_close(torch.tensor(done["emb"][-1].pooling_output), reference(hidden_states[0], "MEAN"),
                               atol=2e-5, rtol=1e-4)


# ---- /v1/embeddings with the openai client ---------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("--pooler-config", '{"pooling_type": "MEAN"}', "--max-num-batched-tokens", "256",
                        "--max-num-seqs", "8", log_dir=tmp_path_factory.mktemp("embed")) as srv:
        yield srv


@pytest.mark.smollm2
def test_embeddings_endpoint(server, hidden_states, smol_dir):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    out = client.embeddings.create(model="SmolLM2-135M-Instruct", input=PROMPTS)  # the client asks for base64
    assert [d.index for d in out.data] == [0, 1, 2] and out.usage.prompt_tokens == sum(h.shape[0] for h in hidden_states)
    for d, h in zip(out.data, hidden_states):
        torch.testing.assert_close(torch.tensor(d.embedding), reference(h, "MEAN"), atol=2e-5, rtol=1e-4)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS[2], "encoding_format": "float",
                                                          "normalize": False}, timeout=60).json()
    torch.testing.assert_close(torch.tensor(raw["data"][0]["embedding"]), reference(hidden_states[2], "MEAN", False),
                               atol=2e-5, rtol=1e-4)
    b64 = httpx.post(f"{server.url}/v1/embeddings", json={"input": [[1, 2, 3]], "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(b64), dtype="<f4").shape == (576,)
    # the last 4 tokens of the prompt, as an input of those 4 tokens; an unknown field is ignored (a warning)
    tail = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS[0], "truncate_prompt_tokens": 4,
                                                           "encoding_format": "float", "colour": "blue"},
                      timeout=60).json()
    assert tail["usage"]["prompt_tokens"] == 4
    from transformers import AutoTokenizer
    last4_ids = AutoTokenizer.from_pretrained(smol_dir)(PROMPTS[0]).input_ids[-4:]
    last4 = httpx.post(f"{server.url}/v1/embeddings", json={"input": [last4_ids],
                                                            "encoding_format": "float"}, timeout=60).json()
    assert tail["data"][0]["embedding"] == last4["data"][0]["embedding"]
    assert "were present in the request but ignored: ['colour']" in server.log_text()
    for body, param in (({"input": "Hi", "dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                        ({"input": [[1, 49152]]}, "input"), ({"input": "x " * 300}, "input"),
                        ({"input": "Hi", "priority": 1}, "priority"),
                        ({"input": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="Hi")
    page = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric(page, "vllm:request_success_total", finished_reason="stop") >= 5  # one per input
    assert metric(page, "vllm:generation_tokens_total") == 0  # prompt-only: nothing sampled
