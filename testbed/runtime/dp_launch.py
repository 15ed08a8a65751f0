"""Starting data-parallel replicas on this host (the `mp` backend), GPU placement, and `--headless`.

Placement, as vLLM's: the replica with local index l takes the devices l*TP .. l*TP+TP-1 of this
host, in CUDA_VISIBLE_DEVICES order (every device when unset). With more replicas x TP than
devices, the list wraps around and replicas share GPUs: give each its share through
--gpu-memory-utilization (0.45 each for two on one GPU). Replicas that share a device start one at
a time, each once the previous one is up, and size their KV cache from their own share of the GPU
(TESTBED_SHARED_GPU=1: memory already in use when a replica starts belongs to someone else).
CPU replicas split the host's cores (worker/threads.py).

A headless node (`testbed serve --headless`) runs only replicas: they connect to the coordinator on
the API server's node, and the node launcher tells the coordinator when one of them exits. It stops
on the coordinator's Shutdown, on SIGTERM / SIGINT, or when it has not heard from the coordinator
for HEAD_TIMEOUT_S after first contact.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import msgspec
import zmq

from testbed.runtime import dp_protocol as D
from testbed.runtime import protocol as P
from testbed.runtime.dp_engine_proc import DPEngineProcConfig
from testbed.runtime.engine_proc import EngineProcConfig
from testbed.runtime.frames import Frames
from testbed.worker.threads import cpu_threads

HEAD_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def visible_devices(device: str | None) -> list[str] | None:
    """This host's GPUs in CUDA_VISIBLE_DEVICES order; None for CPU replicas."""
    if device not in (None, "auto", "cuda", "cpu"):
        raise ValueError(f"--device {device}: data-parallel replicas are placed by CUDA_VISIBLE_DEVICES order; give "
                         "--device cuda (or cpu) and set CUDA_VISIBLE_DEVICES to choose the GPUs")
    from testbed.worker.resolve import resolve_device  # torch: imported when replicas are placed, not before
    if resolve_device(device).type != "cuda":
        return None
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def replica_devices(local_index: int, tp: int, devices: list[str]) -> list[str]:
    """The GPUs of the replica with this local index (wrapping around when replicas share GPUs)."""
    if tp > len(devices):
        raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs per replica; this host shows {len(devices)} "
                         f"({', '.join(devices) or 'none'})")
    return [devices[(local_index * tp + i) % len(devices)] for i in range(tp)]


def replica_env(local_index: int, tp: int, size_local: int, devices: list[str] | None) -> dict[str, str]:
    """Environment additions for one local replica process."""
    if devices is None:
        return {}
    env = {"CUDA_VISIBLE_DEVICES": ",".join(replica_devices(local_index, tp, devices))}
    if size_local * tp > len(devices):
        from testbed.worker.resolve import SHARED_GPU_ENV
        env[SHARED_GPU_ENV] = "1"
    return env


def shares_devices(size_local: int, tp: int, devices: list[str] | None) -> bool:
    return devices is not None and size_local * tp > len(devices)


class LocalReplicas:
    """Replica processes of this host (ranks start_rank .. start_rank+size_local-1). Invariant: a
    rank is launched at most once; `poll` reports each exit once."""

    def __init__(self, start_rank: int, size_local: int, coordinator_addr: str, proc: EngineProcConfig,
                 tp: int, device: str | None) -> None:
        self.ranks = list(range(start_rank, start_rank + size_local))
        self.devices = visible_devices(device)
        self.sequential = shares_devices(size_local, tp, self.devices)
        self.coordinator_addr, self.proc_cfg, self.tp = coordinator_addr, proc, tp
        self.threads = 0 if self.devices is not None else cpu_threads(size_local)
        self.procs: dict[int, subprocess.Popen] = {}
        self.reported: set[int] = set()
        self.up: set[int] = set()

    def _launch(self, rank: int) -> None:
        local = rank - self.ranks[0]
        cfg = DPEngineProcConfig(rank, self.coordinator_addr, self.proc_cfg, os.getpid(), self.threads)
        env = {**os.environ, **replica_env(local, self.tp, len(self.ranks), self.devices)}
        self.procs[rank] = subprocess.Popen([sys.executable, "-m", "testbed.runtime.dp_engine_proc",
                                             msgspec.json.encode(cfg).decode()], env=env, start_new_session=True)

    def start(self) -> None:
        """Launch every replica, or only the first when they share GPUs (`on_up` launches the next)."""
        for rank in self.ranks[:1] if self.sequential else self.ranks:
            self._launch(rank)

    def on_up(self, rank: int) -> None:
        self.up.add(rank)
        if self.sequential and rank in self.procs:
            nxt = next((r for r in self.ranks if r not in self.procs), None)
            if nxt is not None:
                self._launch(nxt)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def poll(self) -> list[D.ReplicaGone]:
        """Replicas that exited since the last call."""
        gone = []
        for rank, p in self.procs.items():
            if rank not in self.reported and p.poll() is not None:
                self.reported.add(rank)
                gone.append(D.ReplicaGone(rank, f"its process (pid {p.pid}) exited with code {p.returncode}", p.pid))
        return gone

    @property
    def all_exited(self) -> bool:
        return len(self.procs) == len(self.ranks) and all(p.poll() is not None for p in self.procs.values())

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the replicas to exit (the coordinator told them to), then SIGKILL what is left."""
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def run_headless(start_rank: int, size_local: int, coordinator_addr: str, proc: EngineProcConfig, tp: int,
                 device: str | None, log: Callable[[str], None]) -> int:
    """Run this node's replicas until the coordinator stops them; the exit code."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"n%d-%d" % (start_rank, os.getpid()))
    sock.connect(coordinator_addr)
    frames = Frames.from_env(f"headless node (ranks from {start_rank})")
    sock.send(frames.encode(D.Hello(start_rank, "node", os.getpid(), socket.gethostname())))
    replicas = LocalReplicas(start_rank, size_local, coordinator_addr, proc, tp, device)
    stop = {"signal": None}

    def on_signal(sig, _frame) -> None:
        stop["signal"] = sig
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    replicas.start()
    log(f"headless node: replicas {replicas.ranks[0]}..{replicas.ranks[-1]} (pids {replicas.pids()}) "
        f"connecting to the coordinator at {coordinator_addr}")
    heard, code = None, 0
    try:
        while stop["signal"] is None:
            if sock.poll(500):
                msg = frames.decode(sock.recv(), D.to_node_decoder, "its coordinator socket")
                if msg is not None:
                    heard = time.monotonic()
                if isinstance(msg, D.ReplicaUp):
                    replicas.on_up(msg.engine)
                elif isinstance(msg, P.Shutdown):
                    log("the coordinator asked this node to stop")
                    break
            for gone in replicas.poll():
                log(f"replica {gone.engine} is gone: {gone.reason}")
                sock.send(frames.encode(gone))
            if replicas.all_exited:
                log("every replica of this node exited")
                code = 1
                break
            if heard is not None and time.monotonic() - heard > HEAD_TIMEOUT_S:
                log(f"no word from the coordinator at {coordinator_addr} for {HEAD_TIMEOUT_S:g} s: stopping")
                code = 1
                break
    finally:
        if stop["signal"] is not None or code:
            for p in replicas.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        replicas.stop()
        sock.close(linger=1000)
        ctx.term()
    return code
