"""Trace loaders, re-timing, malformed-input errors and synthetic prompts (testbed.workload.trace)."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.workload.trace import (REJECTED_OUTPUT_TOKENS, TraceError, TraceRequest, load_trace, synthesize_prompt,
                                    write_jsonl)

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "azure_conv_10min.jsonl"
FORMATS = REPO / "traces" / "formats"   # the first rows of each public trace, byte for byte (traces/README.md)
AZURE = FORMATS / "azure_llm_2023_conv_head400.csv"
MOONCAKE = FORMATS / "mooncake_synthetic_head300.jsonl"


# ---- real traces -------------------------------------------------------------------------------

def test_azure_csv_as_published():
    rows = [line.split(",") for line in AZURE.read_text().splitlines()[1:]]
    reqs = load_trace(AZURE)
    assert len(reqs) == 400
    assert reqs[0].arrival_s == 0.0 and reqs[0].id == "azure-0"
    assert [r.id for r in reqs[-2:]] == ["azure-398", "azure-399"]
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(int(c), int(g)) for _, c, g in rows]
    # 18:15:50.9951690 - 18:15:46.6805900, 18:16:29.2444100 (file line 100) and 18:17:33.0108020 (the last row)
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert reqs[98].arrival_s == pytest.approx(42.56382, abs=1e-9)
    assert reqs[-1].arrival_s == pytest.approx(106.330212, abs=1e-9)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert [r.id for r in load_trace(AZURE, limit=3)] == ["azure-0", "azure-1", "azure-2"]


def test_azure_timestamps_parse_all_digits_across_midnight(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2024-02-28 23:59:59.9999999,10,2\n"
                    "2024-02-29 00:00:00.0000001,11,3\n"
                    "2024-03-01 00:00:00,12,4\n")
    a = [r.arrival_s for r in load_trace(path)]
    assert a[0] == 0.0
    assert a[1] == pytest.approx(2e-7, abs=1e-12)
    assert a[2] == pytest.approx(86400 + 1e-7, abs=1e-9)  # 2024 is a leap year


def test_mooncake_jsonl_with_hash_ids():
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    reqs = load_trace(MOONCAKE)
    assert len(reqs) == 300 and reqs[0].arrival_s == 0.0
    for r, d in zip(reqs, rows):
        assert (r.input_tokens, r.output_tokens, r.hash_ids) == (d["input_length"], d["output_length"], d["hash_ids"])
        assert r.hash_block_size == 512
        assert r.arrival_s == pytest.approx((d["timestamp"] - rows[0]["timestamp"]) / 1000)


@pytest.mark.parametrize("name", ["sharegpt_lengths_llama2_head300.csv",
                                  "arxiv_summarization_lengths_llama2_head300.csv"])
def test_lengths_csv(name):
    src = FORMATS / name
    rows = [line.split(",") for line in src.read_text().splitlines()[1:]]
    with pytest.raises(TraceError, match=rf"{name}:1: .*--request-rate"):
        load_trace(src)
    reqs = load_trace(src, request_rate=10.0)
    assert len(reqs) == 300 and reqs[0].arrival_s == 0.0
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(int(p), int(d)) for p, d, *_ in rows]
    assert [r.id for r in reqs[:2]] == ["lengths-0", "lengths-1"]


def test_bundled_sample_is_the_azure_trace_in_project_jsonl():
    sample = load_trace(SAMPLE)
    assert len(sample) == 2867 and sample[0].arrival_s == 0.0 and sample[-1].arrival_s < 600
    assert sample[:400] == load_trace(AZURE)  # the same requests, ids and times as the published CSV


def test_a_run_directory_is_the_trace_of_the_requests_it_recorded(tmp_path):
    from testbed.engine.config import EngineConfig
    from testbed.sim.run import run_simulation
    trace = load_trace(SAMPLE, limit=60)
    trace[5].priority = 3
    write_jsonl(trace, tmp_path / "t.jsonl")
    run_dir, _ = run_simulation(str(tmp_path / "t.jsonl"), EngineConfig(max_model_len=1024), model="Llama-3.2-1B",
                                output=tmp_path / "run", progress=False)
    served = load_trace(run_dir)   # requests over max_model_len were rejected: kept, asking for more than any limit
    rejected = {r.id for r in trace if r.input_tokens + r.output_tokens > 1024}
    assert rejected and served == [dataclasses.replace(r, output_tokens=REJECTED_OUTPUT_TOKENS) if r.id in rejected
                                   else r for r in trace]
    again, _ = run_simulation(str(run_dir), EngineConfig(max_model_len=1024), model="Llama-3.2-1B",
                              output=tmp_path / "again", progress=False)  # replayed, they are rejected again
    assert pd.read_parquet(again / "requests.parquet").equals(pd.read_parquet(run_dir / "requests.parquet"))
    assert [r.arrival_s for r in load_trace(run_dir, limit=3, request_rate=math.inf)] == [0.0] * 3
    with pytest.raises(ValueError, match="run directory"):
        load_trace(run_dir, fmt="jsonl")
    req = pd.read_parquet(run_dir / "requests.parquet")
    req.assign(output_tokens=0, finish_reason="abort").to_parquet(run_dir / "requests.parquet")
    with pytest.raises(ValueError, match="no request of this run produced output"):
        load_trace(run_dir)


# ---- project JSONL -----------------------------------------------------------------------------

def test_round_trip(tmp_path):
    reqs = [TraceRequest("a", 0.0, 1000, 5, hash_ids=[7, 8], hash_block_size=512, priority=2),
            TraceRequest("b", 0.25, 3, 1, prompt_token_ids=[1, 2, 3]),
            TraceRequest("c", 1 / 3, 17, 9, priority=-1),
            TraceRequest("d", 2.5, 5, 1, hash_ids=[1, 2, 3], hash_block_size=2)]
    write_jsonl(reqs, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == reqs


def test_jsonl_sorts_stably_shifts_derives_and_limits(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 12.5, "input_tokens": 4, "output_tokens": 1}\n\n'
                    '{"arrival_s": 10, "prompt_token_ids": [5, 6, 7], "output_tokens": 2}\n'
                    '{"arrival_s": 12.5, "input_tokens": 9, "output_tokens": 3, "id": "x"}\n')
    reqs = load_trace(path)
    assert [(r.id, r.arrival_s, r.input_tokens) for r in reqs] == [("2", 0.0, 3), ("0", 2.5, 4), ("x", 2.5, 9)]
    assert [r.id for r in load_trace(path, limit=2)] == ["2", "0"]


# ---- re-timing ---------------------------------------------------------------------------------

def lengths_file(tmp_path, n: int) -> Path:
    path = tmp_path / "lengths.csv"
    rows = "".join(f"{i % 97 + 1},{i % 13 + 1}\n" for i in range(n))
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + rows)
    return path


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_request_rate_and_burstiness(tmp_path, burstiness):
    reqs = load_trace(lengths_file(tmp_path, 20000), request_rate=8.0, burstiness=burstiness, seed=3)
    gaps = np.diff([r.arrival_s for r in reqs])
    assert reqs[0].arrival_s == 0.0 and (gaps >= 0).all()
    assert len(gaps) / reqs[-1].arrival_s == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)  # gamma CV


def test_retiming_is_deterministic_per_seed_and_keeps_lengths(tmp_path):
    path = lengths_file(tmp_path, 500)
    a, b = load_trace(path, request_rate=2.0, seed=1), load_trace(path, request_rate=2.0, seed=1)
    c = load_trace(path, request_rate=2.0, seed=2)
    assert a == b
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert [r.input_tokens for r in a] == [r.input_tokens for r in c]
    assert all(r.arrival_s == 0.0 for r in load_trace(path, request_rate=math.inf))


def test_retiming_a_timed_trace_replaces_only_times():
    orig = load_trace(SAMPLE, limit=200)
    fast = load_trace(SAMPLE, limit=200, request_rate=100.0)
    def lengths(reqs):
        return [(r.id, r.input_tokens, r.output_tokens) for r in reqs]
    assert lengths(fast) == lengths(orig)
    assert fast[-1].arrival_s < orig[-1].arrival_s / 10


def test_bad_arguments():
    for kwargs in ({"fmt": "parquet"}, {"limit": 0}, {"request_rate": 0.0}, {"request_rate": math.nan},
                   {"burstiness": 0.0}, {"burstiness": math.inf}):
        with pytest.raises(ValueError):
            load_trace(SAMPLE, **kwargs)
    with pytest.raises(FileNotFoundError, match="no_such_trace.jsonl"):
        load_trace(REPO / "traces" / "no_such_trace.jsonl")


# ---- malformed input: file name, 1-based line number, reason ----------------------------------

GOOD = '{"arrival_s": 0, "input_tokens": 4, "output_tokens": 1}\n'
AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
LEN = "num_prefill_tokens,num_decode_tokens\n10,2\n"
MC = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'

MALFORMED = {
    "bad_json": ("t.jsonl", GOOD * 2 + '{"arrival_s": 1,\n', 3, "bad JSON"),
    "not_object": ("t.jsonl", GOOD + "[1, 2]\n", 2, "JSON object"),
    "missing_field": ("t.jsonl", GOOD + '{"arrival_s": 1, "input_tokens": 4}\n', 2, "output_tokens"),
    "missing_input": ("t.jsonl", GOOD + '{"arrival_s": 1, "output_tokens": 4}\n', 2, "input_tokens"),
    "negative_tokens": ("t.jsonl", GOOD + '{"arrival_s": 1, "input_tokens": -4, "output_tokens": 1}\n', 2, ">= 1"),
    "zero_tokens": ("t.jsonl", GOOD + '{"arrival_s": 1, "input_tokens": 4, "output_tokens": 0}\n', 2, ">= 1"),
    "float_tokens": ("t.jsonl", GOOD + '{"arrival_s": 1, "input_tokens": 4.5, "output_tokens": 1}\n', 2, "integer"),
    "negative_arrival": ("t.jsonl", GOOD + '{"arrival_s": -1, "input_tokens": 4, "output_tokens": 1}\n', 2,
                         "arrival_s"),
    "nan_arrival": ("t.jsonl", GOOD + '{"arrival_s": NaN, "input_tokens": 4, "output_tokens": 1}\n', 2, "finite"),
    "unknown_field": ("t.jsonl", GOOD + '{"arrival": 1, "input_tokens": 4, "output_tokens": 1}\n', 2, "unknown"),
    "duplicate_id": ("t.jsonl", '{"id": "a", ' + GOOD[1:] + '{"id": "a", ' + GOOD[1:], 2, "duplicate"),
    "ids_mismatch": ("t.jsonl", '{"arrival_s": 0, "input_tokens": 4, "output_tokens": 1, "prompt_token_ids": [1, 2]}\n',
                     1, "prompt_token_ids has 2"),
    "hash_too_few": ("t.jsonl", GOOD + '{"arrival_s": 1, "input_tokens": 513, "output_tokens": 1, "hash_ids": [1]}\n',
                     2, "exactly 2"),
    "hash_too_many": ("t.jsonl", '{"arrival_s": 1, "input_tokens": 4, "output_tokens": 1, "hash_ids": [1, 2], '
                      '"hash_block_size": 4}\n', 1, "exactly 1"),
    "huge_arrival": ("t.jsonl", GOOD + '{"arrival_s": 1e308, "input_tokens": 4, "output_tokens": 1}\n', 2,
                     "at most 1e+09"),
    "huge_hash_block": ("t.jsonl", GOOD + '{"arrival_s": 1, "input_tokens": 4, "output_tokens": 1, "hash_ids": [1], '
                        '"hash_block_size": 1099511627776}\n', 2, "hash_block_size must be <= 16777216"),
    "blank_lines_counted": ("t.jsonl", GOOD + "\n\n" + '{"arrival_s": 1}\n', 4, "missing field"),
    "mooncake_hash": ("mc.jsonl", MC + '{"timestamp": 5, "input_length": 1025, "output_length": 3, '
                      '"hash_ids": [1, 2]}\n', 2, "exactly 3"),
    "mooncake_missing": ("mc.jsonl", MC + '{"timestamp": 5, "input_length": 10}\n', 2, "output_length"),
    "csv_non_numeric": ("a.csv", AZ + "2023-11-16 18:15:47.0000000,abc,44\n", 3, "ContextTokens must be an integer"),
    "csv_bad_timestamp": ("a.csv", AZ + "2023-11-16 25:15:47.0000000,3,44\n", 3, "TIMESTAMP"),
    "csv_zero_tokens": ("a.csv", AZ + "2023-11-16 18:15:47.0000000,3,0\n", 3, "GeneratedTokens must be >= 1"),
    "csv_missing_column": ("a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n", 1, "GeneratedTokens"),
    "csv_cell_count": ("l.csv", LEN + "5\n", 3, "expected 2 cells"),
    "lengths_non_numeric": ("l.csv", LEN + "5,x\n", 3, "num_decode_tokens must be an integer"),
    "lengths_without_rate": ("l.csv", LEN, 1, "--request-rate"),
    "empty_file": ("t.jsonl", "", 1, "empty"),
    "whitespace_only": ("t.csv", "\n  \n", 1, "empty"),
    "header_only": ("l.csv", "num_prefill_tokens,num_decode_tokens\n", 1, "no requests"),
    "unknown_header": ("x.csv", "a,b\n1,2\n", 1, "unrecognised"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input(tmp_path, case):
    name, text, line, reason = MALFORMED[case]
    path = tmp_path / name
    path.write_text(text)
    rate = 1.0 if name == "l.csv" and case != "lengths_without_rate" else None
    with pytest.raises(TraceError) as info:
        load_trace(path, request_rate=rate)
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    assert reason in msg, msg
    assert info.value.line == line


def test_lengths_zero_tokens(tmp_path):
    path = tmp_path / "l.csv"
    path.write_text(LEN + "0,3\n")
    with pytest.raises(TraceError, match=r"l\.csv:3: num_prefill_tokens must be >= 1"):
        load_trace(path, request_rate=1.0)


# ---- synthetic prompts -------------------------------------------------------------------------

def test_synthesize_prompt_shared_prefixes():
    a = TraceRequest("a", 0.0, 1200, 1, hash_ids=[1, 2, 3])
    b = TraceRequest("b", 0.0, 1100, 1, hash_ids=[1, 2, 9])
    pa, pb = synthesize_prompt(a, 32000, seed=5), synthesize_prompt(b, 32000, seed=5)
    assert pa.dtype == np.int32 and len(pa) == 1200 and len(pb) == 1100
    assert (pa[:1024] == pb[:1024]).all()
    assert (pa[1024:1100] != pb[1024:1100]).mean() > 0.99
    assert (synthesize_prompt(a, 32000, seed=5) == pa).all()                     # deterministic
    assert (synthesize_prompt(a, 32000, seed=6)[:512] != pa[:512]).mean() > 0.99  # seed matters
    # a block's run depends only on the hash id, not on the request or block size
    c = TraceRequest("c", 0.0, 100, 1, hash_ids=[2], hash_block_size=100)
    assert (synthesize_prompt(c, 32000, seed=5) == pa[512:612]).all()


def test_synthesize_prompt_without_hash_ids_and_range():
    a, b = TraceRequest("a", 0.0, 4000, 1), TraceRequest("b", 0.0, 4000, 1)
    pa, pb = synthesize_prompt(a, 1000, reserved=256), synthesize_prompt(b, 1000, reserved=256)
    assert len(pa) == 4000 and (pa != pb).mean() > 0.99
    assert (synthesize_prompt(TraceRequest("a", 9.0, 4000, 7), 1000, reserved=256) == pa).all()
    for p in (pa, pb):
        assert p.min() >= 256 and p.max() < 1000 and len(np.unique(p)) > 700
    real = TraceRequest("r", 0.0, 3, 1, prompt_token_ids=[4, 5, 6])
    assert synthesize_prompt(real, 10).tolist() == [4, 5, 6]
    with pytest.raises(ValueError):
        synthesize_prompt(real, 6)
    with pytest.raises(ValueError):
        synthesize_prompt(a, 256, reserved=256)


def test_synthesized_mooncake_prompts_share_their_hash_id_prefixes():
    reqs = load_trace(MOONCAKE)
    first_block: dict[int, np.ndarray] = {}
    for r in reqs:
        p = synthesize_prompt(r, 128256, reserved=256)
        assert len(p) == r.input_tokens
        h = r.hash_ids[0]
        if h in first_block:
            n = min(len(first_block[h]), len(p))
            assert (first_block[h][:n] == p[:n]).all()
        else:
            first_block[h] = p[:512]
    assert len(first_block) < len(reqs)  # the trace really shares prefixes


def test_a_prompt_of_hashed_blocks_costs_its_own_length_whatever_the_block_size(tmp_path):
    """The largest hash block accepted synthesizes a short prompt without a block-sized array (2^31 once
    allocated 16 GiB), and the tokens are those of the per-block layout."""
    from testbed.workload.trace import MAX_HASH_BLOCK_SIZE, synthesize_prompt
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "hash_ids": [7], '
                    f'"hash_block_size": {MAX_HASH_BLOCK_SIZE}}}\n'
                    '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "hash_ids": [7, 9], "hash_block_size": 3}\n')
    big, small = load_trace(path)
    a, b = synthesize_prompt(big, 1000), synthesize_prompt(small, 1000)
    assert len(a) == len(b) == 5 and list(a[:3]) == list(b[:3])  # hash id 7's first tokens, in either layout


_CELL = st.tuples(st.integers(0, 3000), st.sampled_from(["{}", "0{}", " {}", "{} ", "+{}", "{}.0"]))
_ROW = st.tuples(st.dates(dt.date(2023, 1, 1), dt.date(2024, 12, 31)), st.integers(0, 24), st.integers(0, 59),
                 st.integers(0, 59), st.sampled_from(["", ".5", ".0000001", ".123456789"]), st.sampled_from(" T"),
                 _CELL, _CELL)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(_ROW, min_size=1, max_size=12))
def test_azure_rows_read_in_one_match_as_cell_by_cell(tmp_path, rows):
    """A row of the published layout is read in one regex match, any other cell by cell: the same requests (or the
    same error) either way. The second file's extra column sends every row the cell-by-cell way."""
    text = []
    for day, hh, mm, ss, frac, sep, (ctx, cfmt), (gen, gfmt) in rows:
        text.append(f"{day.isoformat()}{sep}{hh:02d}:{mm:02d}:{ss:02d}{frac},{cfmt.format(ctx)},{gfmt.format(gen)}")
    one, cells = tmp_path / "one.csv", tmp_path / "cells.csv"
    one.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(text) + "\n")
    cells.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,x\n" + "\n".join(f"{t},0" for t in text) + "\n")
    got = []
    for path in (one, cells):
        try:
            got.append([dataclasses.astuple(r) for r in load_trace(path)])
        except TraceError as e:
            got.append(str(e).replace(str(path), "FILE"))
    assert got[0] == got[1]
