"""vLLM's `vllm:lora_requests_info` on a real `testbed serve --enable-lora -dp 2` (a tiny random Llama and two PEFT
adapters, CPU, 127.0.0.1): the newest series (its value is the time of the last stats snapshot) names --max-loras
and the adapters of the running and the waiting requests of both replicas, merged, and empties once they end."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_helpers import save_peft_adapter, save_tiny_llama
from server_helpers import running_server

pytestmark = pytest.mark.timeout(300)


def lora_info(page: str) -> tuple[dict[str, str], list[float]]:
    """The labels of the newest lora_requests_info series, and every series' value."""
    fam = {f.name: f for f in text_string_to_metric_families(page)}["vllm:lora_requests_info"]
    assert fam.type == "gauge" and fam.samples
    newest = max(fam.samples, key=lambda s: s.value)
    return newest.labels, [s.value for s in fam.samples]


def names(labels: dict[str, str], key: str) -> list[str]:
    return sorted(labels[key].split(",")) if labels[key] else []


async def wait_info(h: httpx.AsyncClient, check, timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        labels, _ = lora_info((await h.get("/metrics")).text)
        if check(labels):
            return labels
        assert time.monotonic() < deadline, f"lora_requests_info never satisfied the check; newest: {labels}"
        await asyncio.sleep(0.05)


def test_lora_requests_info_names_running_and_waiting_adapters_over_replicas(tmp_path):
    hf = save_tiny_llama(tmp_path / "base", 4, 2, seed=31, max_position_embeddings=4096)
    save_peft_adapter(tmp_path / "a1", hf, 8, ["q_proj", "down_proj"], seed=32)
    save_peft_adapter(tmp_path / "a2", hf, 8, ["v_proj", "up_proj"], seed=33)
    # one sequence a replica: two long requests hold both, a third waits on one of them
    with running_server("--model", str(tmp_path / "base"), "--served-model-name", "base", "--dtype", "float32",
                        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules",
                        f"a1={tmp_path / 'a1'}", f"a2={tmp_path / 'a2'}", "-dp", "2", "--max-num-seqs", "1",
                        "--max-model-len", "4096", "--num-gpu-blocks", "600", log_dir=tmp_path,
                        env={"OMP_NUM_THREADS": "1"}) as srv:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as h:
                labels, values = lora_info((await h.get("/metrics")).text)
                assert labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
                assert abs(values[0] - time.time()) < 600, "the value is a Unix time"

                async def stream(model: str, started: asyncio.Event) -> None:
                    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True,
                            "stream": True}
                    async with h.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_lines():
                            started.set()

                events = [asyncio.Event() for _ in range(2)]
                tasks = [asyncio.ensure_future(stream(m, e)) for m, e in zip(("a1", "a2"), events)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
                tasks.append(asyncio.ensure_future(stream("a1", asyncio.Event())))
                labels = await wait_info(h, lambda la: names(la, "waiting_lora_adapters") == ["a1"])
                assert names(labels, "running_lora_adapters") == ["a1", "a2"] and labels["max_lora"] == "1"
                assert not any(t.done() for t in tasks), "the requests ran out before the check"
                for t in tasks:
                    t.cancel()  # the client goes away: the server aborts them
                await asyncio.gather(*tasks, return_exceptions=True)
                await wait_info(h, lambda la: la["running_lora_adapters"] == la["waiting_lora_adapters"] == "")

        asyncio.run(scenario())
