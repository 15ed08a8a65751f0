"""Beam search in the engine: a beam group is one unit for admission and preemption, its beams share their
prompt's and common prefix's blocks by reference, a beam writing into a shared partial block copies it first
(exactly then), and the result is vLLM's beam search over the same logprobs (checked against a direct
implementation of vLLM's algorithm on a deterministic toy distribution)."""
from __future__ import annotations

import math
import zlib

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from testbed.engine.outputs import ModelRunnerOutput, SchedulerOutput
from testbed.engine.params import BeamSearchParams, SamplingParams
from testbed.engine.request import Request
from conftest import KVCheckingExecutor, make_engine, make_request, run_engine

VOCAB = 12


def toy_logprobs(tokens) -> list[float]:
    """A deterministic next-token distribution of a token sequence (log-softmax of hashed scores)."""
    scores = [(zlib.crc32(repr((tuple(tokens), t)).encode()) % 1000) / 250.0 for t in range(VOCAB)]
    z = math.log(sum(math.exp(s) for s in scores))
    return [s - z for s in scores]


class ToyModelExecutor(KVCheckingExecutor):
    """The KV-checking executor (block contents, swaps and copies verified) answering every sampled row with the
    toy distribution's top logprobs, as a model runner would: (logprob, rank, [(token, logprob), ...])."""

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        lps = []
        for i, (r, tok) in enumerate(zip(so.requests, out.sampled_token_ids)):
            if tok < 0:
                lps.append(None)
                continue
            lp = toy_logprobs(r.token_ids(0, r.num_tokens))
            order = sorted(range(VOCAB), key=lambda t: -lp[t])
            k = r.sampling_params.logprobs or 0
            out.sampled_token_ids[i] = order[0]  # greedy, as a temperature-0 row draws
            lps.append((lp[order[0]], 1, [(t, lp[t]) for t in order[:k]]))
        out.logprobs = lps
        return out


def reference_beam_search(prompt, width: int, max_tokens: int, eos: int | None, ignore_eos: bool,
                          length_penalty: float = 1.0):
    """vLLM's LLM.beam_search loop, written out: (generated tokens, cumulative logprob) of the best beams."""
    def score(b):
        n = len(prompt) + len(b[0]) - (1 if b[0] and b[0][-1] == eos else 0)
        return b[1] / n ** length_penalty
    beams, done = [([], 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in beams:
            lp = toy_logprobs([*prompt, *toks])
            for t in sorted(range(VOCAB), key=lambda t: -lp[t])[:2 * width]:
                (done if t == eos and not ignore_eos else cands).append(([*toks, t], cum + lp[t]))
        beams = sorted(cands, key=score, reverse=True)[:width]
    return [(t, c) for t, c in sorted(done + beams, key=score, reverse=True)[:width]]


def beam_request(rid: str, prompt, width: int, max_tokens: int, eos: int | None = None, ignore_eos: bool = False,
                 arrival: float = 0.0, length_penalty: float = 1.0) -> Request:
    bp = BeamSearchParams(width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty)
    return Request(rid, list(prompt), bp.sampling_params(), arrival, eos_token_id=eos, beam_params=bp)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 4), max_tokens=st.integers(1, 9), prompt_len=st.integers(1, 9),
       block_size=st.sampled_from([1, 2, 4]), eos=st.none() | st.integers(0, VOCAB - 1), ignore_eos=st.booleans(),
       others=st.integers(0, 4), num_blocks=st.integers(10, 36), swap=st.booleans(), prefix=st.booleans(),
       length_penalty=st.sampled_from([1.0, 0.0, 2.0, -1.0]))
