"""Decision parity for data parallelism: fed a DP run's recorded timings (per-replica step timelines,
when each request was routed and admitted, when each stats report was sampled and taken), the
simulator makes the same decisions: every request goes to the same replica, every replica forms
the same batches, every report carries the same stats.

`testbed replay -dp 2` runs the bundled SmolLM2 for real (two replica processes behind the DP
coordinator) on the small trace of test_parity.py; `testbed simulate --cost-model recorded:RUN_DIR`
replays it. Simulated runs replay themselves the same way for every policy. LLM(data_parallel_size=2)
generates what one replica does.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest

from test_parity import FLAGS, REQUEST_OUTCOMES, STEP_DECISIONS, write_trace
from testbed.cli import main
from testbed.engine.config import EngineConfig
from testbed.runs.rundir import read_run
from testbed.sim.run import run_simulation

from conftest import REPO

POLICIES = ["round_robin", "least_loaded", "kv_aware", "prefix_affinity"]


def assert_same_decisions(a, b) -> None:
    ra, rb = read_run(a), read_run(b)
    sa = ra.steps().sort_values(["replica", "start"], ignore_index=True)
    sb = rb.steps().sort_values(["replica", "start"], ignore_index=True)
    pd.testing.assert_frame_equal(sa[["replica", *STEP_DECISIONS]], sb[["replica", *STEP_DECISIONS]])
    qa = ra.requests().sort_values("request_id", ignore_index=True)
    qb = rb.requests().sort_values("request_id", ignore_index=True)
    pd.testing.assert_frame_equal(qa[["replica", *REQUEST_OUTCOMES]], qb[["replica", *REQUEST_OUTCOMES]])
    pa, pb = ra.dp_table("publications"), rb.dp_table("publications")
    stats = ["seq", "replica", "steps", "num_waiting", "num_running", "num_free_blocks", "num_waiting_tokens",
             "num_added"]
    pd.testing.assert_frame_equal(pa.sort_values("seq", ignore_index=True)[stats],
                                  pb.sort_values("seq", ignore_index=True)[stats])


def simulated_and_replayed(tmp_path, **kw):
    """(run, its replay): 120 requests of the Azure slice at 25 req/s simulated with engine flags `kw`, then simulated
    again from that run's own recorded timings."""
    trace = str(REPO / "traces" / "azure_conv_10min.jsonl")
    a, _ = run_simulation(trace, EngineConfig(**kw), limit=120, request_rate=25.0, output=tmp_path / "a",
                          progress=False)
    b, _ = run_simulation(trace, EngineConfig(**kw), limit=120, request_rate=25.0, output=tmp_path / "b",
                          progress=False, cost_model=f"recorded:{a}")
    return a, b


@pytest.mark.parametrize("policy", POLICIES)
def test_a_simulated_dp_run_replays_itself_exactly(tmp_path, policy):
    """Recorded timings of a simulation (stale stats, routing delay, prefix sharing) reproduce it."""
    a, b = simulated_and_replayed(tmp_path, data_parallel_size=3, dp_policy=policy, max_num_seqs=6,
                                  num_gpu_blocks=200, dp_stats_interval=0.03, dp_routing_delay=0.004,
                                  enable_prefix_caching=True)
    assert_same_decisions(a, b)
    assert read_run(a).requests()["replica"].nunique() == 3


@pytest.mark.parametrize("run", ["2026-11-24_188d114_h100_llama-3.2-1b/runs/real-2pergpu-rate16",
                                 "2026-11-26_08cb01d_h200x2_llama-3.2-1b/runs/real-2x1-rate96"])
def test_a_real_dp_run_with_rejected_requests_replays_exactly_from_its_directory(tmp_path, capsys, run):
    """`simulate --like RUN --cost-model recorded:RUN` on committed real DP runs (two replicas on one GPU, and one
    per GPU) whose long requests were rejected: the run directory as the trace keeps them, so the coordinator
    routes them as the real one did and every decision matches."""
    real = REPO / "benchmarks" / "results" / "dp" / run
    assert (read_run(real).requests()["finish_reason"] == "rejected").any()
    assert main(["simulate", "--like", str(real), "--cost-model", f"recorded:{real}", "--no-progress", "--format",
                 "json", "-o", str(tmp_path / "sim")]) == 0
    capsys.readouterr()
    assert_same_decisions(real, tmp_path / "sim")


def test_a_changed_decision_is_reported_not_absorbed(tmp_path):
    """Replayed under another policy, the first routing that differs stops the run with its details."""
    kw = dict(data_parallel_size=2, max_num_seqs=6, num_gpu_blocks=200)
    trace = str(REPO / "traces" / "azure_conv_10min.jsonl")
    a, _ = run_simulation(trace, EngineConfig(dp_policy="least_loaded", **kw), limit=60, request_rate=25.0,
                          output=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="--dp-policy round_robin, but .* routed with least_loaded"):
        run_simulation(trace, EngineConfig(dp_policy="round_robin", **kw), limit=60, request_rate=25.0,
                       progress=False, cost_model=f"recorded:{a}")
    with pytest.raises(RuntimeError, match="diverged"):  # a smaller cache: other batches, other reports
        run_simulation(trace, EngineConfig(dp_policy="least_loaded", **{**kw, "num_gpu_blocks": 40}), limit=60,
                       request_rate=25.0, progress=False, cost_model=f"recorded:{a}")


