"""Async client of the engine-core process, living in the API server's event loop.

It starts the process, routes each CoreOutput to the RequestStream of its request, keeps the
latest SchedulerStats, and watches the process: when it dies (or reports EngineError) every
in-flight request gets an EngineDeadError at once, later adds fail fast, and `on_death` is called,
so nothing hangs. `fail_all` ends every in-flight request the same way while the engine lives (a
shutdown whose grace period expired).
Invariant: a request id is in `streams` from `add` until its finished output, an abort, or a failure.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from testbed.engine.lora import LoRARequest
from testbed.engine.params import BeamSearchParams, PoolingParams, SamplingParams
from testbed.runtime import protocol as P
from testbed.runtime.frames import Frames, deployment_secret
from testbed.runtime.engine_proc import EngineProcConfig

WATCH_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (or the server is stopping); the server answers 503 with `code`."""

    def __init__(self, message: str, code: str = "engine_dead") -> None:
        super().__init__(message)
        self.code = code


class RequestStream:
    """Outputs of one core request (or of several sharing the stream), in order; raises EngineDeadError if the
    engine dies first. A deque and one waiter future: the output loop puts a step's output for every live stream,
    so this is on the per-token path (asyncio.Queue's bookkeeping cost more than the rest of the hand-over)."""

    __slots__ = ("request_id", "items", "waiter", "engines")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.items: deque = deque()  # CoreOutputs, or the exception every later get raises
        self.waiter: asyncio.Future | None = None  # the pending get's, woken by put
        self.engines: dict[str, int] = {}  # core request id -> the DP replica serving it, once known

    def put(self, item: P.CoreOutput | BaseException) -> None:
        """Queue an output (or the error that ends the stream) and wake the waiting get."""
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> P.CoreOutput:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def get_nowait(self) -> P.CoreOutput | None:
        """The next output if one is already queued (lets a handler batch deltas)."""
        if not self.items:
            return None
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


