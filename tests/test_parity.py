"""Decision parity: fed the step timeline a real run recorded, the simulator forms the same batches.

`testbed replay` runs the bundled SmolLM2 for real on a small trace (staggered arrivals, chunked
prefill, prefix-cache hits, preemptions from a tiny cache, requests under a JSON grammar that compiles
off the step loop); `testbed simulate --cost-model recorded:RUN_DIR` then replays that run's step start
times and when each grammar was ready. Both drive the same sans-I/O
EngineCore, so every step's batch and every request's outcome must match exactly.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.cli import main

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(300)]

FLAGS = ["--max-model-len", "256", "--block-size", "16", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
         "--enable-prefix-caching", "--num-gpu-blocks", "9", "--format", "json"]
STEP_DECISIONS = ["num_reqs", "num_prefill_tokens", "num_decode_tokens", "sum_context_tokens", "sum_attn_pairs",
                  "kv_blocks_used", "num_waiting", "num_running", "num_preempted", "num_swapped", "num_swapped_out",
                  "blocks_swapped_out", "blocks_swapped_in"]
REQUEST_OUTCOMES = ["request_id", "input_tokens", "output_tokens", "cached_tokens", "preemptions", "finish_reason"]


def write_trace(path, structured: tuple[int, ...] = (1, 4, 7)) -> None:
    """The trace; requests `structured` are generated under a JSON grammar."""
    shared = [7, 8]  # two 16-token blocks every request with these hash ids shares
    rows = [(0.0, 40, 12, shared + [1, 2]), (0.0, 24, 20, None), (0.0, 56, 8, None), (0.25, 36, 16, shared + [3, 4]),
            (0.3, 20, 24, None), (0.9, 48, 10, shared + [5, 6]), (0.95, 300, 4, None), (2.0, 28, 6, None)]
    with open(path, "w") as f:
        for i, (t, n_in, n_out, hashes) in enumerate(rows):
            row = {"id": f"r{i}", "arrival_s": t, "input_tokens": n_in, "output_tokens": n_out}
            if hashes:
                row |= {"hash_ids": hashes[: -(-n_in // 16)], "hash_block_size": 16}
            if i in structured:
                row["structured_output"] = True
            f.write(json.dumps(row) + "\n")


# swap: a CPU pool of 3 blocks takes some victims and sends the larger ones to recompute
@pytest.mark.parametrize("preemption", [[], ["--preemption-mode", "swap", "--num-cpu-blocks", "3"]],
                         ids=["recompute", "swap"])
def test_simulation_replays_a_real_runs_batches_exactly(tmp_path, capsys, preemption):
    from testbed.worker.smollm2 import default_model_dir
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, structured=() if preemption else (1, 4, 7))
    real, sim = tmp_path / "real", tmp_path / "sim"
    assert main(["replay", str(trace), "--model", str(default_model_dir()), "-o", str(real), *FLAGS, *preemption]) == 0
    real_summary = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(trace), "--model", "SmolLM2-135M", "--cost-model", f"recorded:{real}",
                 "-o", str(sim), "--no-progress", *FLAGS, *preemption]) == 0
    sim_summary = json.loads(capsys.readouterr().out)

    rs, ss = pd.read_parquet(real / "steps.parquet"), pd.read_parquet(sim / "steps.parquet")
    assert len(rs) == len(ss)
    pd.testing.assert_frame_equal(rs[STEP_DECISIONS], ss[STEP_DECISIONS])
    # same timeline, up to where the first step began (the real loop reads its clock a moment after 0)
    assert ss["start"].diff().tolist()[1:] == pytest.approx(rs["start"].diff().tolist()[1:], abs=1e-9)
    rr = pd.read_parquet(real / "requests.parquet").sort_values("request_id", ignore_index=True)
    sr = pd.read_parquet(sim / "requests.parquet").sort_values("request_id", ignore_index=True)
    pd.testing.assert_frame_equal(rr[REQUEST_OUTCOMES], sr[REQUEST_OUTCOMES])
    # the trace exercised what makes scheduling interesting, so the equality above means something
    assert rs["num_preempted"].sum() > 0 and rr["cached_tokens"].sum() > 0
    assert ((rs["num_prefill_tokens"] > 0) & (rs["num_decode_tokens"] > 0)).any()  # mixed chunked steps
    assert real_summary["num_rejected"] == sim_summary["num_rejected"] == 1  # the 300-token prompt
    assert sim_summary["num_finished"] == real_summary["num_finished"] == 7
    if preemption:  # both a swap and a fallback to recompute happened
        assert 0 < rs["num_swapped_out"].sum() < rs["num_preempted"].sum()
        assert real_summary["num_blocks_swapped_in"] == sim_summary["num_blocks_swapped_in"] > 0
    else:  # the grammars were ready when the real run's were (each at a step's start), and that is what the
        # simulation replayed
        rg, sg = (pd.read_parquet(d / "grammars.parquet").sort_values("request_id", ignore_index=True) for d in (real, sim))
        assert rg["request_id"].tolist() == sg["request_id"].tolist() == ["r1", "r4", "r7"]
        assert rg["error"].isna().all() and sg["error"].isna().all()
        # each was ready at the start of the same step (the grammars of r4 and r7 compiled while steps ran)
        assert [rs["start"].tolist().index(t) for t in rg["ready"]] == [ss["start"].tolist().index(t) for t in sg["ready"]]


def test_a_diverging_simulation_is_an_error(tmp_path, capsys):
    """A recorded timeline replayed with other flags runs out of steps and says so."""
    from testbed.sim.cost_model import RecordedCostModel
    from testbed.engine.outputs import SchedulerOutput
    cm = RecordedCostModel([0.0, 0.5], [0.1, 0.2])
    assert [cm.step_time(SchedulerOutput()), cm.step_time(SchedulerOutput())] == [0.5, 0.2]
    with pytest.raises(RuntimeError, match="diverged"):
        cm.step_time(SchedulerOutput())
