"""Pipeline parallelism: vLLM's layer partition, the batch queue (up to N batches in flight, a request never in
two of them), and real stages over gloo that give PP=1's greedy tokens and logprobs (fp32) and transformers'
tokens, with continuous batching, chunked prefill and prefix caching, uneven splits and PP x TP.

Only one multi-process engine can live in a process (one torch.distributed group): each test shuts its engines
down before the next starts, and checks that no worker is left."""
from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from conftest import FixedTokenExecutor, check_step, make_engine, make_request
from llm_helpers import hf_greedy, random_prompts, save_tiny_llama
from testbed import LLM, SamplingParams
from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.engine.stepper import EngineStepper
from testbed.specs.partition import get_pp_indices, pp_partition

pytestmark = pytest.mark.timeout(240)  # worker processes: never let a hang stall the suite

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=8, enable_prefix_caching=True)


# ---- the partition ---------------------------------------------------------------------------------
def test_partition_follows_vllm_rule():
    """The remainder goes to the stages before the last, from the second-to-last backwards (vLLM's examples)."""
    assert pp_partition(30, 4) == [7, 8, 8, 7]
    assert pp_partition(61, 4) == [15, 15, 16, 15] and pp_partition(61, 2) == [31, 30]
    assert pp_partition(5, 3) == [2, 2, 1] and pp_partition(32, 4) == [8] * 4
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    with pytest.raises(ValueError, match="exceeds the model's 2 decoder layers"):
        pp_partition(2, 3)


@given(st.integers(1, 200), st.integers(1, 16))
def test_partition_is_contiguous_balanced_and_spares_the_last_stage(layers, pp):
    if pp > layers:
        return
    parts = pp_partition(layers, pp)
    assert sum(parts) == layers and max(parts) - min(parts) <= 1 and min(parts) >= 1
    assert parts[-1] == min(parts)  # the last stage (LM head, sampling) never takes an extra layer
    assert [get_pp_indices(layers, r, pp) for r in range(pp)] == [
        (sum(parts[:r]), sum(parts[:r + 1])) for r in range(pp)]


