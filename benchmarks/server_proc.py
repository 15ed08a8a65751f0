"""A `testbed serve` child process for the benchmarks that time a real server: a free local port, and the wait
for its /health (an error naming the server when it exits or does not answer in time)."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, what: str = "testbed serve") -> None:
    """Return once http://127.0.0.1:port/health answers; RuntimeError if `proc` exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up (exit code {proc.poll()})") from None
            time.sleep(0.5)
