"""Faults of `testbed serve`: the waiting bound (503), SIGTERM with requests in flight (drain, exit 0;
past --shutdown-timeout, OpenAI errors), an engine-core crash (every in-flight request ends with an
error, never a hang; the server exits 1, or answers 503 with --keep-alive-on-engine-death), a request
the executor fails on (it alone ends with an error), and an exception that breaks the executor
(reported to the API server before the engine-core process dies).

Real servers on 127.0.0.1 with the bundled SmolLM2 on the CPU; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess, metric, sse_events

from testbed.engine.params import SamplingParams

PROMPT = "The capital of France is"

pytestmark = pytest.mark.timeout(300)


async def open_stream(h: httpx.AsyncClient, url: str, max_tokens: int, first_chunk: bool = True):
    """Start a streaming completion; returns (response, line iterator, events read so far)."""
    req = h.build_request("POST", f"{url}/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    r = await h.send(req, stream=True)
    assert r.status_code == 200, await r.aread()
    lines = r.aiter_lines()
    events = []
    while first_chunk and not events:
        events += sse_events([await lines.__anext__()])
    return r, lines, events


async def read_rest(r, lines, events: list) -> list:
    async for line in lines:
        events += sse_events([line])
    await r.aclose()
    return events


def tokens_of(events: list) -> int:
    return sum(1 for e in events if isinstance(e, dict) and e.get("choices"))


def test_waiting_bound_503_then_sigterm_drains_in_flight(tmp_path):
    srv = ServerProcess("--max-num-seqs", "1", "--max-num-waiting", "1", "--shutdown-timeout", "120",
                        log_dir=tmp_path).wait_ready()
    url = srv.url

    async def scenario() -> int:
        async with httpx.AsyncClient(timeout=120) as h:
            # seeds outside int64 once got a plain-text 500 after taking a waiting slot for good
            for seed in (2**70, 2**64 - 1, 2**70):
                r = await h.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "seed": seed})
                assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
            # A runs (the only seat), B waits: the bound of 1 waiting request is reached
            a = await open_stream(h, url, 12)
            b = await open_stream(h, url, 3, first_chunk=False)
            for stream in (False, True):
                r = await h.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": stream})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "waiting_queue_full"
            deadline = time.monotonic() + 30  # the engine reports B as waiting after its next step
            while metric((await h.get(f"{url}/metrics")).text, "vllm:num_requests_waiting") != 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            ev_a, ev_b = await read_rest(*a), await read_rest(*b)
            assert tokens_of(ev_a) == 12 and tokens_of(ev_b) == 3 and ev_a[-1] == ev_b[-1] == "[DONE]"
            # the server keeps serving once the queue drains
            ok = await h.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

            # SIGTERM with one request running and one waiting: both complete, then exit 0
            e = await open_stream(h, url, 10)
            f = await open_stream(h, url, 3, first_chunk=False)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.0)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                await h.get(f"{url}/health")
            ev_e, ev_f = await asyncio.wait_for(asyncio.gather(read_rest(*e), read_rest(*f)), 120)
            assert tokens_of(ev_e) == 10 and tokens_of(ev_f) == 3
            assert ev_e[-1] == ev_f[-1] == "[DONE]"
            assert not any("error" in x for x in ev_e + ev_f if isinstance(x, dict))
            return await asyncio.to_thread(srv.proc.wait, 60)

    try:
        assert asyncio.run(scenario()) == 0, srv.log_text()
    finally:
        srv.kill()


def test_shutdown_timeout_ends_in_flight_requests_with_openai_errors(tmp_path):
    """When --shutdown-timeout expires, a request still running or waiting gets a 503 JSON body and a
    stream an error event then [DONE] (uvicorn's own cancellation gave a plain-text 500 and a cut stream)."""
    srv = ServerProcess("--max-num-seqs", "1", "--shutdown-timeout", "1", log_dir=tmp_path).wait_ready()
    url = srv.url

    async def scenario() -> int:
        async with httpx.AsyncClient(timeout=60) as h:
            stream = await open_stream(h, url, 240)
            body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
            waiting = asyncio.ensure_future(h.post(f"{url}/v1/completions", json=body))
            await asyncio.sleep(0.3)
            srv.proc.send_signal(signal.SIGTERM)
            events, r = await asyncio.wait_for(asyncio.gather(read_rest(*stream), waiting), 30)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
            assert "--shutdown-timeout" in events[-2]["error"]["message"] and tokens_of(events) < 240
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
            return await asyncio.to_thread(srv.proc.wait, 30)

    try:
        assert asyncio.run(scenario()) == 0, srv.log_text()
    finally:
        srv.kill()


def test_engine_crash_ends_every_in_flight_request_with_an_error(tmp_path):
    srv = ServerProcess("--served-model-name", "smol", "--keep-alive-on-engine-death", log_dir=tmp_path).wait_ready()
    url = srv.url

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as h:
            assert (await h.get(f"{url}/v1/models")).json()["data"][0]["id"] == "smol"
            named = await h.post(f"{url}/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": 1})
            assert named.status_code == 200 and named.json()["model"] == "smol"
            streams = [await open_stream(h, url, 200) for _ in range(4)]
            body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
            plain = [asyncio.ensure_future(h.post(f"{url}/v1/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0.5)
            os.kill(srv.engine_pid(), signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(read_rest(*s) for s in streams), *plain), 30)
            assert time.monotonic() - t0 < 10
            for events in results[:4]:
                assert events[-1] == "[DONE]"
                err = events[-2]["error"]
                assert err["code"] == "engine_dead" and "exited" in err["message"]
                assert tokens_of(events) < 200
            for r in results[4:]:
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            health = await h.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            again = await h.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "stream": True})
            assert again.status_code == 503
            assert (await h.get(f"{url}/v1/models")).status_code == 200  # the API server itself lives on

    try:
        asyncio.run(scenario())
        assert srv.proc.poll() is None
        assert srv.terminate() == 0, srv.log_text()
    finally:
        srv.kill()


