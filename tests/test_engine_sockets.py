"""The engine processes' sockets hold against what arrives on them, and a busy replica is never taken
for a dead one.

- Liveness: under `testbed serve -dp 2 --emulate` with a short --data-parallel-heartbeat-timeout (and a
  heartbeat interval to match), two streams that each decode for twice the timeout (no request arrives or
  ends meanwhile) finish whole; no replica is declared dead.
- Frames: every socket that listens for frames from other processes (the coordinator's
  --data-parallel-rpc-port, its API-server socket, the API server's output socket) gets a fuzz of raw
  frames: random bytes, multipart messages, well-formed messages without the deployment's tag (a forged
  ReplicaFailed or Shutdown above all), messages tagged with another secret, and tagged frames of the
  wrong type. No process dies, every replica still serves, and the drops are logged.
- The request message: AddRequest carries the validated parameter classes whole, and what the engine decodes
  is the same parameters; parameters that fail their validation make no message.
Real processes on 127.0.0.1 and ipc; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import zmq

from server_helpers import replica_pids, running_server
from testbed.engine.config import EngineConfig
from testbed.engine.params import PoolingParams, SamplingParams, StructuredOutputsParams
from testbed.runtime import dp_protocol as D
from testbed.runtime import protocol as P
from testbed.runtime.dp_client import DPEngineClient, DPTopology
from testbed.runtime.engine_proc import EngineProcConfig
from testbed.runtime.frames import SECRET_ENV, Frames

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT_S = 1.5
HEARTBEAT_INTERVAL_S = 0.25  # six heartbeats a timeout (the least the flags allow is three)
# tokens a liveness stream decodes: the emulated Llama-3.1-8B on an H100 (its shipped profile) takes about 6.6 ms a
# step at batch 1, so a stream lasts at least ~3.6 s, past twice the timeout with a margin
STREAM_TOKENS = 550


def test_add_request_carries_the_parameters_whole():
    so = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    sp = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, seed=-4, max_tokens=9, min_tokens=0, stop=["x"],
                        stop_token_ids=[4], ignore_eos=True, logprobs=2, presence_penalty=0.5, frequency_penalty=-1,
                        repetition_penalty=1.2, min_p=0.1, logit_bias={3: 250}, allowed_token_ids=[1, 2, 3, 4, 5],
                        bad_words_token_ids=[[5, 6]], prompt_logprobs=1, include_stop_str_in_output=True,
                        truncate_prompt_tokens=7, structured_outputs=so)
    frames = Frames("s3cret", "test")
    for msg in (P.AddRequest(3, "r", [1, 2], 1.5, sampling_params=sp, priority=-2),
                P.AddRequest(4, "e", [1], 2.0, pooling_params=PoolingParams("MEAN", False).resolve())):
        got = frames.decode(frames.encode(msg), P.to_engine_decoder, "test")
        assert got == msg and got is not msg
    assert got.pooling_params.pooling_type == "MEAN" and got.sampling_params is None
    # decoding checks the parameters with their own validation: a field spoilt after it never reaches a core
    sp.temperature = -1.0
    with pytest.raises(msgspec.ValidationError, match="temperature must be a finite number"):
        P.to_engine_decoder.decode(msgspec.msgpack.encode(P.AddRequest(5, "r", [1], 0.0, sampling_params=sp)))


def test_replicas_decoding_for_longer_than_the_heartbeat_timeout_stay_alive(tmp_path):
    args = ["--emulate", "--model", "Llama-3.1-8B", "--load-format", "dummy", "--gpu", "H100-SXM",
            "-dp", "2", "--dp-policy", "round_robin", "--max-model-len", "4096", "--num-gpu-blocks", "640",
            "--data-parallel-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
            "--data-parallel-heartbeat-interval", str(HEARTBEAT_INTERVAL_S)]
    with running_server(*args, log_dir=tmp_path) as srv:
        async def stream(i: int) -> tuple[int, str | None, float]:
            client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=120, max_retries=0)
            t0 = time.monotonic()
            n, reason = 0, None
            async for chunk in await client.completions.create(
                    model=srv_model(srv), prompt=[11 + i, 12, 13], max_tokens=STREAM_TOKENS, stream=True,
                    extra_body={"ignore_eos": True}):
                for c in chunk.choices:
                    n += 1 if c.text else 0
                    reason = c.finish_reason or reason
            return n, reason, time.monotonic() - t0

        async def both():
            return await asyncio.gather(stream(0), stream(1))

        results = asyncio.run(both())
        for n, reason, took in results:
            assert reason == "length", (results, srv.log_text())
            assert took > 2 * HEARTBEAT_TIMEOUT_S, f"the streams must outlast the timeout twice: {results}"
        log = srv.log_text()
        assert "is dead" not in log and "engine_dead" not in log, log

        # the second case: the replica left after the other was killed decodes on past the timeout
        os.kill(replica_pids(srv)[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/health", timeout=10).json().get("dead_engines") is None:
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.2)
        n, reason, took = asyncio.run(stream(0))
        assert reason == "length" and took > 2 * HEARTBEAT_TIMEOUT_S, (n, reason, took, srv.log_text())
        health = httpx.get(f"{srv.url}/health", timeout=10).json()
        assert health["dead_engines"].keys() == {"1"}, health


def srv_model(srv) -> str:
    import httpx
    return httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]


def fuzz_frames(rng: random.Random, secret: str) -> list[list[bytes]]:
    """Frames (each a multipart message) that no socket may act on or die of."""
    forged = [D.ReplicaFailed(0, "forged"), D.ReplicaFailed(1, "forged"), D.ReplicaGone(0, "forged"),
              D.ReplicaGone(1, "forged"), P.Shutdown(), D.Heartbeat(0), D.Hello(0, "input", 1, "x"),
              D.Routed("r", 0), D.ReplicaDead(0, "forged"), D.DPAbort(0, ["a"])]
    enc = msgspec.msgpack.Encoder()
    other = Frames(secret + "-other", "fuzz")
    ours = Frames(secret, "fuzz")
    frames: list[list[bytes]] = [[b"\x00" * 14], [b""], [b"\xc1"], [b"\x93\x01\x02"]]
    frames += [[enc.encode(m)] for m in forged]                     # no tag at all
    frames += [[other.encode(m)] for m in forged]                   # tagged with another secret
    frames += [[ours.encode(m)[:-1]] for m in forged]               # truncated: the tag no longer matches
    frames += [[ours.sign(b"\xa5hello")], [ours.sign(b"")], [ours.encode([1, 2, 3])]]  # ours, but no message
    frames += [[bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200)))] for _ in range(120)]
    frames += [[b"a", b"b", b"c"] for _ in range(3)] + [[b"x"] * 5]  # multipart
    rng.shuffle(frames)
    return frames


def test_a_fuzz_of_raw_frames_kills_no_engine_process(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(SECRET_ENV, "s3cret-for-this-test")
    config = EngineConfig(data_parallel_size=2, dp_policy="round_robin", max_num_seqs=4, max_model_len=4096)
    proc = EngineProcConfig(engine=config.to_dict(), model="Llama-3.2-1B",
                            executor_factory="testbed.sim.emulator:create",
                            executor_args={"gpu": "H200", "cost_model": "zero"})
    client = DPEngineClient(proc, DPTopology(2))
    ctx = zmq.Context()
    frames = fuzz_frames(random.Random(0), "s3cret-for-this-test")

    async def serve_one_each() -> None:
        streams = [client.add(f"q{time.monotonic_ns()}-{i}", [11, 12, 13], time.time(),
                              sampling_params=SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
                   for i in range(2)]
        engines = set()
        for s in streams:
            while True:
                out = await asyncio.wait_for(s.get(), 30)
                if out.finished:
                    assert out.finish_reason == "length", out
                    engines.add(s.engines[s.request_id])
                    break
        assert engines == {0, 1}

    async def scenario() -> None:
        await asyncio.wait_for(client.start(), 120)
        await serve_one_each()
        targets = {
            "the coordinator's --data-parallel-rpc-port": (zmq.DEALER, client.rpc_addr),
            "the coordinator's API-server socket": (zmq.PUSH, client.front_addr),
            "the API server's output socket": (zmq.PUSH, client.out.getsockopt(zmq.LAST_ENDPOINT).decode()),
        }
        for name, (kind, addr) in targets.items():
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            for parts in frames:
                sock.send_multipart(parts)
            await asyncio.sleep(1.0)  # let every frame arrive (and be dropped)
            sock.close()
            assert client.proc.poll() is None, f"the coordinator died of frames at {name}"
            assert not client.dead_engines and not client.is_dead, (name, client.dead_engines)
            assert all(p.poll() is None for p in client.replicas.procs.values()), name
            await serve_one_each()

    async def run() -> None:
        try:
            await scenario()
        finally:
            await client.shutdown(timeout=10)

    asyncio.run(run())
    ctx.term()
    err = capfd.readouterr().err
    for where in ("testbed dp coordinator: dropped a malformed frame on --data-parallel-rpc-port",
                  "testbed dp coordinator: dropped a malformed frame on its API-server socket",
                  "testbed serve: dropped a malformed frame on its output socket"):
        assert where in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_fuzz_of_raw_frames_at_the_single_engine_socket_kills_nothing(monkeypatch, capfd):
    """The one socket a single-engine server listens on (its engine output socket, IPC in a private folder)
    drops the same fuzz, with forged engine messages besides (an EngineError that would end every request, a
    second Ready, empty Outputs), unsigned, under another secret or truncated: the client stays alive, the
    engine core keeps serving and the drops are logged."""
    from testbed.runtime.client import EngineClient
    secret = "s3cret-for-this-test"
    monkeypatch.setenv(SECRET_ENV, secret)
    proc = EngineProcConfig(engine=EngineConfig(max_num_seqs=4, max_model_len=4096).to_dict(), model="Llama-3.2-1B",
                            executor_factory="testbed.sim.emulator:create",
                            executor_args={"gpu": "H200", "cost_model": "zero"})
    client = EngineClient(proc)
    forged = [P.EngineError("forged"), P.Ready(1, 16, 4096, 2, 128, 1),
              P.Outputs([], P.SchedulerStats(0, 0, 0.0, 0, 0, 0, -1))]
    enc, other, ours = msgspec.msgpack.Encoder(), Frames(secret + "-other", "fuzz"), Frames(secret, "fuzz")
    frames = fuzz_frames(random.Random(1), secret)
    frames += [[enc.encode(m)] for m in forged] + [[other.encode(m)] for m in forged]
    frames += [[ours.encode(m)[:-1]] for m in forged]

    async def serve_one() -> None:
        s = client.add(f"q{time.monotonic_ns()}", [11, 12, 13], time.time(),
                       sampling_params=SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        while not (out := await asyncio.wait_for(s.get(), 30)).finished:
            pass
        assert out.finish_reason == "length", out

    async def scenario() -> None:
        try:
            await asyncio.wait_for(client.start(), 120)
            await serve_one()
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(client.out.getsockopt(zmq.LAST_ENDPOINT).decode())
            for parts in frames:
                sock.send_multipart(parts)
            await asyncio.sleep(1.0)
            sock.close()
            assert client.proc.poll() is None and not client.is_dead, client.dead_reason
            await serve_one()
        finally:
            await client.shutdown(timeout=10)

    asyncio.run(scenario())
    err = capfd.readouterr().err
    assert "testbed serve: dropped a malformed frame on its engine output socket" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
