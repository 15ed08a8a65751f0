"""The robustness rules hold for every data-parallel replica: DPEngineClient (the DP coordinator process
and two replica processes, round robin) over an emulated executor, so no model loads. A request that
cannot be encoded leaves no stream and no count behind; each replica checks what it is sent again;
a request its executor fails on ends alone with finish_reason "error" while its replica serves on; a
dead replica fails its requests and takes its load out of the waiting estimate, and only the last
one's death makes the engine dead (`on_death`, once); `fail_all` (an expired --shutdown-timeout) ends
the requests in flight with its code and aborts them on their replica. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from testbed.engine.params import SamplingParams
from testbed.engine.config import EngineConfig
from testbed.runtime.client import EngineDeadError
from testbed.runtime.dp_client import DPEngineClient, DPTopology
from testbed.runtime.engine_proc import EngineProcConfig

pytestmark = pytest.mark.timeout(180)

MARK = [42, 4242, 42, 4242]  # a prompt starting with these token ids makes a step of `slow_marked` raise
STEP_S = 0.01
LONG = 2000  # tokens: 20 s of steps, far longer than any check below


def slow_marked(model, config, **kw):
    """The emulator with a fixed step time, failing any step that holds a request whose prompt starts
    with MARK (as a sampler failing on one request's data would)."""
    from testbed.sim.emulator import EmulatedExecutor

    class SlowMarked(EmulatedExecutor):
        def _predict(self, so) -> float:
            return STEP_S

        def execute(self, so):
            if any(list(r.prompt_token_ids[:len(MARK)]) == MARK for r in so.requests):
                raise RuntimeError("injected failure on a marked request")
            return super().execute(so)

    return SlowMarked("SmolLM2-135M", config, "H100-SXM", "zero")


@pytest.fixture
def tests_on_path(monkeypatch):
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


async def until(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


async def drain(stream):
    """Every output of a stream up to its finished one."""
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(await asyncio.wait_for(stream.get(), 30))
    return outs


def test_every_replica_validates_isolates_failures_and_keeps_accounting_exact(tests_on_path):
    config = EngineConfig(data_parallel_size=2, dp_policy="round_robin", max_num_seqs=2, max_model_len=4096)
    proc = EngineProcConfig(engine=config.to_dict(), executor_factory=f"{Path(__file__).stem}:slow_marked")
    client = DPEngineClient(proc, DPTopology(2))
    deaths: list[str] = []
    client.on_death = deaths.append
    n = 0

    def add(prompt, max_tokens: int):
        nonlocal n
        n += 1
        return client.add(f"r{n}", prompt, time.time(),
                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))

    async def scenario() -> None:
        ready = await asyncio.wait_for(client.start(), 120)
        # a request that cannot be encoded (a seed past uint64) leaves no stream and no count behind
        unsendable = SamplingParams(max_tokens=5)
        unsendable.seed = 2**70  # set after validation
        with pytest.raises(OverflowError):
            client.add("bad", [11], time.time(), sampling_params=unsendable)
        assert "bad" not in client.streams and client.sent_seq == -1 and client.num_waiting_estimate == 0

        # each replica checks what it is sent: out-of-vocabulary ids are rejected there, not run
        for _ in range(2):
            out = (await drain(add([ready.vocab_size], 2)))[-1]
            assert out.finish_reason == "rejected" and "outside the vocabulary" in out.stop_reason

        # on each replica, a request the executor fails on ends alone; the one batched with it goes on
        normal = [add([11, 12, 13], 30) for _ in range(2)]
        marked = [add(MARK + [5, 6], 5) for _ in range(2)]
        for s in marked:
            out = (await drain(s))[-1]
            assert out.finish_reason == "error" and "injected failure" in out.stop_reason
        for s in normal:
            outs = await drain(s)
            assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 30
        assert sorted(s.engines[rid] for s in normal + marked for rid in s.engines) == [0, 0, 1, 1]
        await until(lambda: client.num_waiting_estimate == 0, "no request waits")

        # two running and one waiting on each replica; replica 1 dies: its requests fail, its waiting
        # request leaves the estimate with it, and the engine as a whole lives on
        streams = [add([20 + i, 21, 22], LONG) for i in range(6)]
        await until(lambda: all(s.request_id in s.engines for s in streams) and client.num_waiting_estimate == 2,
                    "each replica reports one waiting request")
        on = {s.request_id: s.engines[s.request_id] for s in streams}
        os.kill(client.replica_pids()[1], signal.SIGKILL)
        for s in streams:
            if on[s.request_id] == 1:
                with pytest.raises(EngineDeadError, match="replica 1"):
                    await drain(s)
        assert list(client.dead_engines) == [1] and not client.is_dead and deaths == []
        assert client.num_waiting_estimate == 1  # replica 0's waiting request only

        # fail_all ends replica 0's requests with its code, later adds are refused, replica 0 aborts them
        client.fail_all("the server is shutting down", "server_shutting_down")
        for s in streams:
            if on[s.request_id] == 0:
                with pytest.raises(EngineDeadError) as e:
                    await drain(s)
                assert e.value.code == "server_shutting_down"
        with pytest.raises(EngineDeadError, match="shutting down"):
            add([11], 2)
        await until(lambda: client.engine_stats[0].num_running == client.engine_stats[0].num_waiting == 0,
                    "replica 0 aborted its requests")
        assert client.num_waiting_estimate == 0 and not client.streams

        # the last replica's death is the engine's
        os.kill(client.replica_pids()[0], signal.SIGKILL)
        await until(lambda: client.is_dead, "the engine counts as dead")
        await asyncio.sleep(0.3)
        assert len(deaths) == 1 and "every data-parallel replica died" in deaths[0]

    async def run() -> None:
        try:
            await scenario()
        finally:
            await client.shutdown()

    asyncio.run(run())
