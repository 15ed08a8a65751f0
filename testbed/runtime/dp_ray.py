"""`--data-parallel-backend ray`: every replica is a Ray actor in one placement group on an existing
Ray cluster (RAY_ADDRESS, or the local cluster `ray start --head` made). No cluster manager here:
Ray places the replicas, and the same replica code as the `mp` backend runs inside each actor.

A bundle holds one replica: 1 CPU, and on GPUs `tensor_parallel_size` GPUs (its TP workers are
processes of the actor on that node), or with TP 1 a `--gpu-memory-utilization` fraction of one
GPU, so replicas with a split utilization share GPUs as in the `mp` backend (then they start one at
a time). The actors live as long as the API server's Ray driver.
"""
from __future__ import annotations

import os
from pathlib import Path

import msgspec

from testbed.runtime import dp_protocol as D
from testbed.runtime.dp_engine_proc import DPEngineProcConfig
from testbed.runtime.dp_launch import STOP_TIMEOUT_S
from testbed.worker.resolve import SHARED_GPU_ENV
from testbed.runtime.engine_proc import EngineProcConfig
from testbed.runtime.frames import SECRET_ENV, deployment_secret

PLACEMENT_TIMEOUT_S = 120.0


class ReplicaActor:
    """Runs one replica (dp_engine_proc.run_replica) inside a Ray worker process."""

    def run(self, cfg_json: str) -> int:
        from testbed.runtime.dp_engine_proc import run_replica
        return run_replica(msgspec.json.decode(cfg_json, type=DPEngineProcConfig))


class RayReplicas:
    """Replica actors of ranks 0..size-1, with the interface of dp_launch.LocalReplicas."""

    def __init__(self, size: int, coordinator_addr: str, proc: EngineProcConfig, tp: int, cuda: bool,
                 gpu_memory_utilization: float) -> None:
        import ray
        from ray.util.placement_group import placement_group
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=True)
        self.ray = ray
        gpus = (gpu_memory_utilization if tp == 1 else float(tp)) if cuda else 0.0
        self.sequential = 0.0 < gpus < 1.0
        bundle = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster cannot place {size} replicas of {bundle} within "
                               f"{PLACEMENT_TIMEOUT_S:g} s (it has {ray.cluster_resources()}); add nodes or lower "
                               "--data-parallel-size") from None
        repo = str(Path(__file__).resolve().parents[2])
        env = {"PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
               SECRET_ENV: deployment_secret()}  # the actors authenticate their frames as local replicas do
        if self.sequential:
            env[SHARED_GPU_ENV] = "1"
        self.actor_cls = ray.remote(ReplicaActor)
        self.actor_options = {"num_cpus": 1, "num_gpus": gpus, "runtime_env": {"env_vars": env}}
        self.size, self.coordinator_addr, self.proc_cfg = size, coordinator_addr, proc
        self.actors: dict[int, object] = {}
        self.refs: dict[int, object] = {}
        self.reported: set[int] = set()

    def _launch(self, rank: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        actor = self.actor_cls.options(**self.actor_options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=rank)).remote()
        cfg = DPEngineProcConfig(rank, self.coordinator_addr, self.proc_cfg)
        self.actors[rank] = actor
        self.refs[rank] = actor.run.remote(msgspec.json.encode(cfg).decode())

    def start(self) -> None:
        for rank in range(1 if self.sequential else self.size):
            self._launch(rank)

    def on_up(self, rank: int) -> None:
        if self.sequential and rank + 1 < self.size and rank + 1 not in self.actors:
            self._launch(rank + 1)

    def pids(self) -> dict[int, int]:
        return {}

    def poll(self) -> list[D.ReplicaGone]:
        """Replica actors that ended since the last call."""
        live = {ref: rank for rank, ref in self.refs.items() if rank not in self.reported}
        if not live:
            return []
        done, _ = self.ray.wait(list(live), num_returns=len(live), timeout=0)
        gone = []
        for ref in done:
            rank = live[ref]
            self.reported.add(rank)
            try:
                reason = f"its Ray actor returned exit code {self.ray.get(ref)}"
            except Exception as e:  # noqa: BLE001 - the actor died: Ray says how
                reason = f"its Ray actor died: {type(e).__name__}: {str(e)[:300]}"
            gone.append(D.ReplicaGone(rank, reason))
        return gone

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the actors to return (the coordinator told them to stop), kill the rest, free the group."""
        ray = self.ray
        from ray.util.placement_group import remove_placement_group
        if self.refs:
            ray.wait(list(self.refs.values()), num_returns=len(self.refs), timeout=timeout)
        for actor in self.actors.values():
            ray.kill(actor)
        remove_placement_group(self.pg)
        ray.shutdown()
