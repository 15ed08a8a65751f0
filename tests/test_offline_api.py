"""The offline LLM as a vLLM user writes it: a hub id found in a local Hugging Face cache (this test builds one
with the bundled model's files; nothing is downloaded), vLLM's engine arguments accepted or refused with a clear
error, chat with content-part lists and template variables, and a progress bar."""
from __future__ import annotations

import shutil

import pytest

from testbed import LLM, SamplingParams

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(300)]
REPO_ID = "testorg/SmolLM2-copy"
REVISION = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def fake_hub_cache(root, repo_id: str, files_from) -> None:
    """The local Hugging Face cache layout of one model: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True)
    for f in files_from.iterdir():
        if f.is_file():
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    from testbed.worker.smollm2 import default_model_dir
    root = tmp_path_factory.mktemp("hf") / "hub"
    fake_hub_cache(root, REPO_ID, default_model_dir())
    return root


@pytest.fixture(scope="module")
def llm(hub_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(hub_cache))
    try:
        yield LLM(REPO_ID, max_model_len=512, max_num_seqs=8, trust_remote_code=False, scheduling_policy="fcfs",
                  kv_cache_dtype="auto", disable_log_stats=True, runner="generate")
    finally:
        mp.undo()


def test_hub_id_resolves_through_the_local_cache(llm, hub_cache, monkeypatch, tmp_path):
    from testbed.worker.hub import resolve_model
    assert llm.executor.model_path == str(hub_cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / REVISION)
    out = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text  # the bundled weights, read from the cache, answer
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))  # HF_HOME/hub is the cache too
    assert resolve_model(REPO_ID).endswith(REVISION)
    assert resolve_model(REPO_ID, revision=REVISION).endswith(REVISION)
    with pytest.raises(FileNotFoundError, match="does not hold it; nothing is downloaded"):
        resolve_model("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(FileNotFoundError, match=f"at revision 'v9'"):
        resolve_model(REPO_ID, revision="v9")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "hub")):
        LLM(REPO_ID)


@pytest.mark.parametrize("kwargs,match", [
    ({"quantization": "awq"}, "weights load unquantized"),
    ({"pipeline_parallel_size": 2, "async_scheduling": True}, "already keeps several batches in flight"),
    ({"enable_lora": True, "max_lora_rank": 7}, "--max-lora-rank: must be one of"),
    ({"speculative_config": {"method": "ngram"}}, "no speculative decoding"),
    ({"kv_cache_dtype": "fp8"}, "model's dtype"),
    ({"not_an_argument": 1}, "not an engine argument"),
])
def test_engine_arguments_are_refused_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_chat_content_parts_template_and_its_variables(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "user", "content": "What is the capital\nof France?"}]
    a, b = (llm.chat(m, GREEDY, use_tqdm=False)[0] for m in (parts, plain))
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].text == b.outputs[0].text
    template = "{{ greeting }}:{% for m in messages %} {{ m['content'] }}{% endfor %}"
    out = llm.chat(plain, GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "Q"},
                   add_generation_prompt=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Q: What is the capital\nof France?", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(ValueError, match="tool calling is not supported"):
        llm.chat(plain, GREEDY, tools=[{"type": "function", "function": {"name": "f"}}])


def test_use_tqdm_shows_a_progress_bar(llm, capsys):
    llm.generate(["a", "b"], GREEDY)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "2/2" in err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    llm.embed(["a"], use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.embed(["a", "b", "c"])
    assert "3/3" in capsys.readouterr().err


def test_request_output_objects_and_metrics(llm):
    import time

    from testbed import CompletionOutput, RequestMetrics, RequestOutput
    t0 = time.time()
    (out,) = llm.generate("Once upon a time", SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1),
                          use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == "Once upon a time"
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(isinstance(c, CompletionOutput) and c.finished() and len(c.token_ids) == 4 for c in out.outputs)
    m = out.metrics
    assert isinstance(m, RequestMetrics)
    assert t0 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time <= time.time()
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)


def test_logprobs_are_vllms_logprob_dicts(llm):
    from testbed import Logprob
    (out,) = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                                     prompt_logprobs=1), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 3
    for tok, d in zip(c.token_ids, c.logprobs):
        assert next(iter(d)) == tok and all(isinstance(v, Logprob) for v in d.values())
        assert d[tok].rank == 1 and d[tok].decoded_token == llm.tokenizer.decode([tok])  # greedy: the most likely
        assert sorted(v.rank for t, v in d.items()) == [1, 2]  # the token is one of the top 2
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(out.prompt_token_ids)
    for t, d in zip(out.prompt_token_ids[1:], plp[1:]):
        assert next(iter(d)) == t and d[t].rank >= 1 and d[t].decoded_token == llm.tokenizer.decode([t])
        assert 1 in {v.rank for v in d.values()} and len(d) <= 2
