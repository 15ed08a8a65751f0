"""A data-parallel replica (vLLM's DPEngineCoreProc): EngineCore + executor (TP workers inside) in a
main-thread busy loop, with an input thread doing the socket waits.

Input thread: receives the coordinator's AddRequest / AbortRequests / Shutdown (ROUTER -> DEALER), decodes them
and queues them for the main thread, and sends the coordinator a Heartbeat every heartbeat interval (the
coordinator's Welcome gives it: --data-parallel-heartbeat-interval, default 1 s) over the same socket, however
long a step is (the coordinator's liveness check hears from a live replica at least that
often: neither a long step nor a long decode with no stats report looks like a dead replica). Frames are
authenticated (frames.py); the input thread drops a forged or malformed one and carries on. Main thread: apply
queued inputs, step once, send the step's outputs to the API server and, when StatsPublisher says so, a stats
report to the coordinator (each over a socket of its own). On any exception it sends ReplicaFailed, then exits 1;
on Shutdown, or when its launcher is gone, it exits 0.

With a log directory it appends DIR/{steps,requests,itl,adds,reports}.R.jsonl (R = its rank), written while
the device runs the next step (record_log.py). Nothing but the input thread's socket waits runs beside the main
thread during a step: Python work on another thread takes the GIL from every torch call of the step, each of
which hands it over (RESULTS.md "Data parallelism" measures a replica's steps and gaps against a single
engine's).
Started as `python -m testbed.runtime.dp_engine_proc CONFIG_JSON`, or run in a Ray actor.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import queue
import signal
import socket
import sys
import threading
import time

import msgspec
import zmq

from testbed.engine.config import EngineConfig
from testbed.engine.coordinator import StatsPublisher
from testbed.engine.core import EngineCore
from testbed.runtime import dp_protocol as D
from testbed.runtime import config_arg, freeze_startup_heap, run_process
from testbed.runtime import protocol as P
from testbed.runtime.frames import Frames
from testbed.runtime.engine_proc import (EngineProcConfig, abort_in_core, add_to_core, first_scheduled,
                                       scheduler_stats, to_wire)
from testbed.runtime.record_log import RecordLog, hand_over
from testbed.engine.stepper import EngineStepper

PARENT_CHECK_S = 1.0
LOG_KINDS = ("steps", "requests", "itl", "adds", "reports", "grammars", "loras")


class DPEngineProcConfig(msgspec.Struct):
    """A replica's launch settings: its global DP rank, where the coordinator listens, and the
    single-engine settings (`proc`: model, load format, executor factory, log directory ...)."""

    rank: int
    coordinator_addr: str
    proc: EngineProcConfig
    parent_pid: int = 0      # exit when this process is no longer the parent (0: never, e.g. a Ray actor)
    torch_threads: int = 0   # CPU replicas sharing a host split its cores (0: torch's default)


class DPEngineProc:
    def __init__(self, cfg: DPEngineProcConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.frames = Frames.from_env(f"dp replica {cfg.rank}")
        self.ctx = zmq.Context()
        self.inq: queue.SimpleQueue = queue.SimpleQueue()  # C queues: a put costs the loop no Python-level lock
        self.running = True
        self.num_added = 0
        self.num_reports = 0
        self._held = None  # an input taken off the queue by wait_input, not applied yet
        self.core: EngineCore | None = None
        self.front: zmq.Socket | None = None  # PUSH to the API server: the main thread's own
        self.coord: zmq.Socket | None = None  # DEALER to the coordinator (reports): the main thread's own
        self.log: RecordLog | None = None
        self.input_thread: threading.Thread | None = None
        self.heartbeat_interval = 1.0  # the coordinator's Welcome sets it

    # ---- sockets and threads -------------------------------------------------------------------
    def _dealer(self, role: bytes) -> zmq.Socket:
        """A connection to the coordinator, named by role, rank and pid (unique per process)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"%s%d-%d" % (role, self.rank, os.getpid()))
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.cfg.coordinator_addr)
        return sock

    def handshake(self) -> zmq.Socket:
        """Connect to the coordinator and wait for its Welcome (RuntimeError if it refuses us)."""
        sock = self._dealer(b"i")
        try:
            sock.send(self.frames.encode(D.Hello(self.rank, "input", os.getpid(), socket.gethostname(),
                                                 self.cfg.proc.engine)))
            msg = None
            while msg is None:
                while not sock.poll(int(PARENT_CHECK_S * 1000)):
                    self.check_parent()
                msg = self.frames.decode(sock.recv(), D.to_replica_decoder, "its coordinator socket")
        except BaseException:
            sock.close(linger=0)  # an unanswered hello would otherwise hold close()'s ctx.term() forever
            raise
        if isinstance(msg, D.Refused):
            raise RuntimeError(f"the DP coordinator refused replica {self.rank}: {msg.reason}")
        if not isinstance(msg, D.Welcome):
            raise RuntimeError(f"the DP coordinator answered {type(msg).__name__} instead of Welcome")
        self.output_addr = msg.output_addr
        self.heartbeat_interval = msg.heartbeat_interval
        return sock

    def _input_loop(self, sock: zmq.Socket) -> None:
        """Queue the coordinator's messages for the main thread, and send it a Heartbeat every
        heartbeat_interval s (over this socket, this thread's alone), however long the main thread's step is."""
        beat = self.frames.encode(D.Heartbeat(self.rank))
        next_beat = time.monotonic()
        while self.running:
            now = time.monotonic()
            if now >= next_beat:
                sock.send(beat)
                next_beat = now + self.heartbeat_interval
            if sock.poll(max(1, min(100, int((next_beat - now) * 1000)))):
                msg = self.frames.decode(sock.recv(), D.to_replica_decoder, "its coordinator socket")
                if msg is not None:
                    self.inq.put(msg)
        sock.close(linger=0)

    def send_coordinator(self, msg) -> None:
        """A report, ReplicaReady or ReplicaFailed to the coordinator, from the main thread."""
        if self.coord is not None:
            self.coord.send(self.frames.encode(msg))

    def send_outputs(self, outputs: list, scheduled: dict[str, float]) -> None:
        """Send a step's outputs (and the core's stats) to the API server, from the main thread: a step's wire
        messages cost tens of microseconds of Python, which on another thread would be taken from the step's
        torch calls, each of which hands the GIL over."""
        batch = P.Outputs([to_wire(o) for o in outputs], scheduler_stats(self.core, -1), scheduled)
        self.front.send(self.frames.encode(D.EngineOutputs(self.rank, self.num_added, batch)), copy=False)

    def set_torch_threads(self) -> None:
        """This replica's share of the host's cores for torch (torch_threads), once torch is loaded: an executor
        without torch (--emulate) never imports it, which would take seconds of the replica's start."""
        torch = sys.modules.get("torch")
        if self.cfg.torch_threads and torch is not None and torch.get_num_threads() != self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)

    def check_parent(self) -> None:
        if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
            raise SystemExit(0)  # the launcher is gone: nobody to serve

    # ---- the replica ---------------------------------------------------------------------------
    def run(self) -> None:
        pc = self.cfg.proc
        sock = self.handshake()
        self.coord = self._dealer(b"o")
        self.input_thread = threading.Thread(target=self._input_loop, args=(sock,), name="dp-input", daemon=True)
        self.input_thread.start()
        module, name = pc.executor_factory.split(":")
        factory = getattr(importlib.import_module(module), name)
        self.set_torch_threads()  # before the model loads, where the executor's module brought torch in
        config = EngineConfig(**pc.engine)
        executor = factory(pc.model, config, load_format=pc.load_format, dtype=pc.dtype, device=pc.device,
                           enforce_eager=pc.enforce_eager, **pc.executor_args)
        self.set_torch_threads()  # where the factory did
        self.core = core = EngineCore(config, executor.num_gpu_blocks, executor.max_model_len, replica=self.rank,
                                           num_cpu_blocks=getattr(executor, "num_cpu_blocks", None))
        self.eos, self.vocab_size = executor.eos_token_id, executor.vocab_size
        stepper = EngineStepper(core, executor, time.time, config.async_scheduling)
        self.front = self.ctx.socket(zmq.PUSH)
        self.front.setsockopt(zmq.SNDHWM, 0)
        self.front.connect(self.output_addr)
        stepper.on_scheduled = lambda so: self.send_outputs([], {})  # running during the step
        publisher = StatsPublisher(config.dp_stats_interval)
        self.log = RecordLog(pc.log_steps, f".{self.rank}", LOG_KINDS) if pc.log_steps else None
        stepper.while_device_runs = self.log.write if self.log is not None else None
        freeze_startup_heap()
        ready = P.Ready(executor.num_gpu_blocks, config.block_size, executor.max_model_len, executor.eos_token_id,
                        executor.vocab_size, os.getpid(), self.core.block_manager.num_cpu_blocks)
        self.steps_done = 0
        self.send_coordinator(D.ReplicaReady(self.rank, ready, self.report()))
        last_parent_check = time.monotonic()
        try:
            while self.running:
                outputs, aborted = self.apply_inputs(block=not stepper.has_work())
                if not self.running:
                    break
                if aborted and publisher.after_update(time.time(), True, not stepper.has_work()):
                    self.send_coordinator(self.report())
                scheduled: dict[str, float] = {}
                stepped = False
                if stepper.has_work():
                    start = time.time()
                    so, step_outputs = stepper.step(start)
                    outputs.extend(step_outputs)
                    scheduled = first_scheduled(core, so, start)
                    updated = stepper.last_updated
                    stepped = not so.is_empty or bool(step_outputs)
                    if updated is not None:
                        self.steps_done += 1
                        changed = (any(o.finished for o in step_outputs) or bool(updated.new_req_ids)
                                   or bool(updated.preempted_req_ids))
                        if publisher.after_update(time.time(), changed, not stepper.has_work()):
                            self.send_coordinator(self.report())
                    if not stepped:  # nothing schedulable until an input or a compiled grammar changes things
                        self.wait_input(0.001 if stepper.compiling else 0.01)
                if outputs or stepped:
                    self.send_outputs(outputs, scheduled)
                hand_over(core, self.log)
                now = time.monotonic()
                if now - last_parent_check > PARENT_CHECK_S:
                    last_parent_check = now
                    self.check_parent()
        finally:
            executor.shutdown()
            if self.log is not None:
                self.log.close()

    def report(self) -> D.Report:
        stats = self.core.stats()
        stats.num_added = self.num_added  # every add it got, malformed ones too
        msg = D.Report(self.rank, self.num_reports, self.steps_done, time.time(), stats)
        self.num_reports += 1
        if self.log is not None:
            self.log.append("reports", [[msg.n, msg.steps, msg.sampled, *dataclasses.astuple(stats)]])
        return msg

    def wait_input(self, timeout: float) -> None:
        """Block until an input arrives (or `timeout`); it is applied first by the next apply_inputs."""
        if self._held is None:
            try:
                self._held = self.inq.get(timeout=timeout)
            except queue.Empty:
                pass

    def apply_inputs(self, block: bool) -> tuple[list, bool]:
        """Apply every queued input (waiting up to PARENT_CHECK_S for the first one when `block`);
        returns the outputs they produced and whether an abort ended a live request."""
        outputs, aborted, adds = [], False, []
        timeout = PARENT_CHECK_S if block else None
        if block and self.log is not None:
            self.log.write(flush=True)  # idle: the records so far are on disk before the wait
        while True:
            msg, self._held = self._held, None
            if msg is None:
                try:
                    msg = self.inq.get(timeout=timeout) if timeout else self.inq.get_nowait()
                except queue.Empty:
                    break
            timeout = None
            if isinstance(msg, P.AddRequest):
                now = time.time()
                self.num_added += 1
                out = add_to_core(self.core, msg, self.eos, self.vocab_size, now)
                adds.append((msg.request_id, now))
                if out is not None:
                    outputs.append(out)
            elif isinstance(msg, P.AbortRequests):
                ended = abort_in_core(self.core, msg.request_ids, time.time())
                outputs.extend(ended)
                aborted = aborted or bool(ended)
            elif isinstance(msg, P.Shutdown):
                self.running = False
                break
        if self.log is not None:
            self.log.append("adds", adds)
        return outputs, aborted

    def fail(self, e: BaseException, tb: str) -> None:
        self.send_coordinator(D.ReplicaFailed(self.rank, f"{type(e).__name__}: {e}", tb))

    def close(self) -> None:
        """Stop the socket threads and end the zmq context. Invariant: the process always gets past close():
        the context is termed only once every socket is closed (term waits for each socket, forever), so a
        thread still stuck after its grace period is left to die with the process, its socket with it."""
        self.running = False
        for sock in (self.front, self.coord):
            if sock is not None:
                sock.close(linger=2000)  # deliver what was sent (a ReplicaFailed above all)
        if self.input_thread is not None:
            self.input_thread.join(timeout=2)
            if self.input_thread.is_alive():
                return
        self.ctx.term()


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(0)


def run_replica(cfg: DPEngineProcConfig) -> int:
    """Run one replica to its end; the exit code (0: shut down, 1: failed)."""
    proc = DPEngineProc(cfg)
    if threading.current_thread() is threading.main_thread():  # SIGTERM: the clean way out (TP workers too)
        signal.signal(signal.SIGTERM, _exit_on_signal)
    return run_process(proc, f"dp replica {cfg.rank}", proc.fail)


def main(argv: list[str] | None = None) -> int:
    cfg = config_arg(argv, DPEngineProcConfig, "dp_engine_proc")
    return 2 if cfg is None else run_replica(cfg)


if __name__ == "__main__":
    sys.exit(main())
