"""Tensor and pipeline parallelism: one worker process per rank over torch.distributed (NCCL on GPUs, gloo on CPU).

With pipeline_parallel_size P > 1 there are P x tensor_parallel_size ranks, P stages of TP ranks
(worker/pipeline.py): rank 0 holds the last stage (LM head, sampling), the first stage's ranks are workers, and
activations go from stage to stage by point-to-point sends. Every rank still gets every step's command; a stage
runs its layers on what the previous stage sent. A pipeline stage of one GPU replays CUDA graphs of its own layers
(the send and receive outside them); with TP inside a stage, steps run eager and the stage's all-reduces use NCCL.

Rank 0 lives in the executor's process and drives the others: per step it writes one command with the
step's packed inputs (token ids, positions, slots, block tables, lengths) into a ring in shared host
memory (worker/shm_broadcast.py), every rank copies them to its GPU and runs its shard of the model
(row-parallel layers all-reduce, inside the CUDA graphs: worker/tp_all_reduce.py), and rank 0 gathers
the logits and samples. No rank waits for its device to learn the next command, so each prepares step
k+1 while its GPU runs step k. Failure handling: a rank that dies or stops answering makes `execute` raise within
`TESTBED_TP_TIMEOUT_S` (default 60 s) with an error naming it; processes are cleaned up on exit. A rank
whose command raises (start-up, profiling, KV cache allocation, a step) sends its traceback to rank 0
over a pipe and exits at once; rank 0 reads the pipes before each collective, after one fails and while
it waits for its device, so the engine fails within seconds with that traceback, not at a collective timeout.
Workers are spawned, so each imports the main script again: one that builds a TP engine without an
`if __name__ == "__main__":` guard would build another inside every worker. A worker detects that
and exits with an explanation, and rank 0 fails as soon as a worker dies before it started.
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from functools import partial
from multiprocessing.connection import Connection
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from testbed.engine.config import EngineConfig
from testbed.engine.lora import LoRARequest
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.worker.model_runner import ModelRunner
from testbed.worker.pipeline import init_parallel_state, reset_parallel_state
from testbed.worker.shm_broadcast import ShmBroadcast
from testbed.worker.resolve import memory_in_use, model_limits, resolve_device, resolve_dtype
from testbed.engine.stepper import ExecutorFailure
from testbed.worker.tp_all_reduce import close_tp_all_reduce, init_tp_all_reduce, symmetric_available

logger = logging.getLogger(__name__)

CMD_STEP, CMD_PROFILE, CMD_ALLOC, CMD_SHUTDOWN, CMD_CAPTURE, CMD_LORA, CMD_BLOCK_OPS = 0, 1, 2, 3, 4, 5, 6
PHASES = {CMD_STEP: "a step", CMD_PROFILE: "memory profiling", CMD_ALLOC: "KV cache allocation",
          CMD_CAPTURE: "CUDA graph capture", CMD_LORA: "LoRA adapter loading",
          CMD_BLOCK_OPS: "KV block moves (swap, copy on write)"}
REPORT_CHARS = 8000  # a failed rank's traceback is cut to its last characters: the pipe must not fill up
DEATH_WAIT_S = 2.0  # after a failed collective: how long a dying rank gets to be reaped, so the error names it
MAIN_GUARD_HINT = ("the script that creates the engine has no `if __name__ == \"__main__\":` guard, so each "
                   "spawned tensor-parallel worker runs it again and builds an engine of its own; put the code "
                   "that creates the LLM (and uses it) under that guard")
HEAD = 6  # a command's int64 header: cmd, arg, is_decode, sampled tokens of the last step, int64 arrays, int32 arrays


class TPWorkerError(ExecutorFailure):
    """A tensor-parallel rank died or stopped answering; the group is unusable from then on."""


STARTUP_TIMEOUT_S = 300.0  # how long a live worker may take to get ready to join (spawn and imports)


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("TESTBED_TP_TIMEOUT_S", "60")))


def _build(rank: int, world: int, port: int, model: str, config: EngineConfig, load_format: str, dtype: str,
           device_type: str, ready=None) -> ModelRunner:
    """Join the process group as `rank` and load this rank's shard of its pipeline stage's part of the model;
    a worker counts itself `ready` right before joining, so rank 0 joins (a wait bounded by the collectives'
    timeout) only once every worker is about to, however long their imports took."""
    from testbed.worker.loader import load_model, load_tokenizer
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if ready is not None:
        with ready.get_lock():
            ready.value += 1
    try:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=_timeout())
    except BaseException:
        # A failed init leaves torch's group counter advanced; the next engine's fresh workers (counter 0)
        # would then wait on differently named store keys until the timeout. Reset it.
        dist.distributed_c10d._world.group_count = 0
        raise
    init_parallel_state(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    dt = resolve_dtype(dtype, device)
    in_use = memory_in_use(device)
    net, hf_config = load_model(model, load_format, dt, device, seed=config.seed)
    max_model_len, _, _ = model_limits(hf_config, config)
    runner = ModelRunner(net, config, max_model_len, device, dt, partial(load_tokenizer, model) if rank == 0 else None)
    runner.memory_baseline = in_use
    runner.hf_config = hf_config  # type: ignore[attr-defined]
    if device.type == "cuda":
        init_tp_all_reduce(config.max_num_batched_tokens, int(hf_config["hidden_size"]), dt, device)
    return runner


def encode_command(cmd: int, arg: int = 0, layout: tuple = ((), (), 0), is_decode: bool = False,
                   payload: np.ndarray | None = None) -> np.ndarray:
    """One command as bytes (uint8): the int64 header, the layout's lengths, then the payload (a step's packed
    inputs, copied once)."""
    n64, n32, n_prev = layout
    head = np.array([cmd, arg, int(is_decode), n_prev, len(n64), len(n32), *n64, *n32], dtype=np.int64).view(np.uint8)
    return head if payload is None else np.concatenate((head, payload))


def encode_block_ops(*moves: list[tuple[int, int]]) -> np.ndarray:
    """A step's block moves (swap out, swap in, copy: lists of block-id pairs) as bytes: the three counts,
    then every pair."""
    flat = [len(m) for m in moves] + [b for m in moves for pair in m for b in pair]
    return np.array(flat, dtype=np.int64).view(np.uint8)


def decode_block_ops(payload) -> list[list[tuple[int, int]]]:
    """`encode_block_ops`'s lists of pairs."""
    a = np.frombuffer(payload, dtype=np.int64).tolist()
    out, at = [], 3
    for n in a[:3]:
        out.append(list(zip(a[at:at + 2 * n:2], a[at + 1:at + 2 * n:2])))
        at += 2 * n
    return out


