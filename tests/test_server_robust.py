"""Hostile input against one real `testbed serve` (bundled SmolLM2 on the CPU, 127.0.0.1): malformed
bodies get OpenAI-shaped 400s, and a multi-megabyte prompt must not stall /health (tokenization runs
off the event loop)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server_helpers import ServerProcess

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # tiny CPU steps: one thread, no OpenMP spinning against the client
        srv = ServerProcess(log_dir=tmp_path_factory.mktemp("serve-robust"))
    try:
        yield srv.wait_ready()
    finally:
        code = srv.terminate()
        assert code == 0, srv.log_text()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.mark.parametrize("raw,paths", [
    (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b', "max_tokens": 2}', GENERATION + ("/tokenize",)),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", GENERATION + ("/tokenize",)),
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', GENERATION + ("/tokenize",)),
    (b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 20_000 + b"}", GENERATION + ("/tokenize",)),
    (b'{"prompt": "Hi", "max_tokens": 1e999999}', GENERATION),
    (b'{"prompt": "Hi", "max_tokens": 2, "n": -0.0}', GENERATION),
    (b'"just a string"', GENERATION + ("/tokenize",)),
    (b"null", GENERATION + ("/tokenize",)),
    (b"", GENERATION + ("/tokenize",)),
    (b"{}", GENERATION + ("/tokenize",)),
    (b"[]", GENERATION + ("/tokenize",)),
], ids=["nested-900", "nested-100k", "bad-utf8", "20k-digits", "huge-exponent", "float-n", "string", "null",
        "empty", "object", "array"])
def test_malformed_bodies_get_400(server, http, raw, paths):
    for path in paths:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 200


def test_a_huge_prompt_does_not_stall_health(server):
    """A 6 MB prompt takes seconds to tokenize; /health answers all along (the loop is free), then the
    prompt gets its 400 (far beyond the context length)."""
    big = "The quick brown fox jumps over the lazy dog. " * 135_000

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as h:
            task = asyncio.ensure_future(h.post("/v1/completions", json={"prompt": big, "max_tokens": 1}))
            answered = 0
            while not task.done():
                r = await h.get("/health", timeout=10)
                assert r.status_code == 200
                answered += not task.done()
                await asyncio.sleep(0.05)
            r = task.result()
            assert r.status_code == 400 and r.json()["error"]["param"] in ("max_tokens", "messages"), r.text
            return answered

    assert asyncio.run(scenario()) >= 3
