"""`testbed replay`: a tiny trace through the real engine (tiny random Llama on CPU) writes the run
directory of DESIGN.md with mode = real, measured step durations, forced output lengths, prefix-cache
hits rebuilt from hash_ids, and a stated rejection for a request longer than --max-model-len."""
from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys

import pandas as pd
import pytest
import torch.distributed as dist

from llm_helpers import save_tiny_llama
from testbed.cli import main
from testbed.runs.rundir import FILES, read_run

TRACE = [  # arrivals a fraction of a second apart; b and d share two 16-token prefix blocks
    {"id": "a", "arrival_s": 0.0, "input_tokens": 24, "output_tokens": 5},
    {"id": "b", "arrival_s": 0.05, "input_tokens": 40, "output_tokens": 8, "hash_ids": [11, 12, 13],
     "hash_block_size": 16},
    {"id": "c", "arrival_s": 0.1, "input_tokens": 13, "output_tokens": 3},
    {"id": "d", "arrival_s": 0.3, "input_tokens": 45, "output_tokens": 6, "hash_ids": [11, 12, 14],
     "hash_block_size": 16},
    {"id": "e", "arrival_s": 0.35, "input_tokens": 300, "output_tokens": 4},  # > --max-model-len 128
    {"id": "f", "arrival_s": 0.4, "input_tokens": 30, "output_tokens": 10},
]
FLAGS = ["--max-model-len", "128", "--block-size", "16", "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
         "--enable-prefix-caching"]


pytestmark = pytest.mark.timeout(240)  # worker processes: never let a hang stall the suite




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder, 4, 2)
    return str(folder)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return str(path)


def _replay(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["replay", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _check_run_dir(run_dir, summary: dict, tp: int = 1) -> pd.DataFrame:
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(FILES)
    run = read_run(run_dir)
    m = run.manifest
    assert m["mode"] == "real" and m["config"]["tensor_parallel_size"] == tp
    assert m["config"]["enable_prefix_caching"] and m["config"]["max_num_batched_tokens"] == 16
    assert m["max_model_len"] == 128 and m["num_gpu_blocks"] >= 1 and m["model"]["num_key_value_heads"] == 2
    assert m["trace"]["num_requests"] == len(TRACE) and m["wall_time_s"] > 0.4
    assert json.loads((run_dir / "summary.json").read_text()) == run.summary

    reqs = run.requests().set_index("request_id").loc[[r["id"] for r in TRACE]]
    served = [r for r in TRACE if r["id"] != "e"]
    assert reqs.loc["e", "finish_reason"] == "rejected" and reqs.loc["e", "output_tokens"] == 0
    for r in served:
        row = reqs.loc[r["id"]]
        assert row["finish_reason"] == "length", r["id"]
        assert (row["input_tokens"], row["output_tokens"]) == (r["input_tokens"], r["output_tokens"]), r["id"]
        assert row["arrival"] == pytest.approx(r["arrival_s"])
        assert row["arrival"] <= row["first_scheduled"] <= row["first_token"] <= row["finish"]
    assert reqs.loc["d", "cached_tokens"] == 32, "d should reuse b's two full prefix blocks"
    assert reqs.loc[["a", "b", "c"], "cached_tokens"].eq(0).all()

    steps = run.steps()
    assert len(steps) > 0 and (steps["duration"] > 0).all() and steps["start"].is_monotonic_increasing
    assert (steps["num_prefill_tokens"] + steps["num_decode_tokens"] <= 16).all()
    assert (steps["kv_blocks_total"] == m["num_gpu_blocks"]).all()
    prefill = sum(r["input_tokens"] for r in served) - 32  # the prefix-cache hit is not recomputed
    assert steps["num_prefill_tokens"].sum() == prefill
    assert steps["num_decode_tokens"].sum() == sum(r["output_tokens"] - 1 for r in served)

    assert summary["num_requests"] == len(TRACE) and summary["num_rejected"] == 1
    assert summary["num_finished"] == len(served)
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in served)
    assert summary["prefix_cache_hit_rate"] > 0 and summary["num_steps"] == len(steps)
    return steps


def test_replay_writes_real_run_directory(model_dir, trace_file, tmp_path, capsys):
    out_dir = tmp_path / "run"
    rc, out, err = _replay([trace_file, "--model", model_dir, *FLAGS, "--output", str(out_dir), "--format", "json"],
                           capsys)
    assert rc == 0, err
    summary = json.loads(out)
    assert summary.pop("run_dir") == str(out_dir)
    _check_run_dir(out_dir, summary)


def test_replay_cli_process_exits_zero_with_table(model_dir, trace_file, tmp_path):
    out_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "replay", trace_file, "--model", model_dir, *FLAGS,
                           "--output", str(out_dir)], capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "Replay Result (real)" in proc.stdout and f"Run directory: {out_dir}" in proc.stdout
    assert (out_dir / "manifest.json").is_file()


def test_replay_bad_input_exits_2_with_message(model_dir, trace_file, tmp_path, capsys):
    rc, _, err = _replay([str(tmp_path / "missing.jsonl"), "--model", model_dir, *FLAGS], capsys)
    assert rc == 2 and "testbed replay: error:" in err and "missing.jsonl" in err
    rc, _, err = _replay([trace_file, "--model", str(tmp_path / "no-model"), *FLAGS,
                          "--output", str(tmp_path / "r")], capsys)
    assert rc == 2 and "not found" in err
    rc, _, err = _replay([trace_file, "--model", model_dir, *FLAGS, "--max-model-len", "4096"], capsys)
    assert rc == 2 and "max_position_embeddings (256)" in err
    assert not (tmp_path / "r").exists()


def test_replay_tensor_parallel_2_and_cleanup(model_dir, trace_file, tmp_path, capsys):
    out_dir = tmp_path / "run"
    rc, out, err = _replay([trace_file, "--model", model_dir, *FLAGS, "-tp", "2", "--output", str(out_dir),
                            "--format", "json"], capsys)
    assert rc == 0, err
    summary = json.loads(out)
    summary.pop("run_dir")
    _check_run_dir(out_dir, summary, tp=2)
    assert not dist.is_initialized(), "replay left the TP process group behind"
    assert not [c for c in mp.active_children() if c.name.startswith("testbed-tp-rank")]