def decode_command(msg: bytes) -> tuple[int, int, tuple, bool, memoryview]:
    """(cmd, arg, layout, is_decode, payload) of `encode_command`'s bytes."""
    head = np.frombuffer(msg, dtype=np.int64, count=HEAD)
    k64, k32 = int(head[4]), int(head[5])
    lens = np.frombuffer(msg, dtype=np.int64, count=k64 + k32, offset=8 * HEAD).tolist()
    layout = (tuple(lens[:k64]), tuple(lens[k64:]), int(head[3]))
    return int(head[0]), int(head[1]), layout, bool(head[2]), memoryview(msg)[8 * (HEAD + k64 + k32):]


def _report_and_exit(report: Connection, rank: int, phase: str) -> None:
    """Print the exception being handled, send it to rank 0 as (phase, exception type, traceback) and exit at
    once: no process-group teardown, which could wait on peers stuck in a collective; the closed sockets
    and the exit let rank 0's dead-rank checks fire."""
    text = traceback.format_exc()
    print(f"tensor-parallel rank {rank} failed in {phase}:\n{text}", file=sys.stderr, flush=True)
    try:
        report.send((phase, type(sys.exc_info()[1]).__name__, text[-REPORT_CHARS:]))
    except OSError:  # rank 0 is gone
        pass
    sys.stdout.flush()
    os._exit(1)


