"""Helpers for the server tests: a real `testbed serve` subprocess on 127.0.0.1 and SSE reading.

Servers run the bundled SmolLM2 on the CPU with a small context and KV cache so they start fast
and stay light; every wait is bounded so a broken server fails a test instead of hanging it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--max-model-len", "256", "--num-gpu-blocks", "320", "--max-num-batched-tokens", "1024",
         "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m testbed.cli serve` in a subprocess; its output goes to a log file in `log_dir`
    (a pytest tmp dir, so old logs are pruned)."""

    def __init__(self, *args: str, log_dir: Path, api_key: str | None = None, env: dict | None = None,
                 key_in_env: bool = False) -> None:
        """`api_key`: given as --api-key, or (`key_in_env`) as $VLLM_API_KEY, out of the process's command line."""
        self.port = free_port()
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="serve-", suffix=".log", dir=log_dir)[1])
        cmd = [sys.executable, "-m", "testbed.cli", "serve", "--port", str(self.port), *SMALL, *args]
        if api_key and not key_in_env:
            cmd += ["--api-key", api_key]
        env = {**{k: v for k, v in os.environ.items() if k not in ("TESTBED_API_KEY", "VLLM_API_KEY")},
               "PYTHONUNBUFFERED": "1", **(env or {})}
        if api_key and key_in_env:
            env["VLLM_API_KEY"] = api_key
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def engine_pid(self) -> int:
        """The engine-core process: the API server's only child."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, f"expected one child (the engine core), got {children}"
        return int(children[0])

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            pid = None
            try:
                pid = self.engine_pid()
            except (OSError, AssertionError, ValueError):
                pass
            self.proc.kill()
            self.proc.wait(30)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log.close()


@contextlib.contextmanager
def running_server(*args: str, log_dir: Path, **kwargs) -> Iterator[ServerProcess]:
    """A ready server for the `with` block (a module fixture's body); afterwards it must stop with exit 0."""
    srv = ServerProcess(*args, log_dir=log_dir, **kwargs)
    try:
        yield srv.wait_ready()
    finally:
        code = srv.terminate()
        assert code == 0, srv.log_text()


def replica_pids(srv: ServerProcess) -> dict[int, int]:
    """DP rank -> pid of the server's replica processes (its children running dp_engine_proc)."""
    pids = {}
    for child in Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split():
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"testbed.runtime.dp_engine_proc" in cmd:
            pids[json.loads(cmd[3])["rank"]] = int(child)
    return pids


def sse_events(lines) -> list:
    """Parsed `data:` payloads of an SSE body ('[DONE]' kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` in a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families
    total, found = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    assert found, f"metric {name} {labels} not on the page"
    return total


def deep_schema(levels: int, required: bool = False) -> dict:
    """A JSON schema of `levels` nested objects (2 JSON levels each) around a string; `required`: each
    object requires its one property."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, **({"required": ["a"]} if required else {})}
    return schema
