"""The engine behind `LLM(..., data_parallel_size=N)`: the DP serving stack without HTTP.

DPEngine runs DPEngineClient (the DP coordinator process and N replica processes, as `testbed serve
-dp N` starts them) on a private event loop and gives the LLM class the same step-level calls as
its in-process engine: add_request, step (wait for outputs), abort, has_unfinished_requests. Times
are seconds since `reset_clock()`, as the in-process LLM's; the replicas stamp wall-clock times,
converted back when the run's records are read.

Records: the replicas and the coordinator log their records into a private directory (steps,
requests, ITLs, admissions, stats reports; routes and report receipts); after `shutdown()`,
`records()` joins them into one Recorder (per-replica steps, each request's replica, and the
coordinator's routes and publications tables), the run-directory schema of `testbed simulate -dp N`.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

from testbed.engine.config import EngineConfig
from testbed.engine.metrics import Recorder, logged_step_extra, shifted_step_row
from testbed.engine.outputs import EngineCoreOutput
from testbed.engine.params import PoolingParams, SamplingParams

# request columns holding times (REQUEST_COLUMNS order: id, replica, priority, arrival, first_scheduled, ...)
_REQUEST_TIMES = (3, 4, 5, 6)


class DPEngine:
    def __init__(self, model: str | None, config: EngineConfig, load_format: str = "auto", dtype: str = "auto",
                 device: str | None = None, enforce_eager: bool = False, executor_factory: str | None = None,
                 executor_args: dict | None = None) -> None:
        """`executor_factory` ("module:function") and `executor_args`: the replicas' executors (default: the real
        one; `testbed.sim.emulator:create` with its gpu and cost_model emulates the model, `model` its preset)."""
        from testbed.runtime.client import RequestStream
        from testbed.runtime.dp_client import DPEngineClient, DPTopology
        from testbed.runtime.engine_proc import EngineProcConfig
        from testbed.worker.hub import resolve_model
        self.model_path = resolve_model(model, load_format) if executor_factory is None else model
        self.log_dir = tempfile.mkdtemp(prefix="testbed-dp-records-")
        proc = EngineProcConfig(engine=config.to_dict(), model=self.model_path, load_format=load_format, dtype=dtype,
                                device=device, enforce_eager=enforce_eager, log_steps=self.log_dir)
        if executor_factory is not None:
            proc.executor_factory, proc.executor_args = executor_factory, dict(executor_args or {})
        self.client = DPEngineClient(proc, DPTopology(config.data_parallel_size), self._on_stats)
        self.scheduled: dict[str, float] = {}  # request id -> when a replica first scheduled it (its time.time())
        self.loop = asyncio.new_event_loop()
        try:
            self.ready = self.loop.run_until_complete(self.client.start())
        except BaseException:
            self.loop.close()
            shutil.rmtree(self.log_dir, ignore_errors=True)
            raise
        self.stream = RequestStream("llm")  # every request's outputs, in arrival order
        self.sent: dict[str, float] = {}
        self.t0 = time.time()
        self.closed = False

    def _on_stats(self, stats, scheduled: dict[str, float], engine: int) -> None:
        self.scheduled.update(scheduled)

    def now(self) -> float:
        return time.time() - self.t0

    def reset_clock(self) -> None:
        self.t0 = time.time()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sp: SamplingParams | PoolingParams,
                    arrival_time: float, priority: int = 0, lora_request=None, beam_params=None) -> None:
        """Send one request (resolved PoolingParams: an embedding) to the coordinator; a rejection comes back
        from `step` as a finished output."""
        sent = time.time()
        ids, arrival = [int(t) for t in prompt_token_ids], self.t0 + arrival_time
        params = {"pooling_params" if isinstance(sp, PoolingParams) else "sampling_params": sp,
                  "beam_params": beam_params}
        self.client.add(request_id, ids, arrival, stream=self.stream, priority=priority, lora_request=lora_request,
                        **params)
        self.sent[request_id] = sent

    def has_unfinished_requests(self) -> bool:
        return bool(self.client.streams)

    def abort(self, request_id: str) -> None:
        self.client.abort([request_id])

    def step(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """Outputs that arrived, waiting up to `timeout` s (None: until one does) for the first;
        RuntimeError when a replica serving a request died."""
        from testbed.runtime.client import EngineDeadError

        async def collect() -> list:
            try:
                first = await asyncio.wait_for(self.stream.get(), timeout)
            except asyncio.TimeoutError:
                return []
            outs = [first]
            while (o := self.stream.get_nowait()) is not None:
                outs.append(o)
            return outs
        try:
            outs = self.loop.run_until_complete(collect())
        except EngineDeadError as e:
            raise RuntimeError(str(e)) from None
        return [EngineCoreOutput(o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.stop_reason,
                              o.num_cached_tokens, o.new_logprobs, o.prompt_logprobs, o.pooling_output, o.timing,
                              o.beams) for o in outs]

    def shutdown(self) -> None:
        """Stop the coordinator and the replicas (their logs are complete afterwards)."""
        if not self.closed:
            self.closed = True
            self.loop.run_until_complete(self.client.shutdown())
            self.loop.close()

    def records(self) -> Recorder:
        """The run's records, times relative to the clock's zero (call after shutdown)."""
        if not self.closed:
            raise RuntimeError("records() reads the replicas' logs: call shutdown() first")
        rec = read_dp_logs(Path(self.log_dir), self.client.size, self.t0, self.sent)
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return rec


def _rows(path: Path) -> list[list]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def read_dp_logs(log_dir: Path, size: int, t0: float, sent: dict[str, float]) -> Recorder:
    """Join the per-process logs of a DP run into one Recorder (times minus `t0`)."""
    rec = Recorder()
    added: dict[str, float] = {}
    reports: list[dict[int, list]] = []
    for r in range(size):
        steps = _rows(log_dir / f"steps.{r}.jsonl")
        if steps:  # an async run's rows also say when each step was scheduled
            rec.step_extra = logged_step_extra(steps[0])
            rec.steps.extend(shifted_step_row(row, t0) for row in steps)
        for row in _rows(log_dir / f"requests.{r}.jsonl"):
            for i in _REQUEST_TIMES:
                row[i] = None if row[i] is None else row[i] - t0
            rec.requests.append(tuple(row))
        for samples in _rows(log_dir / f"itl.{r}.jsonl"):  # a step's samples a line (one a line before)
            rec.itl.extend(samples)
        rec.grammars.extend((rid, rep, t - t0, err) for rid, rep, t, err in _rows(log_dir / f"grammars.{r}.jsonl"))
        rec.loras.update((rid, name) for rid, name in _rows(log_dir / f"loras.{r}.jsonl"))
        added.update((rid, t - t0) for rid, t in _rows(log_dir / f"adds.{r}.jsonl"))
        reports.append({row[0]: row for row in _rows(log_dir / f"reports.{r}.jsonl")})
    for seq, rid, r, arrival, routed in _rows(log_dir / "routes.jsonl"):
        rec.routes.append((seq, rid, r, arrival - t0, sent.get(rid, arrival) - t0, routed - t0, added.get(rid)))
    for seq, r, n, received in _rows(log_dir / "receipts.jsonl"):
        _, steps, sampled, *stats = reports[r][n]
        rec.publications.append((seq, r, steps, sampled - t0, received - t0, *stats))
    return rec