def _worker_main(rank: int, world: int, port: int, model: str, config: EngineConfig, load_format: str, dtype: str,
                 device_type: str, started, report: Connection, channel: tuple) -> None:
    """Rank `rank`'s loop: run each command rank 0 writes into the shared-memory ring until CMD_SHUTDOWN; a
    command that raises is reported to rank 0 and ends this process, and so does rank 0's disappearance."""
    phase = "start-up"
    parent = os.getppid()
    try:
        commands = ShmBroadcast.attach(channel)
        runner = _build(rank, world, port, model, config, load_format, dtype, device_type, started)
        while True:
            phase = "waiting for a command"
            cmd, arg, layout, is_decode, payload = decode_command(commands.recv(rank - 1, lambda: os.getppid() == parent))
            phase = PHASES.get(cmd, "shutdown")
            if cmd == CMD_STEP:
                runner.eager_steps = bool(arg)
                runner.run(runner.load_packed(layout, is_decode, payload))
            elif cmd == CMD_PROFILE:
                n = torch.tensor([runner.profile_num_blocks()], dtype=torch.long, device=runner.device)
                dist.all_reduce(n, op=dist.ReduceOp.MIN)
            elif cmd == CMD_ALLOC:
                runner.allocate_kv_cache(arg, int(np.frombuffer(payload, dtype=np.int64)[0]))
            elif cmd == CMD_BLOCK_OPS:
                runner.cache_engine.run(*decode_block_ops(payload))
            elif cmd == CMD_CAPTURE:
                runner.capture_cuda_graphs()
            elif cmd == CMD_LORA:  # the adapters rank 0 loaded (and checked) before this step, as JSON
                loads, dropped = json.loads(bytes(payload))
                for slot, name, aid, path in loads:
                    runner.lora.load(slot, LoRARequest(name, aid, path))
                for aid in dropped:
                    runner.lora.host.pop(aid, None)
            else:
                break
        if runner.stage is not None:
            runner.stage.flush()
    except BaseException:
        _report_and_exit(report, rank, phase)
    close_tp_all_reduce()
    dist.destroy_process_group()


