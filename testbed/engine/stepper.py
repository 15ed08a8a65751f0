"""The real-mode step loop around one EngineCore: schedule -> execute -> update, optionally overlapped.

With async scheduling (vLLM's `--async-scheduling`) one step stays in flight: step N+1 is scheduled,
prepared and launched on the device before step N's sampled tokens are read back and applied, so
the host work of scheduling, input building and output handling hides behind the GPU. The core sees
the same calls in a fixed order (schedule N+1, then update N); a decode of N+1 computes on the token
N sampled through a placeholder the model runner fills on the device.

With pipeline parallelism (`pipeline_parallel_size` N > 1) it is vLLM V1's batch queue: a scheduled batch is
launched into the pipeline and, while fewer than N are in flight, the next one is scheduled at once (of
requests in no in-flight batch: the scheduler skips those); when N are in flight, or nothing more is
schedulable, the oldest is read back and updated. So the stages work on different batches at once. Unlike
vLLM, the oldest batch is not updated early when it happens to be done already: the call order depends on
the schedule alone, which the simulator reproduces exactly (sim/cluster.py).

Invariant: steps are updated in the order they were scheduled, each exactly once, and never more than
`config.max_in_flight` are in flight.

Grammars (structured outputs) compile off the loop when the executor has a grammar backend (`grammars`:
submit / poll / forget, testbed/worker/grammar.py): each step first submits the grammars of requests
queued since the last one, then marks those compiled ready in the core (`mark_grammar_ready`, at the
step's `now`, which the core records for a simulation to replay) and fails those that did not compile,
or not within `structured_outputs_timeout` of their compile's start; meanwhile the scheduler passes over them.

A step whose execution raises does not stop the engine: its requests run again one at a time, and
those that fail on their own end with finish_reason "error" (one request's bad data cannot take the
others down). Only an ExecutorFailure (a dead tensor-parallel rank, a device error) propagates.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput, EngineCoreOutput, SchedulerOutput


class ExecutorFailure(RuntimeError):
    """The executor itself is broken (not one request's data): no later step can run."""


def is_fatal(e: BaseException) -> bool:
    """Errors after which the executor cannot be trusted: its own verdict, or a sticky device error."""
    text = str(e)
    return isinstance(e, (ExecutorFailure, MemoryError)) or "CUDA error" in text or "device-side assert" in text


def grammar_timeout_reason(timeout: float) -> str:
    """Why a request whose grammar did not compile in time is rejected (real and simulated alike)."""
    return (f"structured_outputs: the grammar did not compile within {timeout:g} s (--structured-outputs-timeout); "
            "simplify the schema or raise the bound")


def describe(e: BaseException) -> str:
    return f"the executor failed on this request: {type(e).__name__}: {e}"


class EngineStepper:
    def __init__(self, core: EngineCore, executor, clock: Callable[[], float], async_scheduling: bool = False) -> None:
        if async_scheduling and not hasattr(executor, "execute_async"):
            raise ValueError("--async-scheduling needs an executor that can launch a step without waiting for it "
                             "(tensor_parallel_size 1); drop the flag or use one GPU")
        self.core = core
        self.executor = executor
        self.clock = clock
        self.async_scheduling = async_scheduling
        self.max_in_flight = core.config.pipeline_parallel_size if core.pipelined else 1 + async_scheduling
        if self.max_in_flight > 1 and not hasattr(executor, "execute_async"):
            raise ValueError("--pipeline-parallel-size needs an executor that launches a batch without waiting for it")
        # launched steps, oldest first: (SchedulerOutput, a function that waits for its ModelRunnerOutput)
        self.queue: deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = deque()
        self.last_output: ModelRunnerOutput | None = None  # the executor's output of `last_updated` (its timing)
        self.last_updated: SchedulerOutput | None = None  # the step the last `step` call updated, if any
        # called with a step that admits new requests, after scheduling and before executing it: a server
        # reports them running while their (maybe long) first step runs
        self.on_scheduled: Callable[[SchedulerOutput], None] | None = None
        # called once a step, after its launch and before its result is waited for (before it executes where the
        # executor cannot launch without waiting): an engine process writes its records then, on the loop's own
        # thread while the device works (a second thread would take the GIL from the step's torch calls)
        self.while_device_runs: Callable[[], None] | None = None
        self.grammars = getattr(executor, "grammars", None)
        core.compile_grammars = self.grammars is not None
        self._compiling: set[str] = set()  # requests whose grammar was submitted and not reported yet

    @property
    def compiling(self) -> bool:
        """Whether a grammar is still compiling (nothing else may be schedulable meanwhile)."""
        return bool(self._compiling)

    def _advance_grammars(self, now: float) -> list[EngineCoreOutput]:
        """Submit new grammars, mark compiled ones ready and fail the rest; the rejections' outputs."""
        core, backend, compiling = self.core, self.grammars, self._compiling
        for req in core.take_new_grammars():
            backend.submit(req.request_id, req.sampling_params.structured_outputs, self.executor.vocab_size,
                           req.eos_token_id)
            compiling.add(req.request_id)
        if not compiling:
            return []
        outputs = []
        for rid, error in backend.poll():
            compiling.discard(rid)
            if error is None:
                core.mark_grammar_ready(rid, now)
            else:
                out = core.fail_grammar(rid, error, now)
                if out is not None:
                    outputs.append(out)
        limit = core.config.structured_outputs_timeout
        for rid in list(compiling):
            if rid not in core.requests or backend.compiling_for(rid) > limit:  # aborted while compiling, or too slow
                compiling.discard(rid)
                backend.forget([rid])
                out = core.fail_grammar(rid, grammar_timeout_reason(limit), now)
                if out is not None:
                    outputs.append(out)
        return outputs

    @property
    def in_flight(self) -> tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]] | None:
        """The oldest step in flight, if any."""
        return self.queue[0] if self.queue else None

    def has_work(self) -> bool:
        """Requests live in the core or a step still to be read back."""
        return bool(self.queue) or self.core.has_unfinished_requests()

    def step(self, now: float | None = None) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One schedule at `now` (default: the clock) and the update of at most one step at the clock: the
        oldest in flight, once max_in_flight are (async scheduling: 2, the one launched now and the one
        before; pipeline parallelism: N) or nothing was schedulable. The SchedulerOutput returned is the one
        scheduled now (empty when nothing was schedulable)."""
        core = self.core
        self.last_updated = self.last_output = None
        now = self.clock() if now is None else now
        ready = self._advance_grammars(now) if self.grammars is not None else []
        so = core.schedule(now)
        if self.on_scheduled is not None and so.new_req_ids:
            self.on_scheduled(so)
        if self.max_in_flight == 1:
            if so.is_empty:
                return so, ready
            out = self.last_output = self._execute(so)
            self.last_updated = so
            return so, ready + core.update(so, out, self.clock())
        if not so.is_empty:
            try:
                self.queue.append((so, self.executor.execute_async(so)))
            except Exception as e:  # noqa: BLE001 - sorted out by _isolate
                if is_fatal(e):
                    raise
                outputs = self.drain()  # the steps before first: this one's placeholders are their tokens
                self.last_updated = so
                self.last_output = self._isolate(so, e)
                return so, ready + outputs + core.update(so, self.last_output, self.clock())
            if self.while_device_runs is not None:
                self.while_device_runs()
            if len(self.queue) < self.max_in_flight:
                return so, ready  # room in flight: schedule the next step before reading this one back
        return so, ready + (self._update_oldest() if self.queue else [])

    def _update_oldest(self) -> list[EngineCoreOutput]:
        prev, result = self.queue.popleft()
        self.last_updated = prev
        self.last_output = result()
        return self.core.update(prev, self.last_output, self.clock())

    def drain(self) -> list[EngineCoreOutput]:
        """Read back and apply every step in flight, oldest first (before an abort-all or shutdown)."""
        outputs: list[EngineCoreOutput] = []
        while self.queue:
            outputs += self._update_oldest()
        return outputs

    def discard(self) -> None:
        """Wait for every step in flight and drop its results (its requests are being aborted): the workers
        finish each launched step, so the next one starts from a quiet pipeline."""
        while self.queue:
            try:
                self.queue.popleft()[1]()
            except Exception as e:  # noqa: BLE001 - a result nobody reads; a broken executor still fails
                if is_fatal(e):
                    raise

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        hook = self.while_device_runs
        launch = getattr(self.executor, "execute_async", None) if hook is not None else None
        if hook is not None and launch is None:
            hook()
        try:
            if launch is None:
                return self.executor.execute(so)
            wait = launch(so)
        except Exception as e:  # noqa: BLE001 - sorted out by _isolate
            return self._isolate(so, e)
        hook()
        try:
            return wait()
        except Exception as e:  # noqa: BLE001 - sorted out by _isolate
            return self._isolate(so, e)

    def _isolate(self, so: SchedulerOutput, error: Exception) -> ModelRunnerOutput:
        """Run each request of a failed step on its own (synchronously); the ones that fail alone get
        an error, the others their tokens. A step of one request fails with `error` directly, and so does a fatal
        error (is_fatal: the executor itself is broken)."""
        if is_fatal(error):
            raise error
        n = so.num_reqs
        tokens = [-1] * n
        logprobs: list | None = None
        prompt_lps: list | None = None
        pooled: list | None = None
        errors: dict[str, str] = {}
        if n == 1:
            errors[so.requests[0].request_id] = describe(error)
            return ModelRunnerOutput(tokens, 0.0, None, errors=errors)
        duration = 0.0
        for i, req in enumerate(so.requests):
            if req.finished:  # ended by the step updated meanwhile (async scheduling)
                continue
            try:
                out = self.executor.execute(so.subset([i]))
            except Exception as e:  # noqa: BLE001 - this request's own failure
                if is_fatal(e):
                    raise
                errors[req.request_id] = describe(e)
                continue
            tokens[i] = out.sampled_token_ids[0]
            duration += out.duration
            if out.logprobs is not None:
                logprobs = logprobs or [None] * n
                logprobs[i] = out.logprobs[0]
            if out.prompt_logprobs is not None:
                prompt_lps = prompt_lps or [None] * n
                prompt_lps[i] = out.prompt_logprobs[0]
            if out.pooler_output is not None:
                pooled = pooled or [None] * n
                pooled[i] = out.pooler_output[0]
            if out.errors:
                errors.update(out.errors)
        return ModelRunnerOutput(tokens, duration, logprobs, errors=errors, prompt_logprobs=prompt_lps,
                                 pooler_output=pooled)
