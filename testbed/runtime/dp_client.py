"""The API server's side of data-parallel serving: DPEngineClient, a drop-in for EngineClient.

It starts the DP coordinator process and this node's replicas (the `mp` backend: dp_launch; `ray`:
dp_ray), waits until every replica (those of headless nodes too) is up, then sends each request to
the coordinator, which routes it. Outputs come straight from the replicas (EngineOutputs, tagged
with their replica); the coordinator says where each request went (Routed), so aborts go to the
right replica (an abort that comes before the Routed notice waits for it).

Failure policy: when a replica dies (ReplicaDead from the coordinator, which hears of it from the
replica, a launcher, a failed send or a missed heartbeat), its in-flight requests end at once with
EngineDeadError (the API answers 503 / an error event) and the coordinator routes nothing more
there; the others keep serving, and /health reports the dead replicas. Only when every replica, or
the coordinator, is dead does the client as a whole count as dead (and `on_death` is called). A dead
replica's load leaves the waiting estimate with it, so it cannot hold waiting slots for good.
Invariant: a request id is in `streams` from `add` until its finished output, an abort, or death.
"""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections import defaultdict
from typing import Callable

import msgspec

from testbed.engine.config import EngineConfig
from testbed.runtime import dp_protocol as D
from testbed.runtime import protocol as P
from testbed.runtime.client import WATCH_INTERVAL_S, EngineClient, EngineDeadError
from testbed.runtime.dp_coordinator import CoordinatorConfig
from testbed.runtime.dp_launch import LocalReplicas
from testbed.runtime.engine_proc import EngineProcConfig

BACKENDS = ("mp", "ray")
OUTPUT_SOCKET = "its output socket (replicas and the DP coordinator)"


