"""A data-parallel replica (vLLM's DPEngineCoreProc): EngineCore + executor (TP workers inside) in a
main-thread busy loop, with an input thread and an output thread doing the socket work.

Input thread: receives the coordinator's AddRequest / AbortRequests / Shutdown (ROUTER -> DEALER),
decodes them and queues them for the main thread. Output thread: builds the wire messages of the main thread's
step outputs, encodes and sends them to the API server and its stats reports to the coordinator, and sends the
coordinator a Heartbeat whenever it sent the coordinator nothing for HEARTBEAT_INTERVAL_S, however
busy it is with outputs (the coordinator's liveness check hears from a live replica at least that
often: neither a long step nor a long decode with no stats report looks like a dead replica). Frames
are authenticated (frames.py); the input thread drops a forged or malformed one and carries on. Main thread: apply queued inputs, step once, queue the step's
outputs, report stats when StatsPublisher says so. On any exception it sends ReplicaFailed, then
exits 1; on Shutdown, or when its launcher is gone, it exits 0.

With a log directory it appends DIR/{steps,requests,itl,adds,reports}.R.jsonl (R = its rank), written by the
record log's thread (record_log.py). The main thread's work between one step's update and the next schedule is
the engine's own and two queue puts: every encoding and write is another thread's (that gap is on every
replica's critical path; RESULTS.md "Data parallelism" measures it against a single engine's).
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
from testbed.runtime.record_log import RecordLog
from testbed.engine.stepper import EngineStepper

HEARTBEAT_INTERVAL_S = 1.0
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
        self.outq: queue.SimpleQueue = queue.SimpleQueue()
        self.running = True
        self.num_added = 0
        self.num_reports = 0
        self._held = None  # an input taken off the queue by wait_input, not applied yet
        self.core: EngineCore | None = None
        self.output_thread: threading.Thread | None = None
        self.input_thread: threading.Thread | None = None

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
        return sock

    def _input_loop(self, sock: zmq.Socket) -> None:
        while self.running:
            if sock.poll(100):
                msg = self.frames.decode(sock.recv(), D.to_replica_decoder, "its coordinator socket")
                if msg is not None:
                    self.inq.put(msg)
        sock.close(linger=0)

    def _output_loop(self) -> None:
        front = self.ctx.socket(zmq.PUSH)
        front.setsockopt(zmq.SNDHWM, 0)
        front.connect(self.output_addr)
        coord = self._dealer(b"o")
        beat = self.frames.encode(D.Heartbeat(self.rank))
        last_to_coord = time.monotonic()
        while True:
            wait = last_to_coord + HEARTBEAT_INTERVAL_S - time.monotonic()
            try:
                to_front, msg = self.outq.get(timeout=max(wait, 0.0)) if wait > 0 else self.outq.get_nowait()
            except queue.Empty:
                to_front, msg = False, beat
            if msg is None:
                break
            if to_front:  # a step's outputs: (adds applied, EngineCoreOutputs, stats, first scheduled)
                num_added, outputs, stats, scheduled = msg
                msg = D.EngineOutputs(self.rank, num_added, P.Outputs([to_wire(o) for o in outputs], stats, scheduled))
            (front if to_front else coord).send(msg if msg is beat else self.frames.encode(msg))
            if not to_front:
                last_to_coord = time.monotonic()
        front.close(linger=2000)  # deliver what is queued (a ReplicaFailed above all)
        coord.close(linger=2000)

    def check_parent(self) -> None:
        if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
            raise SystemExit(0)  # the launcher is gone: nobody to serve

    # ---- the replica ---------------------------------------------------------------------------
    def run(self) -> None:
        pc = self.cfg.proc
        if self.cfg.torch_threads:
            import torch
            torch.set_num_threads(self.cfg.torch_threads)
        sock = self.handshake()
        self.output_thread = threading.Thread(target=self._output_loop, name="dp-output", daemon=True)
        self.output_thread.start()
        self.input_thread = threading.Thread(target=self._input_loop, args=(sock,), name="dp-input", daemon=True)
        self.input_thread.start()
        module, name = pc.executor_factory.split(":")
        factory = getattr(importlib.import_module(module), name)
        config = EngineConfig(**pc.engine)
        executor = factory(pc.model, config, load_format=pc.load_format, dtype=pc.dtype, device=pc.device,
                           enforce_eager=pc.enforce_eager, **pc.executor_args)
        self.core = core = EngineCore(config, executor.num_gpu_blocks, executor.max_model_len, replica=self.rank,
                                           num_cpu_blocks=getattr(executor, "num_cpu_blocks", None))
        self.eos, self.vocab_size = executor.eos_token_id, executor.vocab_size
        stepper = EngineStepper(core, executor, time.time, config.async_scheduling)
        stepper.on_scheduled = lambda so: self.outq.put(  # running during the step
            (True, (self.num_added, [], scheduler_stats(core, -1), {})))
        publisher = StatsPublisher(config.dp_stats_interval)
        self.log = RecordLog(pc.log_steps, f".{self.rank}", LOG_KINDS) if pc.log_steps else None
        freeze_startup_heap()
        ready = P.Ready(executor.num_gpu_blocks, config.block_size, executor.max_model_len, executor.eos_token_id,
                        executor.vocab_size, os.getpid(), self.core.block_manager.num_cpu_blocks)
        self.steps_done = 0
        self.outq.put((False, D.ReplicaReady(self.rank, ready, self.report())))
        last_parent_check = time.monotonic()
        try:
            while self.running:
                outputs, aborted = self.apply_inputs(block=not stepper.has_work())
                if not self.running:
                    break
                if aborted and publisher.after_update(time.time(), True, not stepper.has_work()):
                    self.outq.put((False, self.report()))
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
                            self.outq.put((False, self.report()))
                    if not stepped:  # nothing schedulable until an input or a compiled grammar changes things
                        self.wait_input(0.001 if stepper.compiling else 0.01)
                if outputs or stepped:  # made into wire messages and sent on the output thread
                    self.outq.put((True, (self.num_added, outputs, scheduler_stats(core, -1), scheduled)))
                if self.log is not None:
                    self.log.take(core)  # encoded and written on the log's thread
                rec = core.records
                for rows in (rec.steps, rec.requests, rec.itl, rec.grammars, rec.loras):  # a server runs for days
                    rows.clear()
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
        self.outq.put((False, D.ReplicaFailed(self.rank, f"{type(e).__name__}: {e}", tb)))

    def close(self) -> None:
        """Stop the socket threads and end the zmq context. Invariant: the process always gets past close():
        the context is termed only once every socket is closed (term waits for each socket, forever), so a
        thread still stuck after its grace period is left to die with the process, its socket with it."""
        self.running = False
        if self.output_thread is not None:
            self.outq.put((False, None))
            self.output_thread.join(timeout=5)
        if self.input_thread is not None:
            self.input_thread.join(timeout=2)
        if any(t is not None and t.is_alive() for t in (self.output_thread, self.input_thread)):
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
