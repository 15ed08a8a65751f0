"""vLLM's sampling parameters through `testbed serve` with the official `openai` client (real server on
127.0.0.1, bundled SmolLM2 on the CPU): penalties, logit_bias, bad words and allowed token ids against
transformers' `generate`; structured outputs (response_format, structured_outputs, guided_*); echo with
logprobs and prompt_logprobs; truncate_prompt_tokens; what is refused by name; unknown fields warned once."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch

from server_helpers import running_server, sse_events

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("--enable-prefix-caching", log_dir=tmp_path_factory.mktemp("serve"),
                        env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as h:
        yield h


@pytest.fixture(scope="module")
def tok():
    from testbed.worker.loader import load_tokenizer
    from testbed.worker.smollm2 import default_model_dir
    return load_tokenizer(str(default_model_dir()))


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    from testbed.worker.smollm2 import default_model_dir
    return AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()


def _tokens(http, **body) -> list[int]:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                           "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_logit_bias_and_penalties_act_as_transformers_processors(client, http, tok, hf):
    """The issue's cases: logit_bias -100 on the greedy token removes it; penalties of 2.0 change the output;
    each equals transformers' generate with the same processor."""
    ids = tok.encode(PROMPT)

    def ref(**kw) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, **kw)
        return out[0, len(ids):].tolist()

    base = _tokens(http)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                  logit_bias={str(base[0]): -100})
    assert r.choices[0].logprobs.tokens[0] != tok.decode([base[0]])
    assert _tokens(http, logit_bias={str(base[0]): -100}) == ref(sequence_bias=[[[base[0]], -100.0]])
    assert _tokens(http, repetition_penalty=2.0) == ref(repetition_penalty=2.0) != base
    assert _tokens(http, allowed_token_ids=list(range(300, 700))) == ref(
        prefix_allowed_tokens_fn=lambda b, i: list(range(300, 700)))
    pen = _tokens(http, presence_penalty=2.0, frequency_penalty=2.0, max_tokens=24)
    assert pen != _tokens(http, max_tokens=24)
    assert len(set(pen)) == len(pen) or max(pen.count(t) for t in pen) <= 2
    word = _tokens(http, bad_words=["Paris"])
    assert tok.encode(" Paris", add_special_tokens=False)[-1] not in word and word != base


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_json_schema_chat_validates_at_temperature_1(client):
    """response_format json_schema, several seeds at temperature 1: every reply completes and validates; the
    client's own parse() reads it into its pydantic model."""
    replies = set()
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=1.0, seed=seed, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        replies.add(c.message.content)
    assert len(replies) > 1
    parsed = client.chat.completions.parse(model=MODEL, messages=CHAT, temperature=1.0, seed=7, max_tokens=64,
                                           response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_every_form_of_structured_outputs(client, http):
    def text(path: str, **body) -> str:
        payload = ({"prompt": "Answer:"} if path == "/v1/completions" else {"messages": CHAT}) | {
            "max_tokens": 40, "temperature": 1.0, "seed": 1, **body}
        r = http.post(path, json=payload)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"] if path == "/v1/completions" else c["message"]["content"]

    assert text("/v1/completions", guided_choice=["red", "green", "blue"]) in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text("/v1/chat/completions", guided_regex=r"[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch(r"\([a-c]+\)", text("/v1/completions", structured_outputs={"grammar": 'root ::= "(" [a-c]+ ")"'}))
    assert re.fullmatch(r"[a-z]{4}", text("/v1/chat/completions", structured_outputs={"regex": "[a-z]{4}"}))
    jsonschema.validate(json.loads(text("/v1/completions", guided_json=SCHEMA, max_tokens=64)), SCHEMA)
    obj = text("/v1/chat/completions", response_format={"type": "json_object"}, max_tokens=200)
    assert obj.lstrip()[0] in "{["
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=64, temperature=1.0, seed=2,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_echo_with_logprobs_scores_the_prompt(client, http, tok):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    ids = tok.encode(PROMPT)
    lp = c.logprobs
    assert c.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 3
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(1 <= len(d) <= 3 for d in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    scored = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                                "prompt_logprobs": 1}).json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for t, d, x in zip(ids[1:], scored[1:], lp.token_logprobs[1:]):
        assert d[str(t)]["logprob"] == pytest.approx(x, abs=1e-5) and d[str(t)]["rank"] >= 1
        assert d[str(t)]["decoded_token"] == tok.decode([t])
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                      "echo": True, "logprobs": 2, "stream": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp.tokens and "".join(e["choices"][0]["text"] for e in events) == c.text


def test_chat_prompt_logprobs(http):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    body = r.json()
    plp, n = body["prompt_logprobs"], body["usage"]["prompt_tokens"]
    assert plp[0] is None and len(plp) == n and all(len(d) == 1 for d in plp[1:])


def test_truncate_prompt_tokens(client, tok):
    long = "one two three four five six seven eight nine ten eleven twelve"
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=2, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 5})
    ids = tok.encode(long)
    assert r.usage.prompt_tokens == 5 and r.choices[0].text.startswith(tok.decode(ids[-5:]))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == len(ids)


def test_special_tokens_shown_or_skipped(http):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "allowed_token_ids": [1, 2], "ignore_eos": True}
    hidden = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    shown = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert hidden == "" and shown.startswith("<|im_") and len(shown) > 12


def _error(http, path: str, body: dict, param: str) -> str:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("/v1/completions", {"guided_regex": "(a"}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": SCHEMA, "min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": -0.1}, "min_p"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"truncate_prompt_tokens": 100_000}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_refused_by_name(http, path, body, param):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    _error(http, path, {**base, "max_tokens": 2, **body}, param)


def test_tool_choice_none_and_best_of_n_are_served(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, tool_choice="none")
    assert r.choices[0].message.content is not None
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, best_of=2, temperature=1.0)
    assert len(r.choices) == 2


def test_unknown_fields_are_ignored_with_one_warning(server, http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1, "zz_extra": [2]})
    assert r.status_code == 200, r.text
    lines = [l for l in server.log_text().splitlines() if "present in the request but ignored" in l]
    assert len(lines) == 1 and "frobnicate" in lines[0] and "zz_extra" in lines[0]
