"""Messages of data-parallel serving: msgspec structs on ZMQ (never pickle), tagged so one decoder
per socket reads its whole union. The single-engine structs of protocol.py are reused as they are.

  API server  --PUSH/PULL (ipc)-->  coordinator:  AddRequest, DPAbort, ReplicaGone, Shutdown
  coordinator --ROUTER/DEALER (tcp, --data-parallel-rpc-port)--> replica input thread:
                 Welcome | Refused, then AddRequest, AbortRequests, Shutdown
  replica main thread --DEALER--> coordinator:  ReplicaReady, Report, ReplicaFailed (the input thread's DEALER:
                 Hello, Heartbeat)
  headless node launcher <--DEALER--> coordinator:  Hello, ReplicaGone / Ping, ReplicaUp, Shutdown
  replica main thread --PUSH (tcp)--> API server:  EngineOutputs
  coordinator --PUSH (tcp)--> API server:  Routed, Unroutable, ReplicaUp, ReplicaDead
"""
from __future__ import annotations

from typing import Union

import msgspec

from testbed.engine.core import ReplicaStats
from testbed.runtime.protocol import AbortRequests, AddRequest, Outputs, Ready, Shutdown


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """First message on a connection to the coordinator. `engine` is the DP rank (a node launcher
    gives its first rank); `engine_config` must equal the coordinator's (same flags on every node)."""

    engine: int
    role: str
    pid: int
    host: str
    engine_config: dict = {}


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    output_addr: str  # where the replica pushes its outputs (the API server)
    heartbeat_interval: float = 1.0  # seconds between the replica's heartbeats (--data-parallel-heartbeat-interval)


class Refused(msgspec.Struct, tag="refused", array_like=True):
    reason: str


class Report(msgspec.Struct, tag="report", array_like=True):
    """Replica `engine`'s n-th stats report, sampled at `sampled` (its time.time()) after it had
    updated `steps` steps; `stats.num_added` counts the adds it had applied."""

    engine: int
    n: int
    steps: int
    sampled: float
    stats: ReplicaStats


class ReplicaReady(msgspec.Struct, tag="replica_ready", array_like=True):
    """The replica's executor is built; `report` is its first stats report."""

    engine: int
    ready: Ready
    report: Report


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    engine: int


class ReplicaFailed(msgspec.Struct, tag="failed", array_like=True):
    """Sent just before a replica process dies of an exception."""

    engine: int
    message: str
    traceback: str = ""


class ReplicaGone(msgspec.Struct, tag="gone", array_like=True):
    """A launcher saw replica `engine`'s process `pid` exit (or its Ray actor die: pid 0). A pid
    other than that of the replica the coordinator accepted for the rank (one it refused) is ignored."""

    engine: int
    reason: str
    pid: int = 0


class DPAbort(msgspec.Struct, tag="dp_abort", array_like=True):
    """Abort these requests on replica `engine` (the coordinator passes an AbortRequests on)."""

    engine: int
    request_ids: list[str]


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """The coordinator is alive (to headless node launchers, every PING_INTERVAL_S)."""


class EngineOutputs(msgspec.Struct, tag="engine_outputs", array_like=True):
    """One step's protocol.Outputs of replica `engine`, and how many adds it has applied (for the API
    server's waiting-queue bound)."""

    engine: int
    num_added: int
    batch: Outputs


class Routed(msgspec.Struct, tag="routed", array_like=True):
    """Where the coordinator sent a request, so the API server sends its abort there (an abort that
    comes before this notice waits for it)."""

    request_id: str
    engine: int


class Unroutable(msgspec.Struct, tag="unroutable", array_like=True):
    """No live replica can take the request (every one died): the API server fails it."""

    request_id: str
    reason: str


class ReplicaUp(msgspec.Struct, tag="replica_up", array_like=True):
    """Replica `engine` built its executor and takes requests from now on; `ready` says what validates
    a request there (every replica must agree)."""

    engine: int
    ready: Ready


class ReplicaDead(msgspec.Struct, tag="replica_dead", array_like=True):
    """Replica `engine` is gone for good (the coordinator routes nothing more there), and why."""

    engine: int
    reason: str


ToCoordinator = Union[AddRequest, DPAbort, ReplicaGone, Shutdown]
FromReplicaSide = Union[Hello, ReplicaReady, Report, Heartbeat, ReplicaFailed, ReplicaGone]
ToReplica = Union[Welcome, Refused, AddRequest, AbortRequests, Shutdown]
ToNode = Union[Ping, ReplicaUp, ReplicaDead, Shutdown]
ToFrontEnd = Union[EngineOutputs, Routed, Unroutable, ReplicaUp, ReplicaDead]

to_coordinator_decoder = msgspec.msgpack.Decoder(ToCoordinator)
from_replica_side_decoder = msgspec.msgpack.Decoder(FromReplicaSide)
to_replica_decoder = msgspec.msgpack.Decoder(ToReplica)
to_node_decoder = msgspec.msgpack.Decoder(ToNode)
to_front_end_decoder = msgspec.msgpack.Decoder(ToFrontEnd)
