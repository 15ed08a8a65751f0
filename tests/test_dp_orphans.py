"""A DP launcher killed with SIGKILL leaves no process behind: its coordinator and every replica see their
parent go and exit within seconds, whether they were decoding (streaming to a front end that no longer reads
them) or still waiting for a coordinator that never answers their hello."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

LAUNCHER = r"""
import asyncio, json, sys, time
from testbed.engine.config import EngineConfig
from testbed.engine.params import SamplingParams
from testbed.runtime.dp_client import DPEngineClient, DPTopology
from testbed.runtime.engine_proc import EngineProcConfig

config = EngineConfig(data_parallel_size=2, dp_policy="round_robin", max_num_seqs=4, max_model_len=4096)
client = DPEngineClient(EngineProcConfig(engine=config.to_dict(), executor_factory="test_dp_robust:slow_marked"),
                        DPTopology(2))

async def main():
    await asyncio.wait_for(client.start(), 120)
    streams = [client.add(f"r{i}", [20 + i, 21, 22], time.time(),
                          sampling_params=SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0))
               for i in range(4)]
    for s in streams:  # every replica is decoding
        await asyncio.wait_for(s.get(), 60)
    print(json.dumps({"replicas": list(client.replica_pids().values()), "coordinator": client.proc.pid}), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_killed_launcher_leaves_no_coordinator_nor_replica_behind():
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = launcher.stdout.readline()
        assert line, f"the launcher exited with {launcher.wait()} before its replicas decoded"
        info = json.loads(line)
        pids = [*info["replicas"], info["coordinator"]]
        assert len(pids) == 3 and all(alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if alive(p)]
        assert not left, f"processes {left} outlived their killed launcher by 20 s (replicas, then coordinator: {pids})"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


HELLO_ONLY = r"""
import socket, subprocess, sys, time
import msgspec
from testbed.engine.config import EngineConfig
from testbed.runtime.dp_engine_proc import DPEngineProcConfig
from testbed.runtime.engine_proc import EngineProcConfig

with socket.socket() as s:  # a port nobody listens on: the hello stays queued, never answered
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
proc = EngineProcConfig(engine=EngineConfig(max_model_len=4096).to_dict(), executor_factory="test_dp_robust:slow_marked")
cfg = DPEngineProcConfig(0, f"tcp://127.0.0.1:{port}", proc, parent_pid=__import__("os").getpid())
replica = subprocess.Popen([sys.executable, "-m", "testbed.runtime.dp_engine_proc", msgspec.json.encode(cfg).decode()],
                           start_new_session=True)
time.sleep(2)  # it imports, connects and sends its hello
print(replica.pid, flush=True)
time.sleep(600)
"""


def test_a_replica_waiting_for_its_coordinator_exits_when_its_launcher_is_killed():
    """The hello a replica queued for a coordinator that never answers must not hold its exit (a zmq context's
    term waits for every socket, and an unsent message lingers forever by default)."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
           "TESTBED_RPC_SECRET": "a-test-secret"}  # what `testbed serve` sets for its processes
    launcher = subprocess.Popen([sys.executable, "-c", HELLO_ONLY], env=env, stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        line = launcher.stdout.readline()
        assert line, f"the launcher exited with {launcher.wait()} before it started the replica"
        pid = int(line)
        assert alive(pid), "the replica died before its launcher did"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "the replica outlived its killed launcher by 15 s (stuck on its way out)"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
