"""`testbed serve` end to end: a real server (API process + engine-core process, bundled SmolLM2 on
the CPU) on 127.0.0.1, driven with the official `openai` client (max_retries=0) and raw HTTP.

One module-scoped server (API key on, prefix caching on) serves every test here; load and abort
tests are bounded in count and time and target 127.0.0.1 only.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_helpers import metric, running_server, sse_events

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the key from vLLM's $VLLM_API_KEY, so it is not on the command line (test_401_api_key checks both)
    with running_server("--enable-prefix-caching", "--max-request-bytes", "100000", api_key=KEY, key_in_env=True,
                        log_dir=tmp_path_factory.mktemp("serve")) as srv:
        yield srv


def count_tokens(http, **body) -> int:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def stream_raw(http, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def assert_serving(http) -> None:
    """The server still answers after whatever the test did."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


# ---- incremental detokenizer (no server) -----------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from testbed.worker.loader import load_tokenizer
    from testbed.worker.smollm2 import default_model_dir
    return load_tokenizer(str(default_model_dir()))


def test_detokenizer_matches_full_decode(tokenizer):
    from testbed.text.detokenizer import IncrementalDetokenizer
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(" Héllo wörld 🦊🦊 naïve café — 東京 ok.\n\nDone").input_ids
    d = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for t in ids:
        assert not d.add([t])
        deltas.append(d.delta(final=False))
        assert "\ufffd" not in deltas[-1]  # half a UTF-8 character is never streamed
    d.finish()
    deltas.append(d.delta(final=True))
    assert "".join(deltas) == d.text == tokenizer.decode(ids)
    assert d.num_tokens == len(ids)


def test_detokenizer_stop_string_across_tokens(tokenizer):
    from testbed.text.detokenizer import IncrementalDetokenizer
    ids = tokenizer("Hello world, this is a test of stop strings").input_ids
    d = IncrementalDetokenizer(tokenizer, [1], stop=["world, th"])
    streamed = ""
    for i, t in enumerate(ids):
        stopped = d.add([t])
        streamed += d.delta(final=stopped)
        if stopped:
            break
        assert len(streamed) <= max(len(d.text) - len("world, th") + 1, 0)  # the tail is held back
    assert stopped and d.stop_reason == "world, th" and streamed == d.text == "Hello "
    assert d.num_tokens == i + 1 < len(ids)
    assert d.add([ids[-1]]) and d.num_tokens == i + 1  # nothing is consumed after the stop
    keep = IncrementalDetokenizer(tokenizer, [1], stop=["world"], include_stop_str_in_output=True)
    assert keep.add(ids) and keep.text == "Hello world"


# ---- models, tokenize, detokenize ------------------------------------------------------------------
def test_models(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    entry = http.get("/v1/models").json()["data"][0]
    assert entry["max_model_len"] == 256 and entry["vocab_size"] == 49152


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]
    bad = http.post("/detokenize", json={"tokens": [49152]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={}).status_code == 400


# ---- completions -----------------------------------------------------------------------------------
def test_completion_usage_is_exact(client, http):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length"
    assert r.usage.prompt_tokens == count_tokens(http, prompt=PROMPT)
    assert r.usage.completion_tokens == len(c.logprobs.tokens) == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert "".join(c.logprobs.tokens) == c.text
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def _completion_text(client, **kw) -> tuple[str, str]:
    r = client.completions.create(model=MODEL, **kw)
    return r.choices[0].text, r.choices[0].finish_reason


def test_stream_equals_non_stream_completions(client, http):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2}
    full = client.completions.create(model=MODEL, **body)
    events = stream_raw(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-1], events[-2]["usage"]
    texts, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for ev in chunks[:-1]:
        (ch,) = ev["choices"]
        texts[ch["index"]] += ch["text"]
        if ch["finish_reason"] is not None:
            reasons[ch["index"]].append(ch["finish_reason"])
    for c in full.choices:
        assert texts[c.index] == c.text and reasons[c.index] == [c.finish_reason]
    assert full.choices[0].text == full.choices[1].text  # greedy
    assert usage["completion_tokens"] == full.usage.completion_tokens
    assert usage["prompt_tokens"] == full.usage.prompt_tokens


