"""LoRA adapters over the server with the official openai client: adapters started with --lora-modules and loaded or
unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter through the client) are models of
/v1/models, chosen by the `model` field, and generate what transformers generates with the adapter merged;
unknown adapters are 404s and refused folders (too high a rank, other target modules, no config) 400s, in
OpenAI's error shape."""
from __future__ import annotations

import openai
import pytest

from llm_helpers import hf_greedy_logprobs, merged, random_prompts, save_peft_adapter, save_tiny_llama
from server_helpers import running_server

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = save_tiny_llama(root / "base", 4, 2, seed=11)
    mats = {"a1": (save_peft_adapter(root / "a1", hf, 8, ["q_proj", "o_proj", "down_proj"], seed=12, std=0.2), 2.0),
            "a2": (save_peft_adapter(root / "a2", hf, 16, ["v_proj", "gate_proj", "up_proj"], seed=13, std=0.2), 1.0)}
    save_peft_adapter(root / "big", hf, 32, ["q_proj"])
    save_peft_adapter(root / "emb", hf, 8, ["q_proj"])  # then made to target the embeddings too
    cfg = root / "emb" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('["q_proj"]', '["q_proj", "embed_tokens"]'))
    prompts = random_prompts([9, 12], 320, seed=14)
    refs = {}
    for name in (None, "a1", "a2"):
        with merged(hf, *mats.get(name, (None,))) as model:
            refs[name] = [hf_greedy_logprobs(model, p, NEW_TOKENS)[0] for p in prompts]
    return root, prompts, refs


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    root = setup[0]
    with running_server("--model", str(root / "base"), "--served-model-name", "base", "--dtype", "float32",
                        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
                        f"a1={root / 'a1'}", log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def _tokens(client, model: str, prompts) -> list[list[int]]:
    out = client.completions.create(model=model, prompt=prompts, max_tokens=NEW_TOKENS, temperature=0.0,
                                    extra_body={"return_token_ids": True})
    assert out.model == model
    return [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]


def test_adapters_load_serve_and_unload(server, client, setup):
    root, prompts, refs = setup
    assert [m.id for m in client.models.list().data] == ["base", "a1"]
    assert client.models.list().data[1].parent == "base"
    assert _tokens(client, "a1", prompts) == refs["a1"]
    assert _tokens(client, "base", prompts) == refs[None]

    # the load and unload endpoints through the openai client's own POST (its errors are OpenAI's shape)
    out = client.post("/load_lora_adapter", body={"lora_name": "a2", "lora_path": str(root / "a2")}, cast_to=str)
    assert "a2" in out
    assert [m.id for m in client.models.list().data] == ["base", "a1", "a2"]
    assert _tokens(client, "a2", prompts) == refs["a2"]

    for name, folder, words in [("big", "big", "exceeds --max-lora-rank"), ("a2", "a2", "already been loaded"),
                                ("emb", "emb", "'embed_tokens'"), ("x", "none", "no adapter_config.json")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(root / folder)}, cast_to=str)
        assert e.value.status_code == 400 and words in e.value.body["message"], e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=prompts[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "`a2`" in e.value.body["message"]

    assert "a2" in client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=str)
    assert [m.id for m in client.models.list().data] == ["base", "a1"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=prompts[0], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.post("/unload_lora_adapter", body={"lora_name": "a2"}, cast_to=str)
    assert e.value.body["type"] == "invalid_request_error"