@pytest.mark.smollm2
@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_dp_replay_and_recorded_simulation_make_the_same_decisions(tmp_path, capsys, policy):
    from testbed.worker.smollm2 import default_model_dir
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, structured=(7,))  # one grammar, late enough for the preemptions below
    real, sim = tmp_path / "real", tmp_path / "sim"
    dp = ["-dp", "2", "--dp-policy", policy]
    assert main(["replay", str(trace), "--model", str(default_model_dir()), "-o", str(real), *dp, *FLAGS]) == 0
    real_summary = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(trace), "--model", "SmolLM2-135M", "--cost-model", f"recorded:{real}",
                 "-o", str(sim), "--no-progress", *dp, *FLAGS]) == 0
    sim_summary = json.loads(capsys.readouterr().out)
    assert_same_decisions(real, sim)
    run = read_run(real)
    req, steps, routes = run.requests(), run.steps(), run.dp_table("routes")
    assert run.manifest["config"]["data_parallel_size"] == 2 and set(steps["replica"]) == {0, 1}
    assert set(req["replica"]) == {0, 1} and sorted(routes["request_id"]) == sorted(req["request_id"])
    assert (routes["sent"] <= routes["routed"]).all() and (routes["routed"] <= routes["added"]).all()
    if policy == "round_robin":
        assert routes.sort_values("seq")["replica"].tolist() == [0, 1] * 4
    assert real_summary["num_rejected"] == sim_summary["num_rejected"] == 1  # the 300-token prompt
    assert sim_summary["num_finished"] == real_summary["num_finished"] == 7
    assert steps["num_preempted"].sum() > 0  # the tiny caches preempt: the batches were not trivial
    assert run.dp_table("grammars")["request_id"].tolist() == ["r7"]  # replayed by the simulation above


@pytest.mark.smollm2
@pytest.mark.timeout(300)
def test_llm_with_two_replicas_generates_what_one_does():
    """Every sampling parameter reaches the replicas: plain greedy, logits processing, a grammar and prompt
    logprobs give what one engine gives."""
    from testbed import LLM, SamplingParams
    from testbed.engine.params import StructuredOutputsParams
    prompts = ["The capital of France is", "Water boils at", "The largest planet is", "One plus one is"]
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    processed = [SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.8, prompt_logprobs=1),
                 SamplingParams(temperature=0.0, max_tokens=6, logit_bias={216: -100}),  # the first token
                 SamplingParams(temperature=0.0, max_tokens=6, bad_words=["the"]),
                 SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                structured_outputs=StructuredOutputsParams(choice=["hot", "cold"]))]

    def run(llm) -> list:
        outs = llm.generate(prompts, sp) + llm.generate(prompts, processed)
        return [(o.outputs[0].text, o.prompt_logprobs) for o in outs]

    one = LLM(max_model_len=256, num_gpu_blocks=64)
    try:
        want = run(one)
        want_embedded = [o.outputs.embedding for o in one.embed(prompts[:2])]
    finally:
        one.shutdown()
    assert want[7][0] in ("hot", "cold") and want[4][1] is not None
    assert all(w[0] != p[0] for w, p in zip(want[4:], want[:4]))  # processing changed every output
    two = LLM(max_model_len=256, num_gpu_blocks=64, data_parallel_size=2, dp_policy="round_robin")
    try:
        got = two.generate(prompts, sp)
        assert [o.outputs[0].text for o in got] == [w[0] for w in want[:4]]
        assert all(o.outputs[0].finish_reason == "length" for o in got)
        outs = two.generate(prompts, processed)
        assert [o.outputs[0].text for o in outs] == [w[0] for w in want[4:]]
        for o, (_, want_plp) in zip(outs, want[4:]):  # prompt logprobs: the same tokens and ranks; values to fp32
            # rounding (a replica has half the cores, so its matmuls sum in another order)
            assert (o.prompt_logprobs is None) == (want_plp is None)
            for got_pos, want_pos in zip(o.prompt_logprobs or [], want_plp or []):
                assert (got_pos is None) == (want_pos is None)
                if got_pos is not None:
                    assert {t: lp.rank for t, lp in got_pos.items()} == {t: lp.rank for t, lp in want_pos.items()}
                    assert all(abs(lp.logprob - want_pos[t].logprob) < 1e-4 for t, lp in got_pos.items())
        for o in got:  # the replicas' first scheduling, the tokens' arrival here
            m = o.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        for o, want_vec in zip(two.embed(prompts[:2]), want_embedded):  # pooling requests reach the replicas too
            assert max(abs(a - b) for a, b in zip(o.outputs.embedding, want_vec)) < 1e-5
    finally:
        two.shutdown()
    assert sorted({row[1] for row in two.records().requests}) == [0, 1]