def check_pipeline(model: str, config: EngineConfig, load_format: str) -> None:
    """A clear error before any process starts when the model cannot be split into the pipeline's stages."""
    if config.pipeline_parallel_size == 1:
        return
    from testbed.specs.partition import pp_partition
    from testbed.worker.loader import model_config
    layers = model_config(model, load_format).get("num_hidden_layers")
    if layers is not None:  # a GGUF file's config comes with its weights: checked when the model is built
        pp_partition(int(layers), config.pipeline_parallel_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    """tensor_parallel_size x pipeline_parallel_size > 1: rank 0 here, ranks 1.. in spawned worker processes."""

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto", dtype: str = "auto",
                 device: str | None = None, enforce_eager: bool = False) -> None:
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned worker importing the main script
            raise RuntimeError(f"a tensor-parallel worker was asked to build an engine while starting up: "
                               f"{MAIN_GUARD_HINT}")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process; "
                               "one tensor-parallel engine per process")
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world = world = tp * pp
        dev = resolve_device(device)
        if dev.type == "cuda" and torch.cuda.device_count() < world:
            what = f"--tensor-parallel-size {tp}" + (f" x --pipeline-parallel-size {pp}" if pp > 1 else "")
            raise ValueError(f"{what} needs {world} GPUs, found {torch.cuda.device_count()}")
        check_pipeline(model, config, load_format)
        self.model_path = model
        port = _free_port()
        ctx = mp.get_context("spawn")
        started = ctx.Value("i", 0)
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]
        self._report_conns: dict[int, Connection] = {r: recv for r, (recv, _) in enumerate(pipes, 1)}
        self._reports: dict[int, tuple[str, str, str]] = {}  # rank -> (phase, exception type, traceback) it sent
        # a pipeline keeps up to pp steps in flight, whose commands a stage's ranks may not have read yet
        self._commands = ShmBroadcast.create(world - 1, num_slots=8 * pp)
        self.procs = [ctx.Process(target=_worker_main, name=f"testbed-tp-rank{r}", daemon=True,
                                  args=(r, world, port, model, config, load_format, dtype, dev.type, started, send,
                                        self._commands.spec))
                      for r, (_, send) in enumerate(pipes, 1)]
        for p in self.procs:
            p.start()
        for _, send in pipes:
            send.close()  # the workers hold the write ends
        self._closed = False
        self.device = dev
        self._failure: str | None = None  # set once a rank died or timed out; every later call fails fast
        atexit.register(self.shutdown)
        try:
            self._wait_started(started)
            self.runner = _build(0, world, port, model, config, load_format, dtype, dev.type)
            self.device = self.runner.device
            self.hf_config = self.runner.hf_config  # type: ignore[attr-defined]
            self.max_model_len, self.eos_token_id, self.vocab_size = model_limits(self.hf_config, config)
            self._commands.unlink()  # every worker has attached (they joined the process group after)
            blocks = config.num_gpu_blocks
            if not blocks:
                self._send(CMD_PROFILE)
                n = torch.tensor([self._guard(self.runner.profile_num_blocks, self._wait_device)], dtype=torch.long,
                                 device=self.device)
                self._guard(dist.all_reduce, n, op=dist.ReduceOp.MIN)
                self._wait_device()
                blocks = int(n.item())
            self.num_cpu_blocks = config.cpu_blocks(self.runner.block_bytes)  # the same on every rank
            self._send(CMD_ALLOC, arg=blocks, payload=np.array([self.num_cpu_blocks], dtype=np.int64).view(np.uint8))
            self.runner.allocate_kv_cache(blocks, self.num_cpu_blocks)
            if self.device.type == "cuda" and not enforce_eager and pp > 1 and tp > 1:
                logger.warning("--pipeline-parallel-size %d x --tensor-parallel-size %d: every step runs eager on "
                               "every rank, without CUDA graphs (the in-graph all-reduce spans all ranks, not one "
                               "stage's)", pp, tp)
            elif self.device.type == "cuda" and not enforce_eager:
                self._capture(tp)
        except BaseException as e:
            self._startup_failed(e)
        self.num_gpu_blocks = blocks
        self.runner.broadcast_inputs = self._broadcast_inputs  # type: ignore[attr-defined]
        if self.runner.lora is not None:
            self.runner.lora.broadcast = self._broadcast_lora
        self.runner.broadcast_block_ops = self._broadcast_block_ops  # type: ignore[attr-defined]
        self.grammars = self.runner.sampler.processors.grammars  # rank 0 samples, so rank 0 compiles grammars

    def _capture(self, tp: int) -> None:
        """Every rank captures its CUDA graphs in lockstep, rank 0 watching the others whenever it waits for its
        device (a rank that fails ends the capture within seconds, naming it): the same graphs on every
        tensor-parallel rank, each pipeline stage its own layers. Tensor parallelism only with the graph-safe
        all-reduce: NCCL collectives are never captured."""
        if tp > 1 and not symmetric_available():
            logger.warning("tensor-parallel ranks run eager: the symmetric-memory all-reduce CUDA graphs need is "
                           "unavailable (see the warning above)")
            return
        self._send(CMD_CAPTURE)
        self._guard(self.runner.capture_cuda_graphs, self._wait_device)

    def _startup_failed(self, e: BaseException) -> NoReturn:
        """End every rank after start-up failed with `e`, and raise: a TPWorkerError naming the failed workers
        with their tracebacks when one failed, else `e` (rank 0's own error, e.g. no memory for the KV cache). Rank
        0's own ValueError (a configuration the model or weights refuse, which every rank hits alike) is raised as
        it is whether or not a worker reported the same failure first: which rank fails first is a race."""
        failed = [] if isinstance(e, TPWorkerError) else self._failed_ranks(
            wait_s=DEATH_WAIT_S if isinstance(e, (dist.DistError, ExecutorFailure)) else 0.0)
        if self._failure is None:  # the workers may wait in a collective: shutdown must not talk to them
            self._failure = (f"tensor-parallel worker {self._verb()} during startup: {', '.join(failed)}" if failed
                             else f"startup failed ({type(e).__name__}: {e})")
        self.shutdown()
        if failed and not isinstance(e, ValueError):
            raise TPWorkerError(f"{self._failure} ({type(e).__name__}: {e}){self._tracebacks()}") from e
        raise e

    def _wait_started(self, started) -> None:
        """Wait until every worker is about to join the process group (up to STARTUP_TIMEOUT_S: a slow host's
        spawn and imports are no failure, and TESTBED_TP_TIMEOUT_S bounds the steps); a worker that dies first
        (it could not import the main script, or ran into an unguarded engine there) fails the engine at once."""
        deadline = time.monotonic() + max(STARTUP_TIMEOUT_S, _timeout().total_seconds())
        while started.value < len(self.procs) and time.monotonic() < deadline:
            dead = self._dead_ranks()
            if dead:
                main = sys.modules.get("__main__")
                hint = f"; a common cause: {MAIN_GUARD_HINT}" if getattr(main, "__file__", None) else ""
                raise TPWorkerError(f"tensor-parallel worker died during startup: {', '.join(dead)} (its error is "
                                    f"above){hint}")
            time.sleep(0.05)

    def _read_reports(self) -> None:
        """Collect the report of every worker that reported a failure, without blocking."""
        for rank, conn in list(self._report_conns.items()):
            try:
                if conn.poll():
                    self._reports[rank] = conn.recv()
                else:
                    continue
            except (EOFError, OSError):  # exited without a report (killed, or a clean shutdown)
                pass
            conn.close()
            del self._report_conns[rank]

    def _failed_ranks(self, wait_s: float = 0.0) -> list[str]:
        """The ranks that reported an error or whose process exited, as `rank R (pid P, exit code C)` and what
        a report says (`raised E in PHASE`); waits up to `wait_s` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            self._read_reports()
            failed = [r for r, p in enumerate(self.procs, 1) if r in self._reports or not p.is_alive()]
            if failed or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        out = []
        for r in failed:
            p = self.procs[r - 1]
            if r in self._reports:
                p.join(DEATH_WAIT_S)  # it exits right after reporting: name its exit code
                phase, error, _ = self._reports[r]
                out.append(f"rank {r} (pid {p.pid}, exit code {p.exitcode}) raised {error} in {phase}")
            else:
                out.append(f"rank {r} (pid {p.pid}, exit code {p.exitcode})")
        return out

    def _tracebacks(self) -> str:
        """The tracebacks the failed workers reported, for the end of an error message."""
        return "".join(f"\n\n--- tensor-parallel rank {r}, {phase} ---\n{text.rstrip()}"
                       for r, (phase, _, text) in sorted(self._reports.items()))

    def _raise_if_failed(self) -> None:
        """Raise, naming the ranks, when a worker has failed or an earlier call found the group broken."""
        if self._failure is not None:
            raise TPWorkerError(f"{self._failure}; the tensor-parallel group is unusable, create a new engine")
        failed = self._failed_ranks()
        if failed:
            raise self._fail(f"tensor-parallel worker {self._verb()}: {', '.join(failed)}", self._tracebacks())

    def _verb(self) -> str:
        return "failed" if self._reports else "died"

    def _wait_device(self, done: torch.cuda.Event | None = None) -> None:
        """Wait for the work queued on rank 0's GPU (up to event `done`, else all of it) while watching the other
        ranks: a rank that fails while rank 0 waits in a collective ends the wait within milliseconds (NCCL
        alone would wait until its timeout). Nothing to wait for on CPU, where gloo's collectives return or
        raise on the host."""
        if self.device.type != "cuda":
            return
        if done is None:
            done = torch.cuda.Event()
            done.record()
        deadline = time.monotonic() + _timeout().total_seconds()
        check = 0.0
        while not done.query():
            now = time.monotonic()
            if now >= check:
                self._raise_if_failed()
                if now > deadline:
                    raise self._fail(f"tensor-parallel workers (ranks 1..{self.world - 1}) did not answer within "
                                     f"{_timeout().total_seconds():g} s (rank 0's device is still waiting)")
                check = now + 0.005
            time.sleep(0)

    def _dead_ranks(self, wait_s: float = 0.0) -> list[str]:
        """The ranks whose process has exited; waits up to `wait_s` for one (a peer's closed socket can
        reach rank 0 before its process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in enumerate(self.procs, 1)
                    if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _fail(self, msg: str, details: str = "") -> TPWorkerError:
        """Mark the group broken with `msg` (repeated by every later call) and give the error to raise now,
        with `details` (the workers' tracebacks) after it."""
        self._failure = msg
        return TPWorkerError(msg + details)

    def _guard(self, fn, *args, **kwargs):
        """Run a collective; turn a dead or silent peer into an error that names the ranks. After one
        failure the ranks may be out of step, so every later call fails at once instead of computing garbage."""
        self._raise_if_failed()
        try:
            return fn(*args, **kwargs)
        except TPWorkerError:  # raised by a nested guard (execute -> broadcast of the step's inputs)
            raise
        except Exception as e:
            collective = isinstance(e, (ExecutorFailure, dist.DistError)) or fn in (dist.broadcast, dist.all_reduce)
            failed = self._failed_ranks(wait_s=DEATH_WAIT_S if collective else 0.0)
            if failed:
                raise self._fail(f"tensor-parallel worker {self._verb()}: {', '.join(failed)} "
                                 f"({type(e).__name__}: {e})", self._tracebacks()) from e
            cause = e.__cause__ if isinstance(e, ExecutorFailure) and e.__cause__ is not None else e
            if isinstance(cause, dist.DistError) or "timed out" in str(cause).lower() or "timeout" in str(cause).lower():
                raise self._fail(f"tensor-parallel workers (ranks 1..{self.world - 1}) did not answer within "
                                 f"{_timeout().total_seconds():g} s ({type(cause).__name__}: {cause})") from e
            if collective:  # the ranks are out of step
                raise self._fail(f"tensor-parallel step failed ({type(e).__name__}: {e})") from e
            raise  # one request's failure on rank 0 after the collectives (e.g. in sampling): the group is fine

    def _send(self, cmd: int, arg: int = 0, layout: tuple = ((), (), 0), is_decode: bool = False,
              payload: np.ndarray | None = None) -> None:
        """Write one command for every worker; waits (checking on the workers) only while the ring is full."""
        self._raise_if_failed()
        self._commands.send(encode_command(cmd, arg, layout, is_decode, payload), check=self._raise_if_failed)

    def _broadcast_inputs(self, packed: np.ndarray, layout: tuple, is_decode: bool) -> None:
        """A step for every rank; arg 1: run it eagerly (every rank takes the path rank 0 takes)."""
        self._send(CMD_STEP, arg=int(self.runner.eager_steps), layout=layout, is_decode=is_decode, payload=packed)

    def _broadcast_lora(self, loads: list, dropped: list[int]) -> None:
        """The adapters rank 0 just put into slots (slot, name, id, path), and those its host cache dropped."""
        self._send(CMD_LORA, payload=np.frombuffer(json.dumps([loads, dropped]).encode(), dtype=np.uint8))

    def _broadcast_block_ops(self, *moves: list[tuple[int, int]]) -> None:
        """A step's block moves for every rank, ahead of its inputs (each rank runs them before its forward)."""
        self._send(CMD_BLOCK_OPS, payload=encode_block_ops(*moves))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(so)()

    def execute_async(self, so: SchedulerOutput):
        """Launch the step on every rank; returns a function that waits for it (watching the other ranks) and
        gives its output (async scheduling launches the next step first)."""
        finish = self._guard(self.runner.execute_async, so)
        launched = torch.cuda.Event() if self.device.type == "cuda" else None
        if launched is not None:
            launched.record()

        def result() -> ModelRunnerOutput:
            self._wait_device(launched)
            return self._guard(finish)

        return result

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if hasattr(self, "grammars"):
            self.grammars.shutdown()
        try:
            if self._failure is None and not self._dead_ranks():
                self._send(CMD_SHUTDOWN)
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=10 if self._failure is None else 0.5)  # after a failure nobody listens: kill now
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._commands.unlink()
        for conn in self._report_conns.values():
            conn.close()
        self._report_conns.clear()
        close_tp_all_reduce()
        runner = getattr(self, "runner", None)
        if runner is not None and runner.stage is not None and self._failure is None:
            runner.stage.flush()
        reset_parallel_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.shutdown)  # the registration holds this executor (and its GPU memory) alive
        self.runner = None  # type: ignore[assignment]
