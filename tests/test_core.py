"""EngineCore: admission and stated rejections, abort, stop checks, duplicate ids, config validation,
replica stats and the records it keeps."""
from __future__ import annotations

import pytest

from testbed.engine.config import ConfigError, EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput
from testbed.engine.request import RequestStatus

from conftest import FIXED_TOKEN, FixedTokenExecutor, make_engine, make_request, run_engine


class ScriptedExecutor:
    """Samples script[rid][k] as the k-th output token of request rid (FIXED_TOKEN past the script)."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts

    def execute(self, so):
        toks = []
        for r in so.requests:
            script = self.scripts.get(r.request_id, [])
            k = len(r.output_token_ids)
            toks.append(-1 if r.num_computed_tokens < r.num_tokens else (script[k] if k < len(script) else FIXED_TOKEN))
        return ModelRunnerOutput(toks)


def tokens_of(outs, rid):
    return [t for o in outs[rid] for t in o.new_token_ids]


# ---- rejections ---------------------------------------------------------------------------------------
def test_reject_prompt_plus_max_tokens_over_max_model_len():
    engine = make_engine(max_model_len=32)
    out = engine.add_request(make_request("long", 30, 3), now=1.5)
    assert out.finished and out.finish_reason == "rejected" and "max_model_len (32)" in out.stop_reason
    assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
    rows = engine.records.request_columns()
    assert rows["request_id"] == ["long"] and rows["finish_reason"] == ["rejected"] and rows["finish"] == [1.5]
    assert engine.add_request(make_request("fits", 29, 3), now=1.5) is None


def test_reject_prompt_at_max_model_len_without_max_tokens():
    engine = make_engine(max_model_len=16)
    out = engine.add_request(make_request("p", 16, None), now=0.0)
    assert out.finish_reason == "rejected" and "max_model_len is 16" in out.stop_reason


def test_reject_more_blocks_than_the_cache():
    engine = make_engine(num_gpu_blocks=4, block_size=16, max_model_len=1024)
    out = engine.add_request(make_request("big", 60, 10), now=0.0)
    assert out.finish_reason == "rejected" and "needs 5 KV blocks but the cache has 4" in out.stop_reason
    assert engine.add_request(make_request("ok", 60, 4), now=0.0) is None
    _, outs = run_engine(engine, [])
    assert tokens_of(outs, "ok") == [FIXED_TOKEN] * 4


def test_reject_when_waiting_queue_is_full():
    engine = make_engine(max_num_waiting=2, max_num_seqs=1, max_num_batched_tokens=64)
    assert engine.add_request(make_request("a"), 0.0) is None
    assert engine.add_request(make_request("b"), 0.0) is None
    out = engine.add_request(make_request("c"), 0.0)
    assert out.finish_reason == "rejected" and "--max-num-waiting" in out.stop_reason
    engine.step(0.0, FixedTokenExecutor())  # "a" leaves the waiting queue
    assert engine.scheduler.num_waiting == 1 and engine.add_request(make_request("c"), 1.0) is None


def test_reject_long_recompute_when_chunked_prefill_is_off():
    engine = make_engine(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=False)
    out = engine.add_request(make_request("p", 60, 8), 0.0)
    assert out.finish_reason == "rejected" and "--max-num-batched-tokens (64)" in out.stop_reason
    assert engine.add_request(make_request("q", 60, 5), 0.0) is None  # 60 + 4 recomputed outputs fit


# ---- duplicates and abort ---------------------------------------------------------------------------
def test_duplicate_id_is_an_error_while_live():
    engine = make_engine()
    engine.add_request(make_request("x"), 0.0)
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        engine.add_request(make_request("x"), 0.0)
    run_engine(engine, [])
    assert engine.add_request(make_request("x"), 9.0) is None, "a finished id may be reused"


def test_abort_waiting_and_running_frees_blocks():
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64)
    run, wait = make_request("run", 20, 50), make_request("wait", 20, 50)
    engine.add_request(run, 0.0)
    engine.add_request(wait, 0.0)
    for t in range(3):
        engine.step(float(t), FixedTokenExecutor())
    assert run.status == RequestStatus.RUNNING and wait.status == RequestStatus.WAITING
    assert engine.block_manager.usage > 0
    out = engine.abort("wait", 3.0)
    assert out.finished and out.finish_reason == "abort" and engine.scheduler.num_waiting == 0
    out = engine.abort("run", 3.0)
    assert out.finish_reason == "abort" and run.status == RequestStatus.FINISHED_ABORTED
    assert engine.block_manager.usage == 0 and engine.scheduler.num_running == 0
    assert not engine.has_unfinished_requests() and engine.abort("run", 4.0) is None
    engine.block_manager.check_invariants()
    so, outs = engine.step(4.0, FixedTokenExecutor())
    assert so.is_empty and so.finished_req_ids == ["wait", "run"] and outs == []
    rows = engine.records.request_columns()
    assert rows["finish_reason"] == ["abort", "abort"] and rows["output_tokens"] == [0, 3]


def test_abort_between_schedule_and_update_drops_the_token():
    engine = make_engine()
    req = make_request("r", 8, 4)
    engine.add_request(req, 0.0)
    so = engine.schedule(0.0)
    engine.abort("r", 0.5)
    assert engine.update(so, FixedTokenExecutor().execute(so), 1.0) == []
    assert req.output_token_ids == [] and engine.block_manager.usage == 0


def test_abort_preempted_request():
    engine = make_engine(num_gpu_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    a, b = make_request("a", 4, 12), make_request("b", 4, 12)
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.0)
    t = 0
    while b.status != RequestStatus.PREEMPTED:
        engine.step(float(t), FixedTokenExecutor())
        t += 1
        assert t < 50
    assert engine.abort("b", float(t)).finish_reason == "abort"
    _, outs = run_engine(engine, [])
    assert a.output_token_ids == [FIXED_TOKEN] * 12 and outs["a"][-1].finish_reason == "length"
    assert engine.block_manager.usage == 0 and b.num_preemptions == 1


# ---- stop checks -------------------------------------------------------------------------------------
def run_scripted(rid, script, *, prompt=8, max_tokens=10, eos=2, ignore_eos=False, max_model_len=256, **sp):
    engine = make_engine(max_model_len=max_model_len)
    req = make_request(rid, prompt, max_tokens, eos=eos, ignore_eos=ignore_eos, **sp)
    _, outs = run_engine(engine, [(0, req)], ScriptedExecutor({rid: script}))
    return req, outs[rid][-1], tokens_of(outs, rid)


def test_eos_stops_unless_ignored():
    req, last, toks = run_scripted("e", [5, 6, 2, 5])
    assert toks == [5, 6, 2] and last.finish_reason == "stop" and last.stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED
    _, last, toks = run_scripted("i", [5, 6, 2, 5], ignore_eos=True, max_tokens=6)
    assert toks == [5, 6, 2, 5, FIXED_TOKEN, FIXED_TOKEN] and last.finish_reason == "length"


def test_stop_token_ids_report_the_stop_reason():
    _, last, toks = run_scripted("s", [5, 9, 4], stop_token_ids=[4, 9])
    assert toks == [5, 9] and last.finish_reason == "stop" and last.stop_reason == 9


def test_min_tokens_defers_eos_and_stop_tokens():
    _, last, toks = run_scripted("m", [2, 9, 2, 2, 2], min_tokens=3, stop_token_ids=[9])
    assert toks == [2, 9, 2] and last.finish_reason == "stop"
    _, last, toks = run_scripted("n", [9, 2, 9, 9], min_tokens=3, stop_token_ids=[9])
    assert toks == [9, 2, 9] and last.stop_reason == 9


def test_max_tokens_and_max_model_len_limits():
    _, last, toks = run_scripted("t", [], max_tokens=4)
    assert toks == [FIXED_TOKEN] * 4 and last.finish_reason == "length"
    req, last, toks = run_scripted("l", [], prompt=10, max_tokens=None, max_model_len=16)
    assert len(toks) == 6 and last.finish_reason == "length" and req.num_tokens == 16


# ---- config validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, flag", [
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "--max-num-batched-tokens"),
    ({"block_size": 24}, "--block-size"),
    ({"block_size": 512}, "--block-size"),
    ({"max_model_len": 0}, "--max-model-len"),
    ({"num_gpu_blocks": 0}, "--num-gpu-blocks"),
    ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
    ({"policy": "lifo"}, "--policy"),
    ({"dp_policy": "random"}, "--dp-policy"),
    ({"max_num_waiting": 0}, "--max-num-waiting"),
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
    ({"data_parallel_size": 0}, "--data-parallel-size"),
    ({"enable_chunked_prefill": False, "max_model_len": 4096, "max_num_batched_tokens": 2048},
     "--max-num-batched-tokens"),
])
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert str(e.value).startswith(flag + ":")
    assert isinstance(e.value, ValueError)


def test_engine_needs_cache_size_and_context_length():
    with pytest.raises(ValueError, match="num_gpu_blocks and max_model_len"):
        EngineCore(EngineConfig())
    assert EngineCore(EngineConfig(num_gpu_blocks=8, max_model_len=64)).block_manager.num_blocks == 8


# ---- stats and records -----------------------------------------------------------------------------------
def test_stats_track_queues_and_waiting_tokens():
    engine = make_engine(num_gpu_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    engine.add_request(make_request("a", 8, 3), 0.0)
    engine.add_request(make_request("b", 12, 3), 0.0)
    s = engine.stats()
    assert (s.num_waiting, s.num_running, s.kv_usage, s.num_free_blocks, s.num_blocks, s.num_waiting_tokens) == \
        (2, 0, 0.0, 16, 16, 20)
    engine.step(0.0, FixedTokenExecutor())
    s = engine.stats()
    assert (s.num_waiting, s.num_running, s.num_free_blocks, s.num_waiting_tokens) == (1, 1, 14, 12)
    assert s.kv_usage == 2 / 16  # blocks for the 8 computed tokens; the sampled 9th has none yet


def test_records_hold_consistent_timestamps_and_steps():
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=16)
    reqs = [make_request(f"r{i}", 10 + 5 * i, 3 + i, arrival=float(i)) for i in range(4)]
    steps, _ = run_engine(engine, [(i, r) for i, r in enumerate(reqs)])
    rows = engine.records.request_columns()
    assert len(rows["request_id"]) == 4 and rows["finish_reason"] == ["length"] * 4
    by_id = {rid: i for i, rid in enumerate(rows["request_id"])}
    for r in reqs:
        i = by_id[r.request_id]
        assert rows["arrival"][i] <= rows["first_scheduled"][i] < rows["first_token"][i] <= rows["finish"][i]
        assert (rows["input_tokens"][i], rows["output_tokens"][i]) == (r.num_prompt_tokens, r.max_tokens)
    step_rows = engine.records.step_columns()
    assert len(step_rows["start"]) == len(steps)
    assert [int(x) for x in step_rows["num_reqs"]] == [so.num_reqs for so in steps]
    assert all(float(d) == 1.0 for d in step_rows["duration"])
    assert len(engine.records.itl) == sum(r.max_tokens - 1 for r in reqs)


def test_logprobs_flow_to_the_request_and_outputs():
    engine = make_engine()
    req = make_request("lp", 4, 2, logprobs=1)
    engine.add_request(req, 0.0)
    so = engine.schedule(0.0)
    outs = engine.update(so, ModelRunnerOutput([3], logprobs=[(-0.5, [(3, -0.5)])]), 1.0)
    assert req.logprobs == [(-0.5, [(3, -0.5)])] and outs[0].new_logprobs == [(-0.5, [(3, -0.5)])]