def test_beams_are_vllms_with_shared_blocks_under_pressure(width, max_tokens, prompt_len, block_size, eos, ignore_eos,
                                                          others, num_blocks, swap, prefix, length_penalty):
    """Beam groups next to plain requests on a small cache (preempted by swap or recompute, whole): every result
    is the reference beam search's at the drawn length_penalty, every block holds what its table says (KV
    checked), and the pools are clean at the end."""
    engine = make_engine(num_blocks, 64, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=32,
                         preemption_mode="swap" if swap else "recompute", num_cpu_blocks=40,
                         enable_prefix_caching=prefix)
    prompt = [(7 * i + 3) % VOCAB for i in range(prompt_len)]
    arrivals = [(0, beam_request("g0", prompt, width, max_tokens, eos, ignore_eos, length_penalty=length_penalty)),
                (1, beam_request("g1", prompt, width, max_tokens, eos, ignore_eos, 1.0, length_penalty))]
    arrivals += [(j, make_request(f"p{j}", prompt_len=10, max_tokens=12, arrival=float(j))) for j in range(others)]
    steps, outs = run_engine(engine, arrivals, ToyModelExecutor(block_size))
    want = reference_beam_search(prompt, width, max_tokens, eos, ignore_eos, length_penalty)
    for g in ("g0", "g1"):
        last = outs[g][-1]
        if last.finish_reason == "rejected":
            continue
        got = [(b[0], b[2]) for b in last.beams]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [c for _, c in got] == [c for _, c in want]  # same sums in the same order: equal floats
    bm = engine.block_manager
    event(f"copied on write {any(so.blocks_to_copy for so in steps)}")
    event(f"groups preempted {any(i.startswith('g') for so in steps for i in so.preempted_req_ids)}")
    assert bm.num_used_blocks == 0 and bm.num_used_cpu_blocks == 0 and not engine.scheduler.beam_extra
    bm.check_invariants()
    for so in steps:  # a group is one unit: all of its beams in a step, or none
        ids = [r.request_id for r in so.requests]
        for g in ("g0", "g1"):
            n = sum(i.startswith(f"{g}#") for i in ids)
            assert n == 0 or n == sum(1 for r in so.requests if r.group is not None and r.group.request_id == g)