# ---- an exception inside the engine core, with executors that fail on purpose ------------------------
class _FailingExecutor:
    """An executor that is broken as a whole (not on one request's data), so the engine core must stop."""

    num_gpu_blocks, max_model_len, eos_token_id, vocab_size = 64, 128, None, 1000

    def execute(self, so):
        from testbed.engine.stepper import ExecutorFailure
        raise ExecutorFailure("boom in execute")

    def shutdown(self) -> None:
        pass


def failing_executor(model, config, **kw) -> _FailingExecutor:
    return _FailingExecutor()


def broken_executor(model, config, **kw):
    raise ValueError("cannot build this executor")


def _client(factory: str, executor_args: dict | None = None):
    from testbed.engine.config import EngineConfig
    from testbed.runtime.client import EngineClient
    from testbed.runtime.engine_proc import EngineProcConfig
    return EngineClient(EngineProcConfig(engine=EngineConfig().to_dict(), executor_factory=factory,
                                         executor_args=executor_args or {}))


@pytest.fixture
def tests_on_path(monkeypatch):
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(here)


MARK = [42, 4242, 42, 4242]  # a prompt starting with these token ids makes `marked_request_fails` raise


def marked_request_fails(model, config, **kw):
    """The real executor (bundled SmolLM2), except that any step holding a request whose prompt starts
    with MARK raises, as a sampler or input preparation failing on one request's data would."""
    from testbed.worker.executor import UniprocExecutor

    class MarkedRequestFails(UniprocExecutor):
        def _check(self, so) -> None:
            if any(list(r.prompt_token_ids[:len(MARK)]) == MARK for r in so.requests):
                raise RuntimeError("injected failure on a marked request")

        def execute(self, so):
            self._check(so)
            return super().execute(so)

        def execute_async(self, so):
            self._check(so)
            return super().execute_async(so)

    return MarkedRequestFails(model, config, **kw)