def test_stream_with_openai_client(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert sum(ch.choices[0].finish_reason is not None for ch in chunks[:-1]) == 1


def test_prompt_forms_and_echo(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    multi = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0)
    assert [c.index for c in multi.choices] == [0, 1] and multi.choices[0].text == by_text.choices[0].text
    assert multi.usage.prompt_tokens == len(ids) + count_tokens(http, prompt="Hello")
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert lists.choices[0].text == by_text.choices[0].text and lists.usage.prompt_tokens == len(ids) + 2
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text
    events = stream_raw(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echo.choices[0].text


def test_sampling_parameters(client, http):
    greedy, _ = _completion_text(client, prompt=PROMPT, max_tokens=4, temperature=0)
    # top_k=1 leaves only the argmax, whatever the temperature
    assert _completion_text(client, prompt=PROMPT, max_tokens=4, temperature=1.5,
                            extra_body={"top_k": 1})[0] == greedy
    # a tiny top_p also keeps just the most likely token
    assert _completion_text(client, prompt=PROMPT, max_tokens=4, temperature=1.0, top_p=1e-6)[0] == greedy
    a = _completion_text(client, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7)[0]
    b = _completion_text(client, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7)[0]
    assert a == b
    n = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=3)
    assert len(n.choices) == 3 and n.choices[0].text == a  # choice i uses seed + i
    assert len({c.text for c in n.choices}) > 1


def test_stop_strings_and_stop_token_ids(client, http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                           "return_token_ids": True}).json()
    text, ids = r["choices"][0]["text"], r["choices"][0]["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop, "zzzz"])
    c = cut.choices[0]
    assert c.finish_reason == "stop" and c.text == text[:text.index(stop)]
    assert c.model_extra["stop_reason"] == stop
    assert cut.usage.completion_tokens < 8
    kept = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": stop,
                                              "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == text[:text.index(stop) + len(stop)]
    events = stream_raw(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == c.text
    # stop_token_ids: the third greedy token ends the completion at its first occurrence
    target = ids[2]
    r2 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"stop_token_ids": [target]})
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].model_extra["stop_reason"] == target
    assert r2.usage.completion_tokens == ids.index(target) + 1


def test_ignore_eos_and_min_tokens(client):
    base = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert base.choices[0].finish_reason == "stop" and base.usage.completion_tokens < 6  # "No" + EOS
    forced = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 6
    at_least = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                              extra_body={"min_tokens": 5})
    assert at_least.usage.completion_tokens >= 5


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4 and top[tok] == tlp
        assert tlp == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0)
    assert all(len(t) == 1 for t in zero.choices[0].logprobs.top_logprobs)


# ---- chat ------------------------------------------------------------------------------------------
def test_chat_non_stream_and_usage(client, http):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == count_tokens(http, messages=CHAT)
    assert r.usage.completion_tokens == 6
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 3
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    r3 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r3.choices[0].message.content == r.choices[0].message.content


