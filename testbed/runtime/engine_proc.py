"""The engine-core process: EngineCore + executor in a busy loop, fed and drained over ZMQ.

Loop: read every pending message (blocking only while idle), step once if anything is unfinished,
send that step's token deltas with a stats snapshot. The loop depends only on the executor
interface (execute / num_gpu_blocks / max_model_len / eos_token_id / vocab_size / shutdown).
Exits 0 on Shutdown or when its parent is gone; on any exception it sends EngineError first
and exits 1, so the API server can fail in-flight requests at once instead of waiting.
Started as `python -m testbed.runtime.engine_proc CONFIG_JSON` (see EngineProcConfig).
"""
from __future__ import annotations

import importlib
import os
import sys
import time

import msgspec
import zmq

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.outputs import EngineCoreOutput
from testbed.engine.params import check_token_ids
from testbed.engine.request import Request
from testbed.runtime import config_arg, freeze_startup_heap, run_process
from testbed.runtime import protocol as P
from testbed.runtime.frames import Frames
from testbed.runtime.record_log import RecordLog, hand_over
from testbed.engine.stepper import EngineStepper
from testbed.worker.threads import set_engine_threads

PARENT_CHECK_S = 1.0


class EngineProcConfig(msgspec.Struct):
    """Everything the process needs, passed as JSON on its command line."""

    engine: dict  # EngineConfig fields
    input_addr: str = ""  # the EngineClient fills the ZMQ addresses and its own pid
    output_addr: str = ""
    parent_pid: int = 0
    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    enforce_eager: bool = False
    log_steps: str | None = None  # directory: steps.jsonl and requests.jsonl are appended there
    executor_factory: str = "testbed.worker.executor:create_executor"
    executor_args: dict = {}  # extra keyword arguments of the factory (e.g. --emulate's gpu and cost_model)


def add_to_core(core: EngineCore, m: P.AddRequest, eos: int | None, vocab_size: int,
                now: float) -> EngineCoreOutput | None:
    """Queue one request; a bad one is rejected (with the reason) rather than killing the engine. The API
    server validated it already; it is checked again so that no input can reach a step unchecked."""
    try:
        sp = None if m.sampling_params is None else m.sampling_params.verify(vocab_size)
        check_token_ids(m.prompt_token_ids, vocab_size)
        req = Request(m.request_id, m.prompt_token_ids, sp, m.arrival_time, m.priority, eos, m.pooling_params,
                      lora_request=m.lora_request, beam_params=m.beam_params)
        return core.add_request(req, now)
    except (ValueError, TypeError) as e:
        return EngineCoreOutput(m.request_id, [], True, "rejected", str(e))


def abort_in_core(core: EngineCore, request_ids: list[str], now: float) -> list[EngineCoreOutput]:
    """End these requests (unknown or finished ids are skipped); the abort outputs of live ones."""
    return [out for out in (core.abort(rid, now) for rid in request_ids) if out is not None]


def first_scheduled(core: EngineCore, so, start: float) -> dict[str, float]:
    """Requests this step scheduled for the first time (not resumed preemptions) -> `start`."""
    out = {}
    for rid in so.new_req_ids:
        req = core.requests.get(rid)
        if req is not None and req.first_scheduled_time == start:
            out[rid] = start
    return out


def scheduler_stats(core: EngineCore, acked_seq: int) -> P.SchedulerStats:
    bm, sched, tokens = core.block_manager, core.scheduler, core.token_counts
    running_loras, waiting_loras = sched.lora_adapters() if sched.lora is not None else ({}, {})
    return P.SchedulerStats(sched.num_running, sched.num_waiting, bm.usage, sched.num_preemptions,
                            bm.prefix_queries, bm.prefix_hits, acked_seq, tokens.prompt, tokens.cached_prompt,
                            tokens.generation, sched.num_swapped, bm.cpu_usage, sched.num_swap_preemptions,
                            sched.num_swapped_out_blocks, sched.num_swapped_in_blocks,
                            min(sched.num_lora_deferred, sched.num_waiting), running_loras, waiting_loras)


def to_wire(o: EngineCoreOutput) -> P.CoreOutput:
    return P.CoreOutput(o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.stop_reason,
                        o.num_cached_tokens, o.new_logprobs, o.prompt_logprobs, o.pooling_output, o.timing, o.beams)


