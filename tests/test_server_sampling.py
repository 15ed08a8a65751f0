"""vLLM's sampling parameters through `testbed serve` with the official `openai` client (one real server on
127.0.0.1, bundled SmolLM2 on the CPU): penalties, logit_bias, bad words and allowed token ids against
transformers' `generate` with the same processors; min_p against the reported logprobs; structured
outputs (response_format, structured_outputs, guided_*); echo with logprobs and prompt_logprobs;
truncate_prompt_tokens, include_stop_str_in_output and the special-token options; what is refused by name;
unknown fields ignored with one warning; the API reference (docs/api.md) lists exactly the request fields."""
from __future__ import annotations

import json
import math
import re
import uuid

import jsonschema
import openai
import pydantic
import pytest
import torch

from llm_helpers import OpenAIPenalties, hf_greedy
from server_helpers import REPO, deep_schema, running_server, sse_events

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
NEW = 12

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one OpenMP thread: tiny CPU steps, no spinning against the client on 2 cores
    with running_server(log_dir=tmp_path_factory.mktemp("serve-sampling"), env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


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


def _completion(client, prompt: str = PROMPT, max_tokens: int = NEW, temperature: float = 0.0, **kw):
    """/v1/completions through the client: OpenAI's own parameters as keyword arguments, vLLM's in extra_body."""
    extra = kw.pop("extra_body", {})
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                     extra_body={"return_token_ids": True, **extra}, **kw)


def _ids(client, **kw) -> list[int]:
    return _completion(client, **kw).choices[0].model_extra["token_ids"]


