"""`testbed bench serve`: client-side metrics as vLLM's benchmark defines them, and the run directory it
writes (mode "real", server steps from --log-steps) for the random / sharegpt datasets and traces,
against a real `testbed serve` on 127.0.0.1 (bundled SmolLM2 on the CPU)."""
from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import ServerProcess
from testbed.engine.metrics import summarize
from testbed.runs.rundir import read_run
from testbed.cli import main as cli_main
from testbed.bench.serve import build_records


def main(args: list[str]) -> int:
    return cli_main(["bench", "serve", *args])
from testbed.bench.client import RequestResult
from testbed.bench.datasets import BenchRequest, gamma_arrivals

pytestmark = pytest.mark.timeout(300)


def test_metrics_follow_vllm_definitions():
    reqs = [BenchRequest("a", 0.0, [1], 5, 3), BenchRequest("b", 0.5, [1], 7, 1)]
    results = [RequestResult("a", 0.0, "cmpl-a", ttft=0.1, latency=0.4, itl=[0.1, 0.2], output_tokens=3,
                             prompt_tokens=5, finish_reason="length"),
               RequestResult("b", 0.5, "cmpl-b", ttft=0.3, latency=0.3, output_tokens=1, prompt_tokens=7,
                             finish_reason="length")]
    rec = build_records(results, reqs, 100.0, 101.0, None)
    cols = rec.request_columns()
    assert cols["first_token"] == [0.1, 0.8] and cols["finish"] == [0.4, 0.8]
    s = summarize(cols, rec.step_columns(), rec.itl)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2)              # first chunk - send
    assert s["tpot_s"]["mean"] == pytest.approx((0.4 - 0.1) / 2)  # (E2E - TTFT) / (out - 1), out > 1 only
    assert s["itl_s"]["mean"] == pytest.approx(0.15)              # every gap between chunks
    assert s["e2e_s"]["mean"] == pytest.approx(0.35)              # last chunk - send
    assert s["output_throughput"] == pytest.approx(4 / 0.8)
    failed = RequestResult("c", 0.2, None, latency=0.05, finish_reason="rejected", error="HTTP 503")
    cols = build_records([failed], [BenchRequest("c", 0.2, [1], 4, 2)], 0, 1, None).request_columns()
    assert cols["request_id"] == ["c"] and cols["first_token"] == [None] and cols["finish_reason"] == ["rejected"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("steps")
    srv = ServerProcess("--log-steps", str(log_dir), log_dir=log_dir)
    try:
        srv.wait_ready()
        srv.log_dir = log_dir
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log_text()


def bench(server, out, *args: str) -> tuple[int, object]:
    code = main(["--url", server.url, "--server-log-steps", str(server.log_dir), "-o", str(out), "--disable-tqdm",
                 *args])
    return code, read_run(out) if code == 0 else None


def test_random_dataset_run_directory(server, tmp_path, capsys):
    code, run = bench(server, tmp_path / "run", "--dataset", "random", "--num-prompts", "6", "--random-input-len",
                      "8", "--random-output-len", "4", "--max-concurrency", "3")
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert run.manifest["mode"] == "real" and run.manifest["server"]["model"]["id"] == "SmolLM2-135M-Instruct"
    req = run.requests()
    assert len(req) == 6 and set(req.finish_reason) == {"length"}
    assert (req.output_tokens == 4).all() and (req.input_tokens == 8).all()
    assert (req.arrival <= req.first_scheduled).all() and (req.first_scheduled <= req.first_token).all()
    assert (req.first_token <= req.finish).all()
    steps = run.steps()
    assert len(steps) > 0 and (steps.start >= 0).all()
    assert steps.num_decode_tokens.sum() + steps.num_prefill_tokens.sum() >= 6 * (8 + 3)
    s = run.summary
    assert s["num_finished"] == 6 and s["num_failed"] == 0 and s["total_output_tokens"] == 24
    tpot = ((req.finish - req.first_token) / 3).mean()
    assert s["tpot_s"]["mean"] == pytest.approx(tpot)
    assert s["num_steps"] == len(steps)
    # with --max-concurrency 3 no more than 3 requests are ever in flight
    events = sorted([(t, 1) for t in req.arrival] + [(t, -1) for t in req.finish], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 3


def test_trace_replay_keeps_arrivals_and_clips(server, tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"id": f"r{i}", "arrival_s": 0.4 * i, "input_tokens": 6, "output_tokens": 3} for i in range(3)]
    rows.append({"id": "long", "arrival_s": 1.2, "input_tokens": 300, "output_tokens": 2})
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, run = bench(server, tmp_path / "run", str(trace))
    assert code == 0
    req = run.requests().sort_values("arrival")
    for arrival, want in zip(req.arrival, (0.0, 0.4, 0.8, 1.2)):
        assert want - 0.01 <= arrival <= want + 0.3
    assert list(req.output_tokens) == [3, 3, 3, 2]
    assert req.input_tokens.iloc[-1] == 256 - 2  # clipped to max_model_len
    assert run.manifest["trace"]["clipped"] == 1


def test_request_rate_uses_the_simulators_arrivals(server, tmp_path):
    code, run = bench(server, tmp_path / "run", "--dataset", "random", "--num-prompts", "4", "--random-input-len",
                      "4", "--random-output-len", "2", "--request-rate", "8", "--burstiness", "2", "--seed", "3")
    assert code == 0
    want = gamma_arrivals(4, 8.0, 2.0, 3)
    got = sorted(run.requests().arrival)
    assert all(w - 0.01 <= g <= w + 0.3 for g, w in zip(got, want))


def test_sharegpt_dataset(server, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": "Tell me a short story about a brave little fox."},
                                {"from": "gpt", "value": "Once upon a time a small fox crossed the river."}]},
             {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!"}]},
             {"conversations": [{"from": "human", "value": "What is the capital city of France, please?"},
                                {"from": "gpt", "value": "The capital of France is Paris."}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    code, run = bench(server, tmp_path / "run", "--dataset", "sharegpt", "--dataset-path", str(path))
    assert code == 0
    req = run.requests()
    assert len(req) == 2 and set(req.finish_reason) == {"length"}  # "Hi" is under 4 tokens: skipped

    def count(text: str) -> int:
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["count"]
    want = {(count(c["conversations"][0]["value"]), count(c["conversations"][1]["value"])) for c in (convs[0], convs[2])}
    assert set(zip(req.input_tokens, req.output_tokens)) == want


def test_bad_inputs_fail_clearly(server, tmp_path, capsys):
    assert main(["--url", "http://127.0.0.1:9", "--dataset", "random", "--num-prompts", "1"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert main(["--url", server.url, "--num-prompts", "1"]) == 2
    assert "give either a TRACE" in capsys.readouterr().err
    assert main(["--url", server.url, "--dataset", "random", "--random-input-len", "300", "--num-prompts", "1"]) == 2
    assert "max_model_len is 256" in capsys.readouterr().err


def test_an_async_servers_logged_steps_keep_when_each_was_scheduled(tmp_path):
    """A server with --async-scheduling logs each step's schedule time after its record (steps.parquet's
    `scheduled`): the run directory holds it, relative to the run's start like the steps' starts."""
    log_dir = tmp_path / "steps"
    srv = ServerProcess("--async-scheduling", "--log-steps", str(log_dir), log_dir=tmp_path)
    try:
        srv.wait_ready()
        code = main(["--url", srv.url, "--server-log-steps", str(log_dir), "-o", str(tmp_path / "run"),
                     "--disable-tqdm", "--dataset", "random", "--num-prompts", "4", "--random-input-len", "8",
                     "--random-output-len", "6", "--max-concurrency", "2"])
    finally:
        assert srv.terminate() == 0, srv.log_text()
    assert code == 0
    steps = read_run(tmp_path / "run").steps(columns=["start", "duration", "scheduled", "num_decode_tokens"])
    assert len(steps) > 4 and (steps["scheduled"] >= 0).all()
    assert (steps["scheduled"] <= steps["start"] + 1e-9).all()  # scheduled before it began on the device
    assert (steps["scheduled"] < steps["start"] - 1e-6).any()  # some while the step before it ran