class EngineClient:
    peer = "the engine-core process"  # what `inp` sends to (error messages)
    engine_of_new: int | None = 0     # the replica a new request runs on, when known at once
    secret_required_for: str | None = None  # set where processes of the deployment start elsewhere

    def __init__(self, cfg: EngineProcConfig, on_stats: Callable[[P.SchedulerStats, dict[str, float]], None]
                 | None = None) -> None:
        self.cfg = cfg
        self.on_stats = on_stats
        self.on_death: Callable[[str], None] | None = None  # called once when the engine core dies unasked
        self.refusal: EngineDeadError | None = None  # set by fail_all: the error every later add gets
        self.streams: dict[str, RequestStream] = {}
        self.ready: P.Ready | None = None
        self.stats = P.SchedulerStats(0, 0, 0.0, 0, 0, 0, -1)
        self.sent_seq = -1
        self.dead_reason: str | None = None
        self.proc: subprocess.Popen | None = None
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self._tmp = tempfile.mkdtemp(prefix="testbed-engine-")
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self.inp = self._sync_ctx.socket(zmq.PUSH)
        self.inp.setsockopt(zmq.SNDHWM, 0)
        self.out = self._ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.RCVHWM, 0)
        # every process it starts inherits the secret through the environment
        self.frames = Frames(deployment_secret(self.secret_required_for), "testbed serve")

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> P.Ready:
        """Spawn the engine core and wait until its executor is built; RuntimeError if it fails."""
        in_addr, out_addr = f"ipc://{self._tmp}/input", f"ipc://{self._tmp}/output"
        self.inp.bind(in_addr)
        self.out.bind(out_addr)
        cfg = msgspec.structs.replace(self.cfg, input_addr=in_addr, output_addr=out_addr, parent_pid=os.getpid())
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.runtime.engine_proc",
                                      msgspec.json.encode(cfg).decode()], start_new_session=True)
        while self.ready is None:
            if await self.out.poll(200):
                msg = self.frames.decode(await self.out.recv(), P.from_engine_decoder, "its engine output socket")
                if isinstance(msg, P.EngineError):
                    await self.shutdown()
                    raise RuntimeError(f"engine core failed to start: {msg.message}")
                if isinstance(msg, P.Ready):
                    self.ready = msg
            elif self.proc.poll() is not None:
                code = self.proc.returncode
                await self.shutdown()
                raise RuntimeError(f"engine core exited with code {code} during startup (its error is above)")
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch_loop())]
        return self.ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (politely, then SIGKILL after `timeout`) and release the sockets."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.inp.send(self.frames.encode(P.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            loop = asyncio.get_running_loop()
            deadline = loop.time() + (timeout if self.ready is not None else 0.0)  # still loading: no need to wait
            while self.proc.poll() is None and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        await self._stop_workers(timeout if self.ready is not None else 0.0)
        self._die("the server is shutting down")
        self.inp.close(linger=0)
        self.out.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    async def _stop_workers(self, timeout: float) -> None:
        """Processes to stop after the engine core (none here; the DP client's replicas)."""

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def engine_blocks(self) -> dict[int, int]:
        """Each replica's KV-cache size in blocks, once started (one replica here)."""
        return {0: self.ready.num_gpu_blocks} if self.ready is not None else {}

    @property
    def dead_engines(self) -> dict[int, str]:
        """Dead replicas and why (one replica here: it, once dead)."""
        return {0: self.dead_reason} if self.dead_reason is not None else {}

    def _die(self, reason: str) -> None:
        first = self.dead_reason is None
        if first:
            self.dead_reason = reason
        err = EngineDeadError(f"engine core is dead: {self.dead_reason}")
        for stream in self.streams.values():
            stream.put(err)
        self.streams.clear()
        if first and not self._closing and self.on_death is not None:
            self.on_death(reason)

    def fail_all(self, reason: str, code: str) -> None:
        """End every in-flight request with an error (`code`) and refuse later ones; the core (each
        replica's, with data parallelism) aborts them through `abort`."""
        self.refusal = EngineDeadError(reason, code)
        failed = list(self.streams.values())
        self.abort(list(self.streams))
        for stream in failed:
            stream.put(self.refusal)

    async def _watch_loop(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        if not self._closing:
            await asyncio.sleep(WATCH_INTERVAL_S)  # let a final EngineError arrive first: it says more
            self._die(f"the engine-core process (pid {self.proc.pid}) exited with code {self.proc.returncode}")

    async def _output_loop(self) -> None:
        try:
            while True:
                msg = self.frames.decode(await self.out.recv(), P.from_engine_decoder, "its engine output socket")
                if isinstance(msg, P.Outputs):
                    streams = self.streams
                    for o in msg.outputs:
                        stream = streams.get(o.request_id)
                        if stream is not None:
                            stream.put(o)
                            if o.finished:
                                del streams[o.request_id]
                    self.stats = msg.stats
                    if self.on_stats is not None:
                        self.on_stats(msg.stats, msg.scheduled)
                elif isinstance(msg, P.EngineError):
                    self._die(msg.message)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an authentic message it cannot handle: the engine cannot be trusted
            self._die(f"bad message from the engine core: {e!r}")

    # ---- requests ------------------------------------------------------------------------------
    @property
    def num_waiting_estimate(self) -> int:
        """Upper bound on the core's waiting queue: the last snapshot plus adds it had not seen yet."""
        return self.stats.num_waiting + self.sent_seq - self.stats.acked_seq

    def add(self, request_id: str, prompt_token_ids: list[int], arrival_time: float,
            stream: RequestStream | None = None, *, sampling_params: SamplingParams | None = None,
            pooling_params: PoolingParams | None = None, priority: int = 0,
            lora_request: LoRARequest | None = None, beam_params: BeamSearchParams | None = None) -> RequestStream:
        """Send one request (validated parameters: generation or, resolved, pooling; the LoRA adapter it runs
        with) to the core; its outputs arrive on `stream` (several requests may share one, e.g. the n choices of
        one HTTP request), a new one if None."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine core is dead: {self.dead_reason}")
        if self.refusal is not None:
            raise EngineDeadError(str(self.refusal), self.refusal.code)
        # encode first: a request that cannot be sent must leave no stream and no sequence number behind
        data = self.frames.encode(P.AddRequest(self.sent_seq + 1, request_id, prompt_token_ids, arrival_time,
                                               sampling_params, pooling_params, priority, lora_request,
                                               beam_params))
        if not self._send_data(data):
            raise EngineDeadError(f"engine core is dead: {self.dead_reason}")
        self.sent_seq += 1
        stream = stream if stream is not None else RequestStream(request_id)
        self.streams[request_id] = stream
        if self.engine_of_new is not None:
            stream.engines[request_id] = self.engine_of_new
        return stream

    def _send_data(self, data: bytes) -> bool:
        """Send an encoded message to the engine process; False (and the engine dead) when it is gone."""
        try:
            self.inp.send(data, zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:  # no peer: the process died and the watchdog has not seen it yet
            self._die(f"cannot reach {self.peer} ({e})")
            return False

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests in the core (frees their KV blocks); their streams get nothing more."""
        live = [r for r in request_ids if self.streams.pop(r, None) is not None]
        if live and self.dead_reason is None:
            try:
                self.inp.send(self.frames.encode(P.AbortRequests(live)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the engine is going away; the watchdog reports it
