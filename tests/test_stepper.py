"""EngineStepper when the executor fails: a step that raises is re-run one request at a time, the
request that fails on its own ends with finish_reason "error", the others finish as if nothing had
happened, the engine goes on, and an ExecutorFailure still stops it. Sync and async scheduling."""
from __future__ import annotations

import itertools

import pytest

from conftest import FIXED_TOKEN, FixedTokenExecutor, make_engine, make_request
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.engine.stepper import EngineStepper, ExecutorFailure

MARK = [3, 1, 4, 1, 5]


class FailsOnMarkedRequests(FixedTokenExecutor):
    """FixedTokenExecutor that raises for any step holding a request whose prompt starts with MARK
    (once `armed`), as a sampler does on a request's bad data; `fatal` makes it an ExecutorFailure."""

    def __init__(self, error: type[Exception] = RuntimeError) -> None:
        super().__init__()
        self.error = error
        self.steps: list[list[str]] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append([r.request_id for r in so.requests])
        if any(list(r.prompt_token_ids[:len(MARK)]) == MARK for r in so.requests):
            raise self.error("probability tensor contains either inf, nan or element < 0")
        return super().execute(so)

    def execute_async(self, so: SchedulerOutput):
        out = self.execute(so)
        return lambda: out


def _run(stepper: EngineStepper, max_steps: int = 200) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not stepper.has_work():
            return outs
        for o in stepper.step()[1]:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("requests not finished")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_fails_ends_with_an_error_and_the_others_finish(async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling, enable_prefix_caching=True, block_size=4)
    clock = itertools.count()
    executor = FailsOnMarkedRequests()
    stepper = EngineStepper(engine, executor, lambda: float(next(clock)), async_scheduling)
    for rid in ("a", "b"):
        assert engine.add_request(make_request(rid, 8, max_tokens=5), 0.0) is None
    assert engine.add_request(make_request("bad", tokens=MARK + [9] * 8, max_tokens=5), 0.0) is None
    outs = _run(stepper)
    bad = outs["bad"][-1]
    assert bad.finished and bad.finish_reason == "error" and "inf, nan" in bad.stop_reason
    assert sum(len(o.new_token_ids) for o in outs["bad"]) == 0
    for rid in ("a", "b"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == [FIXED_TOKEN] * 5
        assert outs[rid][-1].finish_reason == "length"
    assert [len(s) for s in executor.steps[:4]] == [3, 1, 1, 1]  # the failed step, then each request alone
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert bm.get_computed_blocks(make_request("again", tokens=MARK + [9] * 8))[1] == 0  # its blocks left the cache
    assert bm.get_computed_blocks(make_request("a", 8))[1] == 4
    rec = {r[0]: r for r in zip(*engine.records.request_columns().values())}
    assert engine.records.request_columns()["finish_reason"][list(rec).index("bad")] == "error"
    # the engine goes on: a later request is served
    assert engine.add_request(make_request("c", 8, max_tokens=2), 99.0) is None
    assert [t for o in _run(stepper)["c"] for t in o.new_token_ids] == [FIXED_TOKEN] * 2


def test_a_request_alone_in_a_failing_step_fails_without_a_rerun():
    engine = make_engine()
    executor = FailsOnMarkedRequests()
    stepper = EngineStepper(engine, executor, lambda: 0.0)
    engine.add_request(make_request("bad", tokens=MARK, max_tokens=3), 0.0)
    assert _run(stepper)["bad"][-1].finish_reason == "error"
    assert executor.steps == [["bad"]]


def test_an_executor_failure_stops_the_engine():
    engine = make_engine()
    stepper = EngineStepper(engine, FailsOnMarkedRequests(ExecutorFailure), lambda: 0.0)
    engine.add_request(make_request("ok", 8), 0.0)
    engine.add_request(make_request("bad", tokens=MARK), 0.0)
    with pytest.raises(ExecutorFailure):
        stepper.step()


def test_subset_narrows_the_rows_and_keeps_the_rest_of_the_step():
    engine = make_engine()
    for rid in "abc":
        engine.add_request(make_request(rid, 8), 0.0)
    so = engine.schedule(0.0)
    sub = so.subset([1])
    assert [r.request_id for r in sub.requests] == ["b"] and sub.new_req_ids == {"b"}
    assert (sub.num_new_tokens, sub.num_computed_before, sub.block_ids) == ([8], [0], [so.block_ids[1]])
    kept = [f for f in SchedulerOutput.__dataclass_fields__ if f not in
            ("requests", "num_new_tokens", "num_computed_before", "block_ids", "new_req_ids", "preempted_req_ids")]
    assert all(getattr(sub, f) == getattr(so, f) for f in kept)


class LaunchThenWait(FixedTokenExecutor):
    """FixedTokenExecutor that launches a step (execute_async) and is waited for later, logging both."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events
        self.n = 0

    def execute_async(self, so: SchedulerOutput):
        self.n += 1
        n, out = self.n, super().execute(so)
        self.events.append(f"launch {n}")

        def wait() -> ModelRunnerOutput:
            self.events.append(f"wait {n}")
            return out
        return wait


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_while_device_runs_is_called_once_a_step_between_its_launch_and_the_wait(async_scheduling):
    """The hook an engine process writes its records in runs after each launch and before a result is waited for
    (sync: the step's own; async: the step before), once a step; the tokens are those of a run without it."""
    finals = []
    for hooked in (False, True):
        events: list[str] = []
        engine = make_engine(async_scheduling=async_scheduling, block_size=4)
        clock = itertools.count()
        stepper = EngineStepper(engine, LaunchThenWait(events), lambda: float(next(clock)), async_scheduling)
        if hooked:
            stepper.while_device_runs = lambda: events.append("hook")
        for rid in ("a", "b"):
            assert engine.add_request(make_request(rid, 6, max_tokens=4), 0.0) is None
        outs = _run(stepper)
        finals.append({rid: [t for o in os_ for t in o.new_token_ids] for rid, os_ in outs.items()})
    launches = [e for e in events if e.startswith("launch")]
    assert events.count("hook") == len(launches) > 1
    for i, e in enumerate(events):
        if e == "hook":
            assert events[i - 1].startswith("launch")  # right after a launch, before any wait
    if not async_scheduling:
        assert all(events[i:i + 3] == [f"launch {k}", "hook", f"wait {k}"]
                   for k, i in enumerate(range(0, len(events), 3), start=1))
    assert finals[0] == finals[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_last_output_is_the_executor_output_of_the_step_just_updated(async_scheduling):
    """`last_output` pairs with `last_updated` (what a profile's cycle timing reads): None when a call updated
    nothing (async: the first launch), else the output whose tokens that step applied, a failed step's
    isolated output included."""
    engine = make_engine(async_scheduling=async_scheduling)
    executor = FailsOnMarkedRequests()
    stepper = EngineStepper(engine, executor, lambda: 0.0, async_scheduling)
    engine.add_request(make_request("a", 8, max_tokens=3), 0.0)
    engine.add_request(make_request("bad", tokens=MARK + [9] * 4, max_tokens=3), 0.0)
    updated = []
    while stepper.has_work():
        stepper.step()
        if stepper.last_updated is None:
            assert stepper.last_output is None
            continue
        out = stepper.last_output
        assert len(out.sampled_token_ids) == len(stepper.last_updated.requests)
        updated.append((len(stepper.last_updated.requests), out.errors))
    assert updated[0][0] == 2 and "bad" in updated[0][1]  # the failed step, its requests re-run one by one
    assert [n for n, _ in updated[1:]] == [1, 1]