def test_copy_on_write_happens_exactly_when_a_shared_partial_block_is_written():
    """Before each step, the blocks beams will write into are known from their tables: a block shared by w
    writers (and nobody else) is copied w - 1 times, the last writer keeping it; a block shared beyond its
    writers is copied w times; a block of one beam, or a fresh one (the write starts a block), is not copied."""
    bs = 4
    engine = make_engine(64, 64, block_size=bs, max_num_seqs=8, max_num_batched_tokens=32)
    executor = ToyModelExecutor(bs)
    engine.add_request(beam_request("g", [1, 2, 3, 4, 5, 6], 4, 10), 0.0)  # prompt ends mid-block: shared partial
    bm, copies_seen = engine.block_manager, 0
    for step in range(40):
        group = engine.requests.get("g")
        if group is None:
            break
        expected = 0
        if group.beams is not None:
            writers: dict[int, int] = {}
            for s in group.beams:
                table, p = bm.req_blocks[s.request_id], s.num_computed_tokens
                if p // bs < len(table):  # inside a block it has (partial: p % bs != 0)
                    writers[table[p // bs]] = writers.get(table[p // bs], 0) + 1
            expected = sum(w - (bm.ref_cnt[b] == w) for b, w in writers.items() if bm.ref_cnt[b] > 1)
        so = engine.schedule(float(step))
        assert len(so.blocks_to_copy) == expected, f"step {step}"
        copies_seen += expected
        for r, b in zip(so.requests, so.num_computed_before):  # nobody writes into a block it shares
            assert bm.ref_cnt[bm.req_blocks[r.request_id][b // bs]] == 1
        engine.update(so, executor.execute(so), float(step + 1))
        bm.check_invariants()
    assert "g" not in engine.requests and copies_seen >= 3  # the prompt's partial block, copied by 3 of 4 beams


def test_a_beam_group_holds_fewer_blocks_than_as_many_independent_requests():
    """Width 4 against 4 separate requests with the same 40-token prompt, both 12 tokens into generation: the
    beams share the prompt's blocks (and their common prefix), the requests hold a copy each."""
    prompt = [(5 * i + 1) % VOCAB for i in range(40)]

    def blocks_after(reqs, steps: int) -> int:
        engine = make_engine(200, 128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
        executor = ToyModelExecutor(4)
        for r in reqs:
            engine.add_request(r, 0.0)
        for step in range(steps):
            so = engine.schedule(float(step))
            engine.update(so, executor.execute(so), float(step + 1))
        return engine.block_manager.num_used_blocks

    beams = blocks_after([beam_request("g", prompt, 4, 16)], 13)
    alone = blocks_after([Request(f"r{i}", prompt, SamplingParams(max_tokens=16), 0.0) for i in range(4)], 13)
    assert alone == 4 * (-(-(40 + 12) // 4)) and beams < alone
    assert beams <= 40 // 4 + 4 * (-(-12 // 4) + 1)  # one copy of the prompt, then each beam's own blocks


def test_simulate_runs_beam_search_requests_from_a_trace(tmp_path, capsys):
    """`beam_width` in a trace line makes that request a beam search in `testbed simulate`: its beams share
    blocks, copy on write (charged by the cost model), and swap with the rest under pressure."""
    import json

    from testbed.cli import main
    from testbed.workload.trace import load_trace
    trace = tmp_path / "beams.jsonl"
    rows = [{"id": f"r{i}", "arrival_s": 0.001 * i, "input_tokens": 100 + 7 * i, "output_tokens": 40,
             **({"beam_width": 4} if i % 2 == 0 else {})} for i in range(8)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.beam_width for r in load_trace(trace)] == [4, None] * 4
    flags = ["--model", "Llama-3.2-1B", "--gpu", "H100", "--cost-model", "roofline", "--num-gpu-blocks", "60",
             "--block-size", "16", "--no-progress", "--format", "json"]
    # --swap-space sizes the CPU pool from the model's block bytes: 16 tokens x K, V x 16 layers x 8 KV heads x 64 x 2 B
    assert main(["simulate", str(trace), *flags, "--preemption-mode", "swap", "--swap-space", str(200 * 2**19 / 2**30),
                 "-o", str(tmp_path / "swap")]) == 0
    swap = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "swap" / "manifest.json").read_text())["num_cpu_blocks"] == 200
    assert swap["num_finished"] == 8 and swap["num_blocks_copied"] > 0 and swap["num_swap_preemptions"] > 0
    assert main(["simulate", str(trace), *flags, "-o", str(tmp_path / "recompute")]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["num_finished"] == 8 and rec["num_preemptions"] > 0 and rec["num_swap_preemptions"] == 0
    import pandas as pd
    reqs = pd.read_parquet(tmp_path / "swap" / "requests.parquet")
    assert (reqs["output_tokens"] == 40).all()  # a beam search's output is its best beam's


def test_at_a_temperature_the_drawn_token_is_a_candidate_too():
    """temperature > 0: each beam's row draws its token from the tempered distribution, and vLLM's logprobs of the
    row include the drawn token whatever its rank, so it is one more candidate beside the top 2 x beam_width, with
    its own logprob; at temperature 0 the drawn token is the top one and adds nothing."""
    from testbed.engine.beam_search import Beam, candidates, step_beams
    sp = BeamSearchParams(2, 4, temperature=0.7).sampling_params()
    assert sp.temperature == 0.7 and sp.logprobs == 4
    parent = Beam([], [], 0.0)
    top = [(3, -0.2), (5, -1.9)]
    assert candidates([parent], [(9, (-6.5, 7, top))]) == [(0, 3, -0.2), (0, 5, -1.9), (0, 9, -6.5)]
    assert candidates([parent], [(3, (-0.2, 1, top))]) == [(0, 3, -0.2), (0, 5, -1.9)]
    # with width 3 the drawn token's beam is kept, third, carrying the logprobs it was chosen among
    beams, done = step_beams([parent], [(9, (-6.5, 7, top))], 3, 4, None, True, 1.0)
    assert [(b.token_ids, b.cum_logprob) for _, b in beams] == [([3], -0.2), ([5], -1.9), ([9], -6.5)] and not done
    assert beams[2][1].logprobs == [{3: -0.2, 5: -1.9, 9: -6.5}]