class DPTopology(msgspec.Struct):
    """Where the replicas run (vLLM's --data-parallel-* flags). `rpc_port` 0: any free port (one
    node only); replicas of other nodes need a fixed one."""

    size_local: int
    address: str = "127.0.0.1"
    rpc_port: int = 0
    backend: str = "mp"
    heartbeat_timeout: float = 30.0  # a replica with no message for this long is dead (--data-parallel-heartbeat-timeout)
    heartbeat_interval: float = 1.0  # a live replica sends a heartbeat this often (--data-parallel-heartbeat-interval)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DPEngineClient(EngineClient):
    """EngineClient's lifecycle (sockets, adds, shutdown, fail_all) with the coordinator as its process
    (`proc`); a request's replica is known once the coordinator routed it."""

    peer = "the DP coordinator"
    engine_of_new = None

    def __init__(self, cfg: EngineProcConfig, topology: DPTopology,
                 on_stats: Callable[[P.SchedulerStats, dict[str, float], int], None] | None = None) -> None:
        self.topology = topology
        if topology.backend == "mp" and topology.size_local < EngineConfig(**cfg.engine).data_parallel_size:
            self.secret_required_for = "a data-parallel deployment with headless nodes"
        super().__init__(cfg, on_stats)
        self.config = EngineConfig(**cfg.engine)
        self.size = self.config.data_parallel_size
        self.engine_by_id: dict[str, int] = {}
        self.pending_aborts: set[str] = set()
        self.readies: dict[int, P.Ready] = {}
        self.dead: dict[int, str] = {}
        self.engine_stats: dict[int, P.SchedulerStats] = {}  # live replicas' last snapshots
        self.applied: dict[int, int] = {}  # adds each live replica has applied
        self.routed: dict[int, int] = {}   # adds routed to each live replica
        self.lost = 0  # adds no live replica will apply (unroutable, or routed to one that died)
        self.replicas = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> P.Ready:
        """Start the coordinator and this node's replicas; return once all replicas are up
        (RuntimeError naming the cause if one fails first)."""
        t = self.topology
        port = self.out.bind_to_random_port(f"tcp://{t.address}")
        output_addr = f"tcp://{t.address}:{port}"
        self.rpc_addr = rpc_addr = f"tcp://{t.address}:{t.rpc_port or free_port(t.address)}"
        self.front_addr = front_addr = f"ipc://{self._tmp}/coordinator"
        ccfg = CoordinatorConfig(self.cfg.engine, front_addr, rpc_addr, output_addr, os.getpid(), self.cfg.log_steps,
                                 t.heartbeat_timeout, t.heartbeat_interval)
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.runtime.dp_coordinator",
                                      msgspec.json.encode(ccfg).decode()], start_new_session=True)
        self.inp.connect(front_addr)
        tp = self.config.tensor_parallel_size * self.config.pipeline_parallel_size  # GPUs per replica
        try:
            if t.backend == "ray":
                from testbed.runtime.dp_ray import RayReplicas
                from testbed.worker.resolve import resolve_device
                cuda = resolve_device(self.cfg.device).type == "cuda"
                self.replicas = await asyncio.to_thread(RayReplicas, self.size, rpc_addr, self.cfg, tp, cuda,
                                                        self.config.gpu_memory_utilization)
            else:
                self.replicas = LocalReplicas(0, t.size_local, rpc_addr, self.cfg, tp, self.cfg.device)
            self.replicas.start()
            while len(self.readies) + len(self.dead) < self.size:
                if await self.out.poll(200):
                    self._handle(self.frames.decode(await self.out.recv(), D.to_front_end_decoder, OUTPUT_SOCKET))
                if self.dead:
                    r, why = next(iter(self.dead.items()))
                    raise RuntimeError(f"data-parallel replica {r} failed during startup: {why} (its error is above)")
                for gone in self.replicas.poll():
                    raise RuntimeError(f"data-parallel replica {gone.engine} failed during startup: {gone.reason} "
                                       "(its error is above)")
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the DP coordinator exited with code {self.proc.returncode} during "
                                       "startup (its error is above)")
            self.ready = self._merge_ready()
        except BaseException:
            await self.shutdown()
            raise
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch_loop())]
        return self.ready

    def _merge_ready(self) -> P.Ready:
        """One Ready for the API server: every replica must agree on what validates a request."""
        rs = [self.readies[r] for r in range(self.size)]
        for field in ("block_size", "max_model_len", "eos_token_id", "vocab_size"):
            values = {getattr(x, field) for x in rs}
            if len(values) > 1:
                raise RuntimeError(f"data-parallel replicas disagree on {field}: {sorted(values, key=str)}; serve the "
                                   "same model with the same flags on every node")
        first = rs[0]
        return P.Ready(min(x.num_gpu_blocks for x in rs), first.block_size, first.max_model_len, first.eos_token_id,
                       first.vocab_size, self.proc.pid, min(x.num_cpu_blocks for x in rs))

    async def _stop_workers(self, timeout: float) -> None:
        """This node's replicas (the coordinator, stopped first, told every replica to stop)."""
        if self.replicas is not None:
            await asyncio.to_thread(self.replicas.stop, timeout)

    @property
    def engine_blocks(self) -> dict[int, int]:
        return {r: ready.num_gpu_blocks for r, ready in self.readies.items()}

    @property
    def dead_engines(self) -> dict[int, str]:
        return dict(self.dead)

    def replica_pids(self) -> dict[int, int]:
        """Pids of this node's replica processes (empty with the ray backend)."""
        return self.replicas.pids() if self.replicas is not None else {}

    def _fail(self, rids: list[str], err: EngineDeadError) -> None:
        for rid in rids:
            stream = self.streams.pop(rid, None)
            self.engine_by_id.pop(rid, None)
            if stream is not None:
                stream.put(err)

    def _replica_dead(self, r: int, reason: str) -> None:
        """Fail replica r's requests and forget its load (the waiting estimate counts live replicas
        only); the engine as a whole dies with its last replica."""
        if r in self.dead:
            return
        self.dead[r] = reason
        self._fail([rid for rid, e in self.engine_by_id.items() if e == r],
                   EngineDeadError(f"data-parallel replica {r} died: {reason}"))
        self.lost += self.routed.pop(r, 0)
        self.applied.pop(r, None)
        last = self.engine_stats.pop(r, None)
        if last is not None and self.on_stats is not None:  # its gauges drop to zero; counters stay
            self.on_stats(msgspec.structs.replace(last, num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                                  running_lora_adapters={}, waiting_lora_adapters={}), {}, r)
        if len(self.dead) == self.size:
            self._die(f"every data-parallel replica died (replica {r}: {reason})")

    def _handle(self, msg) -> None:
        if isinstance(msg, D.EngineOutputs):
            streams, e, batch = self.streams, msg.engine, msg.batch
            for o in batch.outputs:
                stream = streams.get(o.request_id)
                if stream is not None:
                    stream.engines[o.request_id] = e
                    self.engine_by_id[o.request_id] = e
                    stream.put(o)
                    if o.finished:
                        del streams[o.request_id]
                        del self.engine_by_id[o.request_id]
            if e not in self.dead:  # a dead replica's last words count for nothing
                self.engine_stats[e] = batch.stats
                self.applied[e] = msg.num_added
                if self.on_stats is not None:
                    self.on_stats(batch.stats, batch.scheduled, e)
        elif isinstance(msg, D.Routed):
            if msg.engine in self.dead:
                self.lost += 1
            else:
                self.routed[msg.engine] = self.routed.get(msg.engine, 0) + 1
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                stream.engines[msg.request_id] = msg.engine
                self.engine_by_id[msg.request_id] = msg.engine
                if msg.engine in self.dead:
                    self._fail([msg.request_id], EngineDeadError(f"data-parallel replica {msg.engine} died: "
                                                                 f"{self.dead[msg.engine]}"))
            elif msg.request_id in self.pending_aborts:
                self.pending_aborts.discard(msg.request_id)
                self._send(D.DPAbort(msg.engine, [msg.request_id]))
        elif isinstance(msg, D.Unroutable):
            self.lost += 1
            self.pending_aborts.discard(msg.request_id)
            self._fail([msg.request_id], EngineDeadError(f"no data-parallel replica can take it: {msg.reason}"))
        elif isinstance(msg, D.ReplicaUp):
            self.readies[msg.engine] = msg.ready
            self.replicas.on_up(msg.engine)
        elif isinstance(msg, D.ReplicaDead):
            self._replica_dead(msg.engine, msg.reason)

    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle(self.frames.decode(await self.out.recv(), D.to_front_end_decoder, OUTPUT_SOCKET))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an authentic message it cannot handle: nothing can be trusted
            self._die(f"bad message from a data-parallel replica or the coordinator: {e!r}")

    async def _watch_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.proc.poll() is not None:
                self._die(f"the DP coordinator (pid {self.proc.pid}) exited with code {self.proc.returncode}")
                return
            for gone in await asyncio.to_thread(self.replicas.poll):
                self._send(gone)  # the coordinator stops routing there and tells us back

    def _send(self, msg) -> None:
        self._send_data(self.frames.encode(msg))

    # ---- requests ------------------------------------------------------------------------------
    @property
    def num_waiting_estimate(self) -> int:
        """Upper bound on the live replicas' waiting requests: their last reports plus the adds sent
        that none has applied yet (and none is known never to apply)."""
        return (sum(s.num_waiting for s in self.engine_stats.values()) + self.sent_seq + 1 - self.lost
                - sum(self.applied.values()))

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests on their replicas; their streams get nothing more."""
        by_engine: dict[int, list[str]] = defaultdict(list)
        for rid in request_ids:
            if self.streams.pop(rid, None) is None:
                continue
            e = self.engine_by_id.pop(rid, None)
            if e is None:
                self.pending_aborts.add(rid)  # not routed yet: sent on once the Routed notice arrives
            elif e not in self.dead:
                by_engine[e].append(rid)
        for e, rids in by_engine.items():
            self._send(D.DPAbort(e, rids))
