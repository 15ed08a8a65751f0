"""The DP coordinator process: the sans-I/O DPCoordinator of testbed/engine/ behind ZMQ.

It routes every request: the API server pushes each AddRequest here, DPCoordinator.route picks a
replica from the stats reports the replicas sent (StatsPublisher rule, see --dp-stats-interval),
the request goes on to that replica and the API server learns where it went (Routed). Replicas on
any host connect to one TCP port (--data-parallel-rpc-port): Hello, then ReplicaReady once their
executor is built; the coordinator sends them adds and aborts. It tracks each replica's liveness
(a ReplicaFailed message, a launcher's ReplicaGone, a peer that vanished when a request was sent
to it, or no message at all for `heartbeat_timeout` s: a live replica sends one at least every
`heartbeat_interval` s, which its Welcome tells it, however busy), stops routing to a dead one, re-routes the request
that found it gone, and tells the API server (ReplicaDead). Exits on Shutdown (passing it on to
every replica and node launcher) or when the API server is gone.

With `log_dir` it appends its record: routes.jsonl (seq, request id, replica, arrival, routed) and
receipts.jsonl (seq, replica, report number, received); `seq` orders routes and report receipts.
Every frame on its sockets is authenticated (frames.py): a forged or malformed one is dropped and
logged, never acted on. Started as `python -m testbed.runtime.dp_coordinator CONFIG_JSON`.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec
import zmq

from testbed.engine.block_manager import prompt_block_hashes
from testbed.engine.config import EngineConfig
from testbed.engine.coordinator import DPCoordinator
from testbed.runtime import config_arg, run_process
from testbed.runtime import dp_protocol as D
from testbed.runtime import protocol as P
from testbed.runtime.frames import Frames

PING_INTERVAL_S = 2.0
RPC_SOCKET = "--data-parallel-rpc-port"
PARENT_CHECK_S = 1.0


class CoordinatorConfig(msgspec.Struct):
    engine: dict          # EngineConfig fields; every replica's must be equal
    front_addr: str       # bound here (PULL): the API server's adds and aborts
    rpc_addr: str         # bound here (ROUTER): replicas and node launchers connect
    output_addr: str      # the API server's PULL: Routed / ReplicaUp / ReplicaDead go there, and replicas push outputs
    parent_pid: int = 0
    log_dir: str | None = None
    heartbeat_timeout: float = 30.0  # seconds without any message from a replica before it counts as dead
    heartbeat_interval: float = 1.0  # seconds between a replica's heartbeats (told to each in its Welcome)


class CoordinatorProc:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.frames = Frames.from_env("testbed dp coordinator")
        self.config = EngineConfig(**cfg.engine)
        n = self.config.data_parallel_size
        self.coord = DPCoordinator(n, self.config.dp_policy, self.config.block_size,
                                   lora_capacity=self.config.max_cpu_loras)
        self.coord.alive = [False] * n  # a replica gets requests once it is up
        self.coord.capacity = 1 << 62   # prefix-affinity memory: the smallest replica cache, once they are up
        self.dead: dict[int, str] = {}
        self.inputs: dict[int, bytes] = {}     # rank -> the identity of its input thread's DEALER
        self.pids: dict[int, int] = {}         # rank -> pid of the replica accepted for it
        self.nodes: set[bytes] = set()
        self.last_seen = [0.0] * n
        self.seq = 0
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.PULL)
        self.front.setsockopt(zmq.RCVHWM, 0)
        self.front.bind(cfg.front_addr)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished replica raises
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.bind(cfg.rpc_addr)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.connect(cfg.output_addr)
        self.log = None
        if cfg.log_dir:
            d = Path(cfg.log_dir)
            d.mkdir(parents=True, exist_ok=True)
            self.log = {k: open(d / f"{k}.jsonl", "ab") for k in ("routes", "receipts")}
        self.running = True

    def _write(self, kind: str, row: tuple) -> None:
        if self.log is not None:
            self.log[kind].write(msgspec.json.encode(row) + b"\n")

    def _to_front(self, msg) -> None:
        self.out.send(self.frames.encode(msg))

    def _to_nodes(self, msg) -> None:
        data = self.frames.encode(msg)
        for ident in list(self.nodes):
            try:
                self.router.send_multipart([ident, data])
            except zmq.ZMQError:
                self.nodes.discard(ident)  # that node launcher is gone

    def _to_replica(self, r: int, data: bytes) -> bool:
        """Send to replica r's input thread; False (and r marked dead) when it is gone."""
        ident = self.inputs.get(r)
        if ident is None or r in self.dead:
            return False
        try:
            self.router.send_multipart([ident, data])
            return True
        except zmq.ZMQError as e:
            self.mark_dead(r, f"its connection to the coordinator is gone ({e})")
            return False

    def mark_dead(self, r: int, reason: str) -> None:
        if r in self.dead:
            return
        self.dead[r] = reason
        self.coord.set_alive(r, False)
        self._to_front(D.ReplicaDead(r, reason))
        self._to_nodes(D.ReplicaDead(r, reason))
        ident = self.inputs.get(r)
        if ident is not None:  # if it still runs, it must stop: its requests were failed
            try:
                self.router.send_multipart([ident, self.frames.encode(P.Shutdown())])
            except zmq.ZMQError:
                pass
        print(f"testbed dp coordinator: replica {r} is dead: {reason}", file=sys.stderr, flush=True)

    # ---- API server side -----------------------------------------------------------------------
    def on_front(self, raw: bytes) -> None:
        msg = self.frames.decode(raw, D.to_coordinator_decoder, "its API-server socket")
        if isinstance(msg, P.AddRequest):
            self.route(msg, raw)
        elif isinstance(msg, D.DPAbort):
            self._to_replica(msg.engine, self.frames.encode(P.AbortRequests(msg.request_ids)))
        elif isinstance(msg, D.ReplicaGone):
            self.gone(msg)
        elif isinstance(msg, P.Shutdown):
            self.running = False

    def route(self, msg: P.AddRequest, raw: bytes) -> None:
        now = time.time()  # the decision's time: before the replica can have the request
        hashes = ()
        if self.config.dp_policy == "prefix_affinity":
            hashes = prompt_block_hashes(msg.prompt_token_ids, self.config.block_size)
        while True:
            try:
                r = self.coord.route(len(msg.prompt_token_ids), hashes,
                                     0 if msg.lora_request is None else msg.lora_request.lora_int_id)
            except ValueError as e:
                self._to_front(D.Unroutable(msg.request_id, str(e)))
                return
            if self._to_replica(r, raw):
                break  # else r was just found dead: route again among the others
        self._to_front(D.Routed(msg.request_id, r))
        self._write("routes", (self.seq, msg.request_id, r, msg.arrival_time, now))
        self.seq += 1

    # ---- replica side --------------------------------------------------------------------------
    def on_replica(self, ident: bytes, raw: bytes) -> None:
        msg = self.frames.decode(raw, D.from_replica_side_decoder, RPC_SOCKET)
        if msg is None:
            return
        n = self.coord.num_replicas
        if isinstance(msg, D.Hello):
            self.hello(ident, msg)
            return
        if not 0 <= msg.engine < n:
            return
        self.last_seen[msg.engine] = time.monotonic()
        if isinstance(msg, D.Report):
            self.coord.update_stats(msg.engine, msg.stats)
            self._write("receipts", (self.seq, msg.engine, msg.n, time.time()))
            self.seq += 1
        elif isinstance(msg, D.ReplicaReady):
            if msg.engine in self.dead:
                return
            self.coord.update_stats(msg.engine, msg.report.stats)
            self._write("receipts", (self.seq, msg.engine, msg.report.n, time.time()))
            self.seq += 1
            self.coord.capacity = min(self.coord.capacity, msg.ready.num_gpu_blocks)
            self.coord.set_alive(msg.engine, True)
            self._to_front(D.ReplicaUp(msg.engine, msg.ready))
            self._to_nodes(D.ReplicaUp(msg.engine, msg.ready))
        elif isinstance(msg, D.ReplicaFailed):
            self.mark_dead(msg.engine, msg.message)
        elif isinstance(msg, D.ReplicaGone):
            self.gone(msg)

    def gone(self, msg: D.ReplicaGone) -> None:
        if msg.pid and msg.engine in self.pids and self.pids[msg.engine] != msg.pid:
            return  # a process refused for an already taken rank
        self.mark_dead(msg.engine, msg.reason)

    def hello(self, ident: bytes, msg: D.Hello) -> None:
        n = self.coord.num_replicas
        if msg.role == "node":
            self.nodes.add(ident)
            return
        if msg.role != "input":
            return
        problem = None
        if not 0 <= msg.engine < n:
            problem = f"data-parallel rank {msg.engine} is outside 0..{n - 1} (--data-parallel-size {n})"
        elif msg.engine in self.inputs:
            problem = f"data-parallel rank {msg.engine} is already taken; check --data-parallel-start-rank"
        elif msg.engine_config != self.cfg.engine:
            diff = sorted(k for k in set(msg.engine_config) | set(self.cfg.engine)
                          if msg.engine_config.get(k) != self.cfg.engine.get(k))
            problem = ("engine flags differ from the API server's node: "
                       + ", ".join(f"{k} {msg.engine_config.get(k)!r} here vs {self.cfg.engine.get(k)!r}" for k in diff)
                       + "; give every node the same engine flags")
        if problem is not None:
            self.router.send_multipart([ident, self.frames.encode(D.Refused(problem))])
            return
        self.inputs[msg.engine] = ident
        self.pids[msg.engine] = msg.pid
        self.last_seen[msg.engine] = time.monotonic()
        self.router.send_multipart([ident, self.frames.encode(D.Welcome(self.cfg.output_addr, self.cfg.heartbeat_interval))])

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        last_ping = last_check = time.monotonic()
        while self.running:
            for sock, _ in poller.poll(int(PARENT_CHECK_S * 1000)):
                while self.running:
                    try:
                        if sock is self.front:
                            self.on_front(self.front.recv(zmq.NOBLOCK))
                        else:
                            parts = self.router.recv_multipart(zmq.NOBLOCK)
                            if len(parts) == 2:  # [peer identity, frame]
                                self.on_replica(*parts)
                            else:
                                self.frames.drop(RPC_SOCKET, f"a message of {len(parts) - 1} frames, not 1")
                    except zmq.Again:
                        break
            if self.log is not None:
                for f in self.log.values():
                    f.flush()
            now = time.monotonic()
            if now - last_ping >= PING_INTERVAL_S:
                last_ping = now
                self._to_nodes(D.Ping())
            if now - last_check >= PARENT_CHECK_S:
                last_check = now
                for r in range(self.coord.num_replicas):
                    if self.coord.alive[r] and now - self.last_seen[r] > self.cfg.heartbeat_timeout:
                        self.mark_dead(r, f"no message from it for {self.cfg.heartbeat_timeout:g} s")
                if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                    break  # the API server is gone

    def close(self) -> None:
        """Tell every replica and node launcher to stop, then release the sockets."""
        stop = self.frames.encode(P.Shutdown())
        for r in list(self.inputs):
            if r not in self.dead:
                try:
                    self.router.send_multipart([self.inputs[r], stop])
                except zmq.ZMQError:
                    pass
        self._to_nodes(P.Shutdown())
        if self.log is not None:
            for f in self.log.values():
                f.close()
        self.router.close(linger=2000)
        self.front.close(linger=0)
        self.out.close(linger=1000)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    cfg = config_arg(argv, CoordinatorConfig, "dp_coordinator")
    return 2 if cfg is None else run_process(CoordinatorProc(cfg), "testbed dp coordinator")


if __name__ == "__main__":
    sys.exit(main())