def test_a_failing_request_leaves_the_engine_up_and_engine_death_stops_the_server(tmp_path, tests_on_path):
    srv = ServerProcess("--executor-factory", f"{Path(__file__).stem}:marked_request_fails", "--metrics-prefix",
                        "testbed", log_dir=tmp_path).wait_ready()
    url = srv.url
    engine = srv.engine_pid()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as h:
            normal = await open_stream(h, url, 24)
            marked = {"prompt": MARK + [5, 6, 7], "max_tokens": 5, "ignore_eos": True}
            r = await h.post(f"{url}/v1/completions", json=marked)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "generation_failed" and "injected failure" in err["message"]
            async with h.stream("POST", f"{url}/v1/completions", json={**marked, "stream": True}) as s:
                events = sse_events([line async for line in s.aiter_lines()])
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "generation_failed"
            chat = await h.post(f"{url}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
            assert chat.status_code == 200, chat.text
            ev = await read_rest(*normal)
            assert tokens_of(ev) == 24 and ev[-1] == "[DONE]"
            assert not any("error" in x for x in ev if isinstance(x, dict))
            assert (await h.get(f"{url}/health")).status_code == 200
            page = (await h.get(f"{url}/metrics")).text
            assert metric(page, "testbed:request_success_total", finished_reason="error") == 2
            assert metric(page, "testbed:num_requests_running") == 0
            assert "vllm:" not in page  # --metrics-prefix testbed names every family testbed:

    async def engine_death() -> None:
        """By default the server exits 1 once the engine core dies, after ending what was in flight."""
        async with httpx.AsyncClient(timeout=60) as h:
            stream = await open_stream(h, url, 200)
            os.kill(engine, signal.SIGKILL)
            events = await asyncio.wait_for(read_rest(*stream), 30)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"

    try:
        asyncio.run(scenario())
        assert srv.engine_pid() == engine  # the same engine core served on
        asyncio.run(engine_death())
        assert srv.proc.wait(15) == 1, srv.log_text()
        assert "engine core died" in srv.log_text()
    finally:
        srv.kill()


def test_engine_exception_is_reported_then_process_dies(tests_on_path):
    from testbed.runtime.client import EngineDeadError

    async def scenario() -> None:
        client = _client(f"{Path(__file__).stem}:failing_executor")
        try:
            ready = await asyncio.wait_for(client.start(), 60)
            assert ready.max_model_len == 128 and ready.num_gpu_blocks == 64
            stream = client.add("r1", [1, 2, 3], time.time(), sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
            with pytest.raises(EngineDeadError, match="boom in execute"):
                await asyncio.wait_for(stream.get(), 30)
            assert client.is_dead
            deadline = time.monotonic() + 10
            while client.proc.poll() is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert client.proc.returncode == 1
            with pytest.raises(EngineDeadError):
                client.add("r2", [1], time.time(), sampling_params=SamplingParams(max_tokens=1))
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_engine_startup_failure_is_reported(tests_on_path):
    async def scenario() -> None:
        client = _client(f"{Path(__file__).stem}:broken_executor")
        with pytest.raises(RuntimeError, match="cannot build this executor"):
            await asyncio.wait_for(client.start(), 60)

    asyncio.run(scenario())


def test_serve_cli_rejects_bad_flags():
    import subprocess
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "serve", "--headless"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--data-parallel-size > 1" in r.stderr
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "serve", "--executor-factory", "no_function_here"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "MODULE:FUNCTION" in r.stderr


def test_emulated_executor_serves_the_engine_process():
    """`--emulate`'s executor runs in the real engine process: no model, each request echoes its prompt one
    token per step and finishes at max_tokens."""
    async def scenario() -> None:
        client = _client("testbed.sim.emulator:create", {"gpu": "H200", "cost_model": "roofline"})
        ready = await asyncio.wait_for(client.start(), 60)
        assert ready.vocab_size == 49152  # no model given: the bundled SmolLM2's shape
        # a request that cannot be encoded (a seed past uint64) leaves no stream and no count behind, so the
        # waiting estimate stays exact (it once took a waiting slot for good)
        unsendable = SamplingParams(max_tokens=5)
        unsendable.seed = 2**70  # set after validation
        with pytest.raises(OverflowError):
            client.add("r0", [11], time.time(), sampling_params=unsendable)
        assert "r0" not in client.streams and client.sent_seq == -1 and client.num_waiting_estimate == 0
        stream = client.add("r1", [11, 12, 13], time.time(),
                            sampling_params=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        tokens = []
        while True:
            out = await asyncio.wait_for(stream.get(), 30)
            tokens += out.new_token_ids
            if out.finished:
                break
        assert tokens == [11, 12, 13, 11, 12] and out.finish_reason == "length"
        assert client.sent_seq == client.stats.acked_seq == 0 and client.num_waiting_estimate == 0
        # the engine core checks what it is sent again: out-of-vocabulary ids are rejected, not run
        out = await asyncio.wait_for(client.add("r2", [49152], time.time(), sampling_params=SamplingParams(max_tokens=2)).get(), 30)
        assert out.finish_reason == "rejected" and "outside the vocabulary" in out.stop_reason
        await client.shutdown()

    asyncio.run(scenario())


SLOW = [43, 4343, 43, 4343]  # a prompt starting with these token ids makes `marked_request_is_slow` take 3 s a step
SLOW_STEP_S = 3.0


def marked_request_is_slow(model, config, **kw):
    """The real executor (bundled SmolLM2), except that a step holding a request whose prompt starts with
    SLOW takes SLOW_STEP_S longer, as a long prompt-logprobs step does."""
    from testbed.worker.executor import UniprocExecutor

    class MarkedRequestIsSlow(UniprocExecutor):
        def execute(self, so):
            if any(list(r.prompt_token_ids[:len(SLOW)]) == SLOW for r in so.requests):
                time.sleep(SLOW_STEP_S)
            return super().execute(so)

    return MarkedRequestIsSlow(model, config, **kw)


def test_a_request_counts_as_running_while_its_first_step_runs(tmp_path, tests_on_path):
    """/metrics says a request is running while its first (long) step runs, not only once it is over."""
    srv = ServerProcess("--executor-factory", f"{Path(__file__).stem}:marked_request_is_slow", log_dir=tmp_path)
    srv.wait_ready()

    async def scenario() -> list[float]:
        async with httpx.AsyncClient(timeout=60) as h:
            task = asyncio.ensure_future(h.post(f"{srv.url}/v1/completions",
                                                json={"prompt": SLOW + [5, 6], "max_tokens": 1}))
            seen = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < SLOW_STEP_S * 0.8:
                await asyncio.sleep(0.2)
                seen.append(metric((await h.get(f"{srv.url}/metrics")).text, "vllm:num_requests_running"))
            assert (await task).status_code == 200
            return seen

    try:
        seen = asyncio.run(scenario())
        assert seen[-1] == 1 and max(seen) == 1, seen  # during the step, before it ended
    finally:
        assert srv.terminate() == 0, srv.log_text()