def test_chat_stream_equals_non_stream(client, http):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 2, "ignore_eos": True}
    full = http.post("/v1/chat/completions", json=body).json()
    events = stream_raw(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    first = events[0]["choices"]
    assert [c["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    texts, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for ev in events[1:-2]:
        (ch,) = ev["choices"]
        assert "role" not in ch["delta"]
        texts[ch["index"]] += ch["delta"]["content"]
        if ch["finish_reason"] is not None:
            reasons[ch["index"]].append(ch["finish_reason"])
    for c in full["choices"]:
        assert texts[c["index"]] == c["message"]["content"] and reasons[c["index"]] == [c["finish_reason"]]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"]


def test_chat_logprobs_and_stop(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob == e.top_logprobs[0].logprob
        assert bytes(e.bytes).decode() == e.token
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
    stop = plain[1:3]
    s = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stop=stop,
                                       extra_body={"ignore_eos": True})
    assert s.choices[0].finish_reason == "stop" and s.choices[0].message.content == plain[:plain.index(stop)]


def test_chat_continue_final_message_and_template_kwargs(client, http):
    """The last (assistant) message is continued, not closed, and template variables are accepted (the
    offline LLM's test shows them reach the template: both go through one function)."""
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The sky is"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "chat_template_kwargs": {"unused": 1}})
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\nThe sky is")
    assert r.usage.prompt_tokens == count_tokens(http, prompt=text, add_special_tokens=False)
    err = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert err.status_code == 400 and "cannot both be true" in err.json()["error"]["message"]


# ---- prefix cache and metrics ----------------------------------------------------------------------
def test_prefix_cache_cached_tokens(client, http):
    prompt = "Once upon a time, in a land far away, there lived a curious fox who loved to read books. " * 2
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    n = first.usage.prompt_tokens
    assert n > 32
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    page = http.get("/metrics").text
    assert metric(page, "vllm:prefix_cache_hits_total") >= (n - 1) // 16 * 16


METRIC_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                "generation_tokens_total", "num_preemptions_total", "request_success_total",
                "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                "prefix_cache_queries_total", "prefix_cache_hits_total")


def test_metrics_names_and_values_move(client, server):
    page = httpx.get(f"{server.url}/metrics").text  # open without the key
    for name in METRIC_NAMES:
        metric(page, f"vllm:{name}")
    before = {n: metric(page, f"vllm:{n}") for n in METRIC_NAMES}
    length_before = metric(page, "vllm:request_success_total", finished_reason="length")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    after_page = httpx.get(f"{server.url}/metrics").text
    after = {n: metric(after_page, f"vllm:{n}") for n in METRIC_NAMES}
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 3
    assert metric(after_page, "vllm:request_success_total", finished_reason="length") == length_before + 1
    for n in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
              "request_queue_time_seconds_count"):
        assert after[n] == before[n] + 1
    assert after["inter_token_latency_seconds_count"] == before["inter_token_latency_seconds_count"] + 2
    assert after["prefix_cache_queries_total"] >= before["prefix_cache_queries_total"] + r.usage.prompt_tokens
    assert after["num_requests_running"] == 0 and after["kv_cache_usage_perc"] == 0


# ---- errors ----------------------------------------------------------------------------------------
def _error(http, path: str, body, status: int, param: str | None = "any", **kw) -> dict:
    r = http.post(path, json=body, **kw) if not isinstance(body, (bytes, str)) else http.post(path, content=body, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 300}, "max_tokens"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 49152], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [[5, -1]], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_400_invalid_input(http, path, body, param):
    err = _error(http, path, body, 400, param)
    assert err["type"] == "invalid_request_error"


INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("path,body,param", [
    # each of these once killed the engine core (the sampler overflowed or drew from NaN probabilities),
    # answered a plain-text 500, or was accepted without a bound
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "top_k": 49153}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "seed": 2**64 - 1, "n": 2}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "seed": -2**63 - 1}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "priority": 2**70}, "priority"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 2**70}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2**70}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "temperature": 1e999}', "temperature"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "top_p": 1e-999}', "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 1000}, "n"),
    ("/v1/completions", {"prompt": [PROMPT] * 9, "max_tokens": 4, "n": 128}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop_token_ids": [49152]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2**64], "max_tokens": 4}, "prompt"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
])
def test_400_out_of_range_values(http, path, body, param):
    err = _error(http, path, body, 400, param, headers={"content-type": "application/json"})
    assert err["type"] == "invalid_request_error"
    assert_serving(http)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
def test_400_non_finite_temperature(http, literal):
    body = '{"prompt": "%s", "max_tokens": 4, "temperature": %s}' % (PROMPT, literal)
    _error(http, "/v1/completions", body, 400, "temperature", headers={"content-type": "application/json"})
    assert_serving(http)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "stop": "\\ud800"}', "stop"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "model": "\\ud800"}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a", "name": "\\udc00"}]}',
     "messages[0].name"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_400_lone_surrogates(http, path, body, param):
    err = _error(http, path, body, 400, param, headers={"content-type": "application/json"})
    assert "lone surrogate" in err["message"]
    assert_serving(http)


