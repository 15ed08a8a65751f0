"""Data parallelism beyond one process tree: two "nodes" on 127.0.0.1 (an API server node with one
replica and a `--headless` node with the other, meeting over TCP at --data-parallel-rpc-port), and
a local Ray cluster (conftest's `ray_cluster`: `ray start --head` bound to 127.0.0.1, small and torn down
by the test) with `--data-parallel-backend ray`. Both replicas serve in each; bundled SmolLM2 on the CPU.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import REPO, SMALL, ServerProcess, free_port, metric
from testbed.runtime.frames import SECRET_ENV

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(420)]


def serve_both(url: str) -> list[float]:
    """Four concurrent completions; the finished count of each replica."""
    async def go() -> None:
        async with httpx.AsyncClient(timeout=120) as h:
            rs = await asyncio.gather(*(h.post(f"{url}/v1/completions", json={
                "prompt": f"Count to {i}:", "max_tokens": 4, "ignore_eos": True}) for i in range(4)))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    asyncio.run(go())
    text = httpx.get(f"{url}/metrics").text
    return [metric(text, "vllm:request_success_total", engine=str(e), finished_reason="length") for e in (0, 1)]


def headless(tmp_path: Path, name: str, *args: str, secret: str | None = "shared") -> tuple[subprocess.Popen, Path]:
    """A headless node with `secret` as its TESTBED_RPC_SECRET (None: unset)."""
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(SECRET_ENV, None)
    if secret is not None:
        env[SECRET_ENV] = secret
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "serve", "--headless", *SMALL, *args], cwd=REPO,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return proc, log


def test_a_headless_node_serves_the_second_replica(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two "nodes" share this host's cores
    monkeypatch.setenv(SECRET_ENV, "shared")  # every node of the deployment is given the same secret
    rpc = str(free_port())
    dp = ["-dp", "2", "--dp-policy", "round_robin", "--data-parallel-size-local", "1",
          "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", rpc]
    # a node without the secret refuses to start, with one line saying how to give it (it exits on its own:
    # the deployment starts meanwhile)
    bare, bare_log = headless(tmp_path, "bare", *dp, "--data-parallel-start-rank", "1", secret=None)
    node, node_log = headless(tmp_path, "node", *dp, "--data-parallel-start-rank", "1")  # before the head: it waits
    head = None
    try:
        head = ServerProcess(*dp, log_dir=tmp_path).wait_ready()
        assert bare.wait(60) == 2 and f"set the environment variable {SECRET_ENV}" in bare_log.read_text()
        assert serve_both(head.url) == [2, 2]
        # at once: a second node claiming the same rank is refused, and a node with another secret is not heard
        # at all (the coordinator drops its frames and says so); the running replica is disturbed by neither
        dup, dup_log = headless(tmp_path, "dup", *dp, "--data-parallel-start-rank", "1")
        forger, _ = headless(tmp_path, "forger", *dp, "--data-parallel-start-rank", "1", secret="not-the-secret")
        try:
            assert dup.wait(120) != 0
            assert "already taken" in dup_log.read_text()
            deadline = time.monotonic() + 120
            while "tag does not match the deployment's secret" not in head.log_text():
                assert time.monotonic() < deadline and forger.poll() is None, head.log_text()
                time.sleep(0.5)
        finally:
            forger.kill()
            forger.wait()
        assert httpx.get(f"{head.url}/health").json() == {"status": "ok"} and serve_both(head.url) == [4, 4]
        assert head.terminate() == 0, head.log_text()
        assert node.wait(60) == 0, node_log.read_text()[-3000:]  # the coordinator told the node to stop
    finally:
        if head is not None:
            head.kill()
        if node.poll() is None:
            node.kill()
            node.wait()


def test_ray_backend_places_both_replicas_as_actors(tmp_path, ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    head = ServerProcess("-dp", "2", "--dp-policy", "round_robin", "--data-parallel-backend", "ray",
                         log_dir=tmp_path).wait_ready()
    try:
        assert serve_both(head.url) == [2, 2]
        assert not [c for c in Path(f"/proc/{head.proc.pid}/task/{head.proc.pid}/children").read_text().split()
                    if b"dp_engine_proc" in Path(f"/proc/{c}/cmdline").read_bytes()], "replicas must be Ray actors"
        assert head.terminate() == 0, head.log_text()
    finally:
        head.kill()
