"""`testbed serve --data-parallel-size 2` on the bundled SmolLM2 (CPU): the DP coordinator process
in front of two replica processes. Every policy spreads concurrent requests over both replicas (as
/metrics shows per `engine`), streaming and aborts reach the right replica, and killing one replica
fails its requests with an error while the other keeps serving (the server stays up); the last
one's death makes the server exit 1. Real servers on 127.0.0.1; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess, metric, replica_pids, sse_events
from testbed.engine.metrics import REQUEST_COLUMNS

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"


def logged(path: Path) -> list[list]:
    """Rows a replica appended to its --log-steps file (none yet if it has not written it)."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def per_engine(text: str, name: str, **labels: str) -> list[float]:
    return [metric(text, name, engine=str(e), **labels) for e in (0, 1)]


async def complete(h: httpx.AsyncClient, url: str, prompt, max_tokens: int = 6) -> dict:
    r = await h.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                                    "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


async def wait_for(h: httpx.AsyncClient, url: str, check, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = (await h.get(f"{url}/metrics")).text
        if check(text):
            return text
        assert time.monotonic() < deadline, f"metrics never satisfied the check:\n{text[-3000:]}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware", "prefix_affinity"])
def test_each_stats_policy_spreads_concurrent_requests_over_both_replicas(tmp_path, policy):
    srv = ServerProcess("-dp", "2", "--dp-policy", policy, "--enable-prefix-caching", log_dir=tmp_path).wait_ready()
    try:
        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as h:
                # distinct 40-token prompts sent together: pending counts spread them before any report
                prompts = [[1000 + 97 * i + k for k in range(40)] for i in range(4)]
                await asyncio.gather(*(complete(h, srv.url, p) for p in prompts))
                text = (await h.get(f"{srv.url}/metrics")).text
                done = per_engine(text, "vllm:request_success_total", finished_reason="length")
                assert sum(done) == 4 and min(done) >= 1, f"{policy}: {done}"
                if policy == "prefix_affinity":  # a prompt sharing a 2-block prefix follows that prefix's replica
                    before = per_engine(text, "vllm:prefix_cache_hits_total")
                    await complete(h, srv.url, prompts[0][:32] + [7] * 8)
                    text = await wait_for(h, srv.url, lambda t: sum(per_engine(t, "vllm:prefix_cache_hits_total"))
                                          > sum(before))
                    assert sum(per_engine(text, "vllm:prefix_cache_hits_total")) - sum(before) == 32
        asyncio.run(scenario())
    finally:
        assert srv.terminate() == 0, srv.log_text()


def test_round_robin_streams_aborts_and_survives_a_dead_replica(tmp_path):
    logs = tmp_path / "steps"
    srv = ServerProcess("-dp", "2", "--dp-policy", "round_robin", "--max-num-seqs", "4", "--log-steps", str(logs),
                        log_dir=tmp_path).wait_ready()
    url = srv.url
    pids = replica_pids(srv)
    assert sorted(pids) == [0, 1], pids

    async def stream(h, max_tokens: int):
        req = h.build_request("POST", f"{url}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
        r = await h.send(req, stream=True)
        assert r.status_code == 200
        return r, r.aiter_lines()

    async def first_token(lines) -> list:
        events = []
        while not any(isinstance(e, dict) and e.get("choices") for e in events):
            events += sse_events([await lines.__anext__()])
        return events

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as h:
            # streaming: round robin puts one request on each replica
            for _ in range(2):
                r, lines = await stream(h, 5)
                events = [e async for line in lines for e in sse_events([line])]
                await r.aclose()
                assert events[-1] == "[DONE]" and len([e for e in events[:-1] if e["choices"]]) >= 2
            text = (await h.get(f"{url}/metrics")).text
            assert per_engine(text, "vllm:request_success_total", finished_reason="length") == [1, 1]
            assert per_engine(text, "vllm:generation_tokens_total") == [5, 5]
            assert per_engine(text, "vllm:request_generation_tokens_sum") == [5, 5]  # vLLM's families, per engine
            assert per_engine(text, "vllm:cache_config_info") == [1, 1]

            # abort: a client that goes away stops its request on the replica that runs it (the next, 0),
            # which records it as aborted (its own log), long before its 240 tokens
            r, lines = await stream(h, 240)
            rid = (await first_token(lines))[0]["id"] + "-0"
            await r.aclose()
            await wait_for(h, url, lambda t: per_engine(t, "vllm:request_success_total",
                                                         finished_reason="abort") == [1, 0])
            deadline = time.monotonic() + 30
            while not any(row[0] == rid for row in logged(logs / "requests.0.jsonl")):
                assert time.monotonic() < deadline, "replica 0 never ended the aborted request"
                await asyncio.sleep(0.1)
            row = next(row for row in logged(logs / "requests.0.jsonl") if row[0] == rid)
            reason = REQUEST_COLUMNS.index("finish_reason")
            assert row[1] == 0 and row[reason] == "abort" and row[8] < 240, row
            assert not any(row[0] == rid for row in logged(logs / "requests.1.jsonl"))

            # a replica dies: its request ends with an error, the other replica's finishes, new ones succeed
            ra, la = await stream(h, 240)   # on replica 1
            rb, lb = await stream(h, 40)    # on replica 0
            await first_token(la)
            await first_token(lb)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            dead_events = [e async for line in la for e in sse_events([line])]
            await ra.aclose()
            assert time.monotonic() - t0 < 30
            errors = [e for e in dead_events if isinstance(e, dict) and "error" in e]
            assert errors and "replica 1" in errors[0]["error"]["message"], dead_events[-3:]
            ok_events = [e async for line in lb for e in sse_events([line])]
            await rb.aclose()
            assert ok_events[-1] == "[DONE]"
            health = await h.get(f"{url}/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert list(health.json()["dead_engines"]) == ["1"]
            for _ in range(3):
                out = await complete(h, url, PROMPT, 3)
                assert out["usage"]["completion_tokens"] == 3
            text = (await h.get(f"{url}/metrics")).text
            assert per_engine(text, "vllm:request_success_total", finished_reason="error")[1] == 1
            assert per_engine(text, "vllm:request_success_total", finished_reason="length")[0] == 1 + 1 + 3
            assert per_engine(text, "vllm:num_requests_running") == [0, 0]

            # the last replica dies: the engine as a whole is dead, its request ends with an error, and the
            # server exits 1 (the default of --keep-alive-on-engine-death)
            rc, lc = await stream(h, 240)
            await first_token(lc)
            os.kill(pids[0], signal.SIGKILL)
            events = [e async for line in lc for e in sse_events([line])]
            await rc.aclose()
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]

    try:
        asyncio.run(scenario())
        assert srv.proc.wait(15) == 1, srv.log_text()
        assert "every data-parallel replica died" in srv.log_text()
    finally:
        srv.kill()