def test_extreme_but_valid_sampling_values_are_greedy(client, http):
    """Temperatures below 1e-5 are greedy, and a top_p below float32's range keeps the most likely token."""
    greedy, _ = _completion_text(client, prompt=PROMPT, max_tokens=4, temperature=0)
    for extra in ({"temperature": 5e-324}, {"temperature": 1e-6}, {"temperature": 1.0, "top_p": 1e-46},
                  {"temperature": 1.0, "top_k": 1, "top_p": 5e-324}):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy, extra
    # seed + choice index wraps inside int64: the largest seed with n=2 runs both choices
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "seed": INT64_MAX, "n": 2,
                                           "stream": False})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    assert_serving(http)


def test_400_bad_json_and_wrong_types(http):
    _error(http, "/v1/completions", b'{"prompt": "x", ', 400, headers={"content-type": "application/json"})
    _error(http, "/v1/completions", b"[1, 2]", 400, headers={"content-type": "application/json"})
    _error(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens")
    assert_serving(http)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000)
    assert "maximum context length is 256" in e.value.message


def test_401_api_key(server, http):
    """The key, read from $VLLM_API_KEY (absent from the server's command line), guards every /v1 route."""
    assert KEY.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for scheme in ("bearer", "BEARER", "BeArEr"):  # the scheme is case-insensitive (RFC 7235)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                       headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_serving(http)


def test_404_unknown_model(client, http):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=1)
    err = _error(http, "/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model")
    assert err["code"] == "model_not_found"
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_413_oversized_body(http):
    err = _error(http, "/v1/completions", {"prompt": "x" * 200_000, "max_tokens": 1}, 413)
    assert err["code"] == "request_too_large"

    def chunked():  # no content-length: the bound still holds
        for _ in range(30):
            yield b" " * 10_000
    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert_serving(http)


# ---- load and aborts -------------------------------------------------------------------------------
def test_200_concurrent_streams(server, http):
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=240,
                                 http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256)))
    prompts = [f"Request {i}:" for i in range(200)]
    counts = {p: count_tokens(http, prompt=p) for p in set(prompts)}

    async def one(prompt: str):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.8,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return prompt, chunks

    async def main():
        async with aclient:
            return await asyncio.gather(*(one(p) for p in prompts))

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - t0 < 240
    for prompt, chunks in results:
        usage = chunks[-1].usage
        assert usage.prompt_tokens == counts[prompt] and usage.completion_tokens == 2
        token_chunks = [c for c in chunks[:-1] if c.choices]
        assert len(token_chunks) == 2 and token_chunks[-1].choices[0].finish_reason == "length"
    assert_serving(http)


def test_50_clients_disconnect_mid_stream(server, http):
    async def one(h: httpx.AsyncClient) -> None:
        body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with h.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # leave after the first token: the response closes mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as h:
            await asyncio.gather(*(one(h) for _ in range(50)))

    asyncio.run(main())
    deadline = time.monotonic() + 60
    while True:
        page = http.get("/metrics").text
        usage = metric(page, "vllm:kv_cache_usage_perc")
        running = metric(page, "vllm:num_requests_running")
        if usage == 0 and running == 0:
            break
        assert time.monotonic() < deadline, f"KV usage stuck at {usage} with {running} running"
        time.sleep(0.2)
    assert metric(page, "vllm:request_success_total", finished_reason="abort") >= 50
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200 and time.monotonic() - t0 < 5


def test_non_streaming_disconnect_aborts(server, http):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True},
                   headers=server.headers, timeout=1.5)
    deadline = time.monotonic() + 30
    while metric(http.get("/metrics").text, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.2)
    assert metric(http.get("/metrics").text, "vllm:kv_cache_usage_perc") == 0