class EngineProc:
    def __init__(self, cfg: EngineProcConfig) -> None:
        self.cfg = cfg
        self.frames = Frames.from_env("engine core")
        self.ctx = zmq.Context()
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.RCVHWM, 0)
        self.inp.connect(cfg.input_addr)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.connect(cfg.output_addr)
        self.acked_seq = -1
        self.running = True
        self.core: EngineCore | None = None
        self.eos: int | None = None
        self.vocab_size = 0
        self.log: RecordLog | None = None

    def send(self, msg) -> None:
        self.out.send(self.frames.encode(msg), copy=False)

    def run(self) -> None:
        module, name = self.cfg.executor_factory.split(":")
        factory = getattr(importlib.import_module(module), name)
        config = EngineConfig(**self.cfg.engine)
        executor = factory(self.cfg.model, config, load_format=self.cfg.load_format, dtype=self.cfg.dtype,
                           device=self.cfg.device, enforce_eager=self.cfg.enforce_eager, **self.cfg.executor_args)
        set_engine_threads()  # this process is the engine's alone: every usable core (worker/threads.py)
        self.core = core = EngineCore(config, executor.num_gpu_blocks, executor.max_model_len,
                                           num_cpu_blocks=getattr(executor, "num_cpu_blocks", None))
        stepper = EngineStepper(core, executor, time.time, config.async_scheduling)
        stepper.on_scheduled = lambda so: self.send(P.Outputs([], self.stats(), {}))  # running during the step
        self.eos = executor.eos_token_id
        self.vocab_size = executor.vocab_size
        self.log = log = RecordLog(self.cfg.log_steps) if self.cfg.log_steps else None
        stepper.while_device_runs = log.write if log is not None else None
        freeze_startup_heap()  # the model, torch and compiled kernels: alive for the process's life
        self.send(P.Ready(executor.num_gpu_blocks, config.block_size, executor.max_model_len, executor.eos_token_id,
                          executor.vocab_size, os.getpid(), core.block_manager.num_cpu_blocks))
        last_parent_check = time.monotonic()
        try:
            while self.running:
                outputs = self.read_inputs(block=not stepper.has_work())
                if not self.running:
                    break
                scheduled: dict[str, float] = {}
                stepped = False
                if stepper.has_work():
                    start = time.time()
                    so, step_outputs = stepper.step(start)
                    outputs.extend(step_outputs)
                    scheduled = first_scheduled(core, so, start)
                    stepped = not so.is_empty or bool(step_outputs)
                    if not stepped:  # nothing schedulable until an input or a compiled grammar changes things
                        self.inp.poll(1 if stepper.compiling else 10)
                if outputs or stepped:
                    self.send(P.Outputs([to_wire(o) for o in outputs], self.stats(), scheduled))
                hand_over(core, log)
                now = time.monotonic()
                if now - last_parent_check > PARENT_CHECK_S:
                    last_parent_check = now
                    if os.getppid() != self.cfg.parent_pid:
                        break  # the API server is gone: nobody to serve
        finally:
            executor.shutdown()
            if log is not None:
                log.close()

    def read_inputs(self, block: bool) -> list[EngineCoreOutput]:
        """Apply every pending message; waits up to PARENT_CHECK_S for the first one when `block`."""
        outputs: list[EngineCoreOutput] = []
        timeout = int(PARENT_CHECK_S * 1000) if block else 0
        if block and self.log is not None:
            self.log.write(flush=True)  # idle: the records so far are on disk before the wait
        while self.inp.poll(timeout):
            timeout = 0
            msg = self.frames.decode(self.inp.recv(copy=False).buffer, P.to_engine_decoder, "its input socket")
            if isinstance(msg, P.AddRequest):
                out = self.add(msg)
                if out is not None:
                    outputs.append(out)
            elif isinstance(msg, P.AbortRequests):
                outputs.extend(abort_in_core(self.core, msg.request_ids, time.time()))
            elif isinstance(msg, P.Shutdown):
                self.running = False
                break
        return outputs

    def add(self, m: P.AddRequest) -> EngineCoreOutput | None:
        self.acked_seq = m.seq
        return add_to_core(self.core, m, self.eos, self.vocab_size, time.time())

    def stats(self) -> P.SchedulerStats:
        return scheduler_stats(self.core, self.acked_seq)

    def close(self) -> None:
        self.out.close(linger=2000)  # deliver what is queued (an EngineError above all)
        self.inp.close(linger=0)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    cfg = config_arg(argv, EngineProcConfig, "engine_proc")
    if cfg is None:
        return 2
    proc = EngineProc(cfg)
    return run_process(proc, "engine core", lambda e, tb: proc.send(P.EngineError(f"{type(e).__name__}: {e}", tb)))


if __name__ == "__main__":
    sys.exit(main())