def test_processing_acts_as_transformers_processors(client, tok, hf):
    """The issue's cases: logit_bias -100 on the greedy token never emits it, penalties of 2.0 change the
    output; each output equals transformers' greedy generate with the same processor on the same model."""
    ids = tok.encode(PROMPT)
    base = _ids(client)
    paris = [tok.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    cases = [  # (our request, transformers generate's processor arguments)
        (dict(logit_bias={str(base[0]): -100}), dict(sequence_bias=[[[base[0]], -100.0]])),
        (dict(presence_penalty=2.0), dict(logits_processor=[OpenAIPenalties(len(ids), 0.0, 2.0)])),
        (dict(frequency_penalty=2.0), dict(logits_processor=[OpenAIPenalties(len(ids), 2.0, 0.0)])),
        (dict(extra_body={"repetition_penalty": 2.0}), dict(repetition_penalty=2.0)),
        (dict(extra_body={"allowed_token_ids": list(range(300, 700))}),
         dict(prefix_allowed_tokens_fn=lambda b, i: list(range(300, 700)))),
        (dict(extra_body={"bad_words": ["Paris"]}), dict(bad_words_ids=paris)),
    ]
    got = [_ids(client, **ours) for ours, _ in cases]
    wrong = [ours for (ours, theirs), g in zip(cases, got) if g != hf_greedy(hf, ids, NEW, **theirs)]
    assert not wrong
    assert base not in got  # every one changes the greedy output
    assert base[0] not in _ids(client, logit_bias={str(base[0]): -100})
    assert "Paris" in tok.decode(base) and "Paris" not in _completion(client, extra_body={"bad_words": ["Paris"]}
                                                                      ).choices[0].text


def test_min_p_drops_tokens_below_its_share_of_the_top_one(client):
    """At temperature 1 the reported logprobs are the sampling distribution: with min_p every sampled token
    has at least min_p times the top token's probability; without it some sequence samples below that."""
    floor = math.log(0.2)

    def below(**extra) -> int:
        r = _completion(client, temperature=1.0, seed=0, n=4, logprobs=1, extra_body=extra)
        return sum(x < max(top.values()) + floor - 1e-4 for c in r.choices
                   for x, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs))

    assert below() > 0
    assert below(min_p=0.2) == 0
    r = _completion(client, temperature=1.0, seed=0, n=2, extra_body={"min_p": 1.0})
    assert [c.model_extra["token_ids"] for c in r.choices] == [_ids(client)] * 2  # only the argmax is left


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_json_schema_chat_validates_at_temperature_1(client):
    """response_format json_schema, several seeds at temperature 1: every reply completes and validates; the
    client's own parse() reads it into its pydantic model."""
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, seed=0, n=4, max_tokens=64,  # choice i: seed i
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 1
    parsed = client.chat.completions.parse(model=MODEL, messages=CHAT, temperature=1.0, seed=7, max_tokens=64,
                                           response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_every_form_of_structured_outputs(client):
    """vLLM's forms (extra_body) on both endpoints, and response_format json_object: the text is in the language."""
    def text(chat: bool, max_tokens: int = 40, **extra) -> tuple[str, str]:
        kw = dict(model=MODEL, max_tokens=max_tokens, temperature=1.0, seed=1, extra_body=extra)
        if chat:
            c = client.chat.completions.create(messages=CHAT, **kw).choices[0]
            return c.message.content, c.finish_reason
        c = client.completions.create(prompt="Answer:", **kw).choices[0]
        return c.text, c.finish_reason

    assert text(False, guided_choice=["red", "green", "blue"]) in (("red", "stop"), ("green", "stop"), ("blue", "stop"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(True, guided_regex=r"[0-9]{3}-[a-z]{2}")[0])
    assert re.fullmatch(r"\([a-c]+\)", text(False, guided_grammar='root ::= "(" [a-c]+ ")"')[0])
    assert text(False, structured_outputs={"grammar": 'root ::= ("yes" | "no") "!"'})[0] in ("yes!", "no!")
    assert re.fullmatch(r"[a-z]{4}", text(True, structured_outputs={"regex": "[a-z]{4}"})[0])
    assert text(True, structured_outputs={"choice": ["yes", "no"]})[0] in ("yes", "no")
    for chat, extra in ((False, {"guided_json": SCHEMA}), (True, {"structured_outputs": {"json": SCHEMA}}),
                        (False, {"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "p", "schema": SCHEMA}}})):
        out, reason = text(chat, max_tokens=64, **extra)
        assert reason == "stop", out
        jsonschema.validate(json.loads(out), SCHEMA)
    compact, _ = text(False, max_tokens=64, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    jsonschema.validate(json.loads(compact), SCHEMA)
    assert compact == json.dumps(json.loads(compact), ensure_ascii=False)  # no free whitespace
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
                                       max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), (dict, list))


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
    scored = _completion(client, max_tokens=1, extra_body={"prompt_logprobs": 1}).choices[0].model_extra[
        "prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for t, d, x in zip(ids[1:], scored[1:], lp.token_logprobs[1:]):
        assert d[str(t)]["logprob"] == pytest.approx(x, abs=1e-5) and d[str(t)]["rank"] >= 1
        assert d[str(t)]["decoded_token"] == tok.decode([t]) and len(d) <= 2
    assert any(d[str(t)]["rank"] > 1 for t, d in zip(ids[1:], scored[1:]))  # a prompt is not the greedy path
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                      "echo": True, "logprobs": 2, "stream": True}) as s:
        events = [e for e in sse_events(s.iter_lines()) if e != "[DONE]"]
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == lp.tokens
    assert "".join(e["choices"][0]["text"] for e in events) == c.text


def test_chat_prompt_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0})
    plp, n = r.model_extra["prompt_logprobs"], r.usage.prompt_tokens
    assert plp[0] is None and len(plp) == n and all(len(d) == 1 for d in plp[1:])


def test_front_end_fields(client, tok):
    """truncate_prompt_tokens keeps the prompt's tail; include_stop_str_in_output keeps the stop string;
    skip_special_tokens hides special tokens (shown, they decode as the tokenizer does, with or without
    spaces_between_special_tokens: this tokenizer's decoder puts no space before them)."""
    long = "one two three four five six seven eight nine ten eleven twelve"
    ids = tok.encode(long)
    r = _completion(client, prompt=long, max_tokens=2, echo=True, extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5 and r.choices[0].text.startswith(tok.decode(ids[-5:]))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7
    r = _completion(client, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == len(ids)

    stop = _completion(client).choices[0].text.split()[1]
    cut, kept = (_completion(client, stop=[stop], extra_body={"include_stop_str_in_output": k}).choices[0]
                 for k in (False, True))
    assert kept.text == cut.text + stop and kept.finish_reason == cut.finish_reason == "stop"
    assert kept.model_extra["stop_reason"] == stop

    special = {"allowed_token_ids": [1, 2], "ignore_eos": True}
    hidden = _completion(client, max_tokens=3, extra_body=special).choices[0]
    shown = [_completion(client, max_tokens=3, extra_body={**special, "skip_special_tokens": False,
                                                           "spaces_between_special_tokens": s}).choices[0]
             for s in (True, False)]
    assert hidden.text == "" and hidden.model_extra["token_ids"] == shown[0].model_extra["token_ids"]
    assert shown[0].text == shown[1].text == tok.decode(shown[0].model_extra["token_ids"])
    assert shown[0].text.startswith("<|im_") and len(shown[0].text) > 12


DEEP_SCHEMA = deep_schema(300)  # 600 JSON levels: parse time grows steeply with depth


def _error(http, path: str, body: dict, param: str) -> str:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


@pytest.mark.parametrize("path, body, param", [
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
    ("/v1/completions", {"priority": 1}, "priority"),
    # a schema that refers outside itself would silently mean "any JSON"; depth and size are bounded
    ("/v1/completions", {"guided_json": {"$ref": "file:///etc/passwd"}}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/s.json"}}}}}}, "response_format"),
    ("/v1/completions", {"guided_json": DEEP_SCHEMA}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a" * (256 * 1024 + 1)}, "guided_regex"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(129)]}, "stop"),
    ("/v1/completions", {"stop": ["x" * 1025]}, "stop"),
])
def test_bad_values_refused_by_name(http, path, body, param):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    _error(http, path, {**base, "max_tokens": 2, **body}, param)


@pytest.mark.parametrize("endpoint, kw, param", [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
])
def test_what_is_not_built_is_refused_by_name(client, endpoint, kw, param):
    """Tool calling and best_of > n: a 400 naming the parameter, as the official client raises it."""
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kw)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constraints_that_exclude_every_token_get_a_400(client, temperature):
    """allowed_token_ids that the grammar never allows leave no token: a 400 saying so, and the engine goes on."""
    with pytest.raises(openai.BadRequestError, match="no token is left to sample"):
        _completion(client, temperature=temperature, extra_body={"allowed_token_ids": [0], "guided_choice": ["0"]})
    assert _completion(client, max_tokens=2).choices[0].finish_reason == "length"


def test_tool_choice_none_and_best_of_n_are_served(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, tool_choice="none", tools=[])
    assert r.choices[0].message.content is not None
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, best_of=2, temperature=1.0)
    assert len(r.choices) == 2


def test_unknown_fields_are_ignored_with_one_warning_per_request(server, client):
    """Each request with unknown fields logs exactly one line naming them all; the output is as without them."""
    base = _ids(client)
    names = [f"zz_{uuid.uuid4().hex[:8]}" for _ in range(4)]
    assert _ids(client, user="u1", extra_body={names[0]: 1, names[1]: [2]}) == base
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={names[2]: {}, names[3]: 0})
    assert r.choices[0].message.content is not None
    log = server.log_text().splitlines()
    for fields in (names[:2], names[2:]):
        lines = [line for line in log if fields[0] in line]
        assert len(lines) == 1 and "ignored" in lines[0] and all(f in lines[0] for f in fields), lines
    assert "'user'" in next(line for line in log if names[0] in line)


def test_the_api_reference_lists_exactly_the_request_fields():
    """The API reference (docs/api.md, which the README links) names every request field the server has, and no
    other: a field cannot be added (or kept) without saying what it does."""
    from testbed.server.schemas import ChatCompletionRequest, CompletionRequest
    section = (REPO / "docs" / "api.md").read_text()
    assert "docs/api.md" in (REPO / "README.md").read_text()
    listed = set(re.findall(r"^- \*\*[^*]+\*\*:(.*)$", section, re.M))
    named = {n for line in listed for n in re.findall(r"`([a-z_]+)`", line)}
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert named == fields, (sorted(fields - named), sorted(named - fields))


def test_use_beam_search_through_extra_body(client, tok, hf):
    """vLLM's `use_beam_search` with n beams: /v1/completions returns transformers' beams best first (EOS
    ignored, fixed length), /v1/chat/completions n beams of the conversation; what a beam search cannot take is
    refused by name."""
    import copy
    ids = tok.encode(PROMPT)
    out = _completion(client, max_tokens=5, n=3, extra_body={"use_beam_search": True, "ignore_eos": True})
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          generation_config=config, num_beams=3, num_return_sequences=3, do_sample=False,
                          max_new_tokens=5)
    assert [c.model_extra["token_ids"] for c in out.choices] == [r[len(ids):] for r in ref.tolist()]
    assert [c.index for c in out.choices] == [0, 1, 2] and {c.finish_reason for c in out.choices} == {"length"}
    assert out.choices[0].text == tok.decode(ref[0, len(ids):]) and out.usage.completion_tokens == 15
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=4, n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="use_beam_search does not take stop"):
        _completion(client, n=2, stop=["."], extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="n \\(the beam width\\)"):
        _completion(client, n=11, extra_body={"use_beam_search": True})
