"""The real-mode step loop around one EngineCore: schedule -> execute -> update, optionally overlapped.

With async scheduling (vLLM's `--async-scheduling`) one step stays in flight: step N+1 is scheduled,
prepared and launched on the device before step N's sampled tokens are read back and applied, so
the host work of scheduling, input building and output handling hides behind the GPU. The core sees
the same calls in a fixed order (schedule N+1, then update N); a decode of N+1 computes on the token
N sampled through a placeholder the model runner fills on the device. Invariant: steps are updated
in the order they were scheduled, each exactly once, and never more than one step is in flight.

A step whose execution raises does not stop the engine: its requests run again one at a time, and
those that fail on their own end with finish_reason "error" (one request's bad data cannot take the
others down). Only an ExecutorFailure (a dead tensor-parallel rank, a device error) propagates.
"""
from __future__ import annotations

from typing import Callable

from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput, EngineCoreOutput, SchedulerOutput


class ExecutorFailure(RuntimeError):
    """The executor itself is broken (not one request's data): no later step can run."""


def is_fatal(e: BaseException) -> bool:
    """Errors after which the executor cannot be trusted: its own verdict, or a sticky device error."""
    text = str(e)
    return isinstance(e, (ExecutorFailure, MemoryError)) or "CUDA error" in text or "device-side assert" in text


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
        self.in_flight: tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]] | None = None
        # called with a step that admits new requests, after scheduling and before executing it: a server
        # reports them running while their (maybe long) first step runs
        self.on_scheduled: Callable[[SchedulerOutput], None] | None = None

    def has_work(self) -> bool:
        """Requests live in the core or a step still to be read back."""
        return self.in_flight is not None or self.core.has_unfinished_requests()

    def step(self, now: float | None = None) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One schedule at `now` (default: the clock) and the update of one step at the clock; the
        SchedulerOutput returned is the one scheduled now (empty when nothing was schedulable)."""
        core = self.core
        so = core.schedule(self.clock() if now is None else now)
        if self.on_scheduled is not None and so.new_req_ids:
            self.on_scheduled(so)
        if not self.async_scheduling:
            if so.is_empty:
                return so, []
            out = self._execute(so)
            return so, core.update(so, out, self.clock())
        launched = None
        if not so.is_empty:
            try:
                launched = (so, self.executor.execute_async(so))
            except Exception as e:  # noqa: BLE001 - sorted out by _isolate
                if is_fatal(e):
                    raise
                outputs = self.drain()  # the step before first: this one's placeholders are its tokens
                return so, outputs + core.update(so, self._isolate(so, e), self.clock())
        outputs = self.drain()
        self.in_flight = launched
        return so, outputs

    def drain(self) -> list[EngineCoreOutput]:
        """Read back and apply the step in flight, if any (before an abort-all or shutdown)."""
        if self.in_flight is None:
            return []
        prev, result = self.in_flight
        self.in_flight = None
        return self.core.update(prev, result(), self.clock())

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.executor.execute(so)
        except Exception as e:  # noqa: BLE001 - sorted out by _isolate
            if is_fatal(e):
                raise
            return self._isolate(so, e)

    def _isolate(self, so: SchedulerOutput, error: Exception) -> ModelRunnerOutput:
        """Run each request of a failed step on its own (synchronously); the ones that fail alone get
        an error, the others their tokens. A step of one request fails with `error` directly."""
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