# ---- the batch queue ---------------------------------------------------------------------------------
class PipelineChecker(FixedTokenExecutor):
    """Launches each batch without running it and checks, at every launch, that none of its requests is in a
    batch still in flight, and that at most `depth` batches are."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth, self.in_flight, self.max_seen = depth, [], 0

    def execute_async(self, so: SchedulerOutput):
        ids = {r.request_id for r in so.requests}
        for other in self.in_flight:
            assert not ids & other, f"requests {ids & other} launched while in flight"
        self.in_flight.append(ids)
        self.max_seen = max(self.max_seen, len(self.in_flight))
        assert len(self.in_flight) <= self.depth
        out = self.execute(so)

        def result() -> ModelRunnerOutput:
            assert self.in_flight[0] == ids, "batches read back out of order"
            self.in_flight.pop(0)
            return out
        return result


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 4), blocks=st.integers(12, 40), seed=st.integers(0, 10_000),
       n=st.integers(1, 14), prefix=st.booleans())
def test_a_request_is_never_in_two_in_flight_batches(pp, blocks, seed, n, prefix):
    import random
    g = random.Random(seed)
    engine = make_engine(num_gpu_blocks=blocks, max_model_len=64, pipeline_parallel_size=pp, block_size=4,
                         max_num_batched_tokens=16, max_num_seqs=6, enable_prefix_caching=prefix)
    executor = PipelineChecker(pp)
    clock = itertools.count()
    stepper = EngineStepper(engine, executor, lambda: float(next(clock)))
    arrivals = sorted(((g.randrange(30), make_request(f"r{i}", g.randrange(1, 30), max_tokens=g.randrange(1, 12)))
                       for i in range(n)), key=lambda a: a[0])
    done: set[str] = set()
    for step in range(2000):
        while arrivals and arrivals[0][0] <= step:
            req = arrivals.pop(0)[1]
            assert engine.add_request(req, float(step)) is None
        if not arrivals and not stepper.has_work():
            break
        so, outs = stepper.step()
        check_step(engine, so)
        done |= {o.request_id for o in outs if o.finished}
    else:
        raise AssertionError("requests not finished")
    assert len(done) == n and not executor.in_flight and engine.num_in_flight == 0
    steps = engine.records.step_columns()
    assert steps["num_in_flight"].max() == executor.max_seen <= pp
    assert set(steps["microbatch"]) <= set(range(pp))


# ---- real stages over gloo ------------------------------------------------------------------------------
def _assert_cleaned_up(llm: LLM) -> None:
    procs = getattr(llm.executor, "procs", [])
    llm.shutdown()
    assert not dist.is_initialized(), "the process group outlived shutdown()"
    assert all(not p.is_alive() for p in procs)
    assert not [c for c in mp.active_children() if c.name.startswith("testbed-tp-rank")]


def _generate(llm: LLM, prompts, arrivals) -> dict[str, tuple[list[int], list]]:
    """Add prompt i before step arrivals[i] and step until all finish: (tokens, logprobs) per request, and the
    steps must have batched (several requests, prefill beside decodes) and pipelined (batches in flight together)."""
    out: dict[str, tuple[list[int], list]] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    for step in itertools.count():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            assert llm.add_request(f"r{i}", list(prompts[i]), GREEDY) is None
            out[f"r{i}"] = ([], [])
        if not pending and not llm.has_unfinished_requests():
            break
        for o in llm.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.new_logprobs or [])
    steps = llm.engine.records.steps  # a pipeline splits the requests among the batches in flight
    assert max(s[3] for s in steps) >= 2 and any(s[4] > 0 and s[5] > 0 for s in steps), "no continuous batching"
    if llm.config.pipeline_parallel_size > 1:
        assert max(s[-1] for s in steps) >= 2, "no two batches were ever in flight together"
    return out


def test_tiny_llama_uneven_pp3_and_pp2_x_tp2_match_pp1_and_hf(tmp_path):
    """5 layers over 3 stages (2, 2, 1), and 2 stages (3, 2) of 2 TP ranks each: the same greedy tokens and
    logprobs as PP=1 (fp32), which gives transformers' tokens."""
    hf = save_tiny_llama(tmp_path, 4, 2, seed=5, num_hidden_layers=5)
    prompts = random_prompts([5, 40, 17, 2, 26, 33, 9], hf.config.vocab_size, seed=7)
    arrivals = [0, 0, 1, 1, 3, 4, 9]
    pp1 = LLM(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    ref = _generate(pp1, prompts, arrivals)
    _assert_cleaned_up(pp1)
    assert [ref[f"r{i}"][0] for i in range(len(prompts))] == [hf_greedy(hf, p, 10) for p in prompts]
    pp3 = LLM(str(tmp_path), skip_tokenizer_init=True, pipeline_parallel_size=3, **ENGINE)
    try:
        runner = pp3.executor.runner  # rank 0: the last stage, layer 4 only, with the LM head
        assert [a is runner.model.model.layers[4].self_attn.attn for a in runner.model.attention_layers()] == [True]
        assert runner.model.model.embed_tokens is None and runner.model.lm_head is not None
        _assert_same(_generate(pp3, prompts, arrivals), ref)
    finally:
        _assert_cleaned_up(pp3)
    pp2 = LLM(str(tmp_path), skip_tokenizer_init=True, pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    try:
        assert len(pp2.executor.procs) == 3
        _assert_same(_generate(pp2, prompts, arrivals), ref)
    finally:
        _assert_cleaned_up(pp2)


def _assert_same(got: dict, ref: dict) -> None:
    """The same tokens, and the same logprobs (each sampled token's, and the top 2 ids) up to float32 rounding:
    a pipeline batches the requests otherwise (its batches in flight hold different ones), and a matmul over
    other rows, or a TP all-reduce, sums in another order."""
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in ref.items()}
    for r, (_, lps) in got.items():
        assert [(lp[1], [t for t, _ in lp[2]]) for lp in lps] == [(lp[1], [t for t, _ in lp[2]]) for lp in ref[r][1]]
        assert [lp[0] for lp in lps] == pytest.approx([lp[0] for lp in ref[r][1]], abs=1e-5)


@pytest.mark.smollm2
def test_smollm2_uneven_pp4_matches_hf_and_the_simulator_replays_its_batches(tmp_path, capsys):
    """The bundled SmolLM2's 30 layers over 4 stages (7, 8, 8, 7): transformers' fp32 greedy tokens, batched,
    with chunked prefill and prefix caching; then a recorded replay of a trace on the same workers, whose
    batches and outcomes `simulate --cost-model recorded:` reproduces exactly (decision parity with a batch
    queue: the same schedule and update calls, in the same order)."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM
    from test_parity import FLAGS, REQUEST_OUTCOMES, STEP_DECISIONS, write_trace
    from testbed.cli import main
    from testbed.cli_args import ArgumentParser, add_engine_args, engine_config
    from testbed.entrypoints.replay import run_replay
    from testbed.worker.smollm2 import default_model_dir
    folder = str(default_model_dir())
    # the engine of test_parity's replay: a cache of 9 blocks of 16 tokens, so requests are preempted
    llm = LLM(folder, max_model_len=256, pipeline_parallel_size=4, max_num_batched_tokens=32, max_num_seqs=4,
              block_size=16, num_gpu_blocks=9, enable_prefix_caching=True)
    try:
        assert [len(a) for a in [llm.executor.runner.model.attention_layers()]] == [7]  # rank 0: the last stage
        tok = llm.get_tokenizer()
        texts = ["The capital of France is", "def add(a, b):\n", "Hello, my name is",
                 "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
                 "and his three children. One day, the eldest son went into the woods to"]
        prompts = [tok.encode(t) for t in texts] + [tok.encode(texts[3])[:40]]  # a prefix-cache hit
        got = _generate(llm, prompts, [0, 1, 1, 0, 6])
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert [got[f"r{i}"][0] for i in range(len(prompts))] == [hf_greedy(hf, p, 10) for p in prompts]
        assert llm.engine.block_manager.prefix_hits > 0
        trace = tmp_path / "trace.jsonl"
        write_trace(trace)
        p = ArgumentParser()
        add_engine_args(p, None)
        flags = [f for f in FLAGS if f not in ("--format", "json")]
        config = engine_config(p.parse_args([*flags, "-pp", "4"]))
        real, sim = tmp_path / "real", tmp_path / "sim"
        run_replay(str(trace), config, model=folder, output=real, executor=llm.executor)
    finally:
        _assert_cleaned_up(llm)
    assert main(["simulate", str(trace), "--model", "SmolLM2-135M", "--cost-model", f"recorded:{real}",
                 "-o", str(sim), "--no-progress", "-pp", "4", *FLAGS]) == 0
    capsys.readouterr()
    rs, ss = pd.read_parquet(real / "steps.parquet"), pd.read_parquet(sim / "steps.parquet")
    pd.testing.assert_frame_equal(rs[STEP_DECISIONS + ["microbatch", "num_in_flight"]],
                                  ss[STEP_DECISIONS + ["microbatch", "num_in_flight"]])
    assert rs["num_in_flight"].max() >= 2 and rs["num_preempted"].sum() > 0
    rr = pd.read_parquet(real / "requests.parquet").sort_values("request_id", ignore_index=True)
    sr = pd.read_parquet(sim / "requests.parquet").sort_values("request_id", ignore_index=True)
    pd.testing.assert_frame_equal(rr[REQUEST_OUTCOMES], sr[REQUEST_OUTCOMES])
    assert json.loads((real / "manifest.json").read_text())["pipeline"]["stages"] == [[0, 7], [7, 15], [15, 23],
                                                                                       [23, 30]]


# ---- the simulator's stages --------------------------------------------------------------------------------
def _cost_models():
    from testbed.sim.cost_model import RooflineCostModel
    from testbed.profiling.profile_file import shipped_profile
    from testbed.sim.profiled import ProfiledCostModel
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec
    model, gpu = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H100-SXM")
    return model, gpu, [RooflineCostModel(model, gpu),
                        ProfiledCostModel.from_file(shipped_profile("Llama-3.1-8B", "H100-SXM", 1))]


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 600)), min_size=1, max_size=40),
       decode=st.booleans(), pp=st.integers(2, 8))
def test_stages_split_the_step_and_queue_behind_each_other(rows, decode, pp):
    """The host, layers and LM head parts sum to the one-stage step time; a lone batch takes host + every stage +
    P-1 transfers; P identical batches launched together finish one bottleneck resource's time apart."""
    from testbed.sim.pipeline import PipelineCostModel
    from testbed.profiling.synthetic_steps import StepFactory
    model, gpu, bases = _cost_models()
    so = StepFactory(1 << 20, 16, model.vocab_size).step([(c + 1, 1, True) if decode else (c, n, False)
                                                          for c, n in rows])
    for base in bases:
        host, layers, head = base.pipeline_split(so)
        assert min(host, layers, head) >= 0 and host + layers + head == pytest.approx(base.step_time(so), rel=1e-12)
        cm = PipelineCostModel(base, model, gpu, pp)
        times = cm.resource_times(so)
        assert sum(times) == pytest.approx(host + layers + head + (pp - 1) * cm.transfer_time(so), rel=1e-12)
        assert cm.launch(so, 0.0) == pytest.approx(sum(times), rel=1e-12)
        ends = [cm.launch(so, 0.0) for _ in range(pp)]
        assert [b - a for a, b in zip(ends, ends[1:])] == pytest.approx([max(times)] * (pp - 1), rel=1e-9)


def test_simulate_pp_records_the_pipeline_and_fills_it_under_load(tmp_path, capsys):
    from testbed.cli import main
    trace = Path(__file__).resolve().parents[1] / "traces" / "azure_conv_10min.jsonl"
    runs = {}
    for pp in (1, 4):
        out = tmp_path / f"pp{pp}"
        assert main(["simulate", str(trace), "--model", "Llama-3.1-8B", "--gpu", "H100-SXM", "--cost-model",
                     "roofline", "--limit", "300", "--request-rate", "40", "-pp", str(pp), "-o", str(out),
                     "--no-progress", "--format", "json"]) == 0
        runs[pp] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    import pandas as pd
    steps = pd.read_parquet(tmp_path / "pp4" / "steps.parquet")
    assert steps["num_in_flight"].max() == 4 and set(steps["microbatch"]) == {0, 1, 2, 3}
    manifest = json.loads((tmp_path / "pp4" / "manifest.json").read_text())
    assert manifest["pipeline"]["stages"] == [[0, 8], [8, 16], [16, 24], [24, 32]]
    assert "4 pipeline stages (8/8/8/8 layers)" in runs[4]["cost_model"]
    assert "microbatch" not in pd.read_parquet(tmp_path / "pp1" / "steps.parquet").columns
    assert runs[4]["output_throughput"] > runs[1]["output_throughput"]  # four GPUs' stages against one GPU


UNGUARDED = """
from testbed import LLM
llm = LLM({folder!r}, skip_tokenizer_init=True, pipeline_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4)
print("tokens", len(llm.generate([[1, 2, 3]])[0].outputs[0].token_ids))
"""


def test_a_pipeline_script_without_a_main_guard_fails_at_once_with_an_explanation(tmp_path):
    """As with TP: a spawned stage worker imports the script again; it explains the missing guard and the
    script fails at once, not at the rendezvous timeout."""
    save_tiny_llama(tmp_path / "tiny", 4, 2, num_hidden_layers=2)
    script = tmp_path / "generate.py"
    script.write_text(UNGUARDED.format(folder=str(tmp_path / "tiny")))
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TESTBED_TP_TIMEOUT_S": "600",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    bad = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "tokens" not in bad.stdout
    assert "worker was asked to build an engine while starting up" in bad.stderr
    assert "worker died during startup: rank 1" in bad.stderr and 'if __name__ == "__main__":' in bad.stderr


def test_each_data_parallel_replica_has_stages_of_its_own():
    """DP=2 x PP=2: two equal requests arriving together, one per replica, are served in the same time (shared
    stages would queue one behind the other)."""
    from testbed.engine.config import EngineConfig
    from testbed.sim.cluster import simulate
    from testbed.sim.cost_model import RooflineCostModel
    from testbed.sim.pipeline import PipelineCostModel
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec
    from testbed.workload.trace import TraceRequest
    model, gpu = get_model_spec("Llama-3.1-8B"), get_gpu_spec("H100-SXM")
    config = EngineConfig(data_parallel_size=2, pipeline_parallel_size=2, dp_policy="round_robin")
    cm = PipelineCostModel(RooflineCostModel(model, gpu), model, gpu, 2)
    trace = [TraceRequest(f"r{i}", 0.0, 300, 20) for i in range(2)]
    res = simulate(trace, config, cm, 1000, 4096, model.vocab_size)
    cols = res.records.request_columns()
    assert sorted(cols["replica"]) == [0, 1]
    assert cols["first_token"][0] == pytest.approx(cols["first_token"][1], rel=1e-9)
    assert cols["finish"][0] == pytest.approx(cols["finish"][1], rel=1e-9)


def test_busy_time_counts_overlapping_batches_once():
    from testbed.engine.metrics import _covered
    # replica 0: [0, 2] and [1, 3] overlap, [5, 6] apart; replica 1: [0, 1]
    assert _covered([0, 0, 0, 1], [0.0, 1.0, 5.0, 0.0], [2.0, 2.0, 1.0, 1.0]) == pytest.approx(3 + 1 + 1)
