"""A data-parallel replica's host term per step (the profile's `dp_replica_host`, sim/profiled.py; fitted by
`testbed calibrate` of a DP run, sim/dp_host_fit.py): the simulator charges it on every step of a DP replica (and
its per-request part on the steps that schedule requests for the first time) and never at DP=1, the same whether a
stretch of decodes is stepped or fast-forwarded, and calibrating on a DP run whose replicas spent it between their
steps (as a real replica's records hold it) finds it apart from the scales."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from testbed.cli import main
from testbed.engine.config import EngineConfig
from testbed.profiling.profile_file import ProfileError
from testbed.sim.cluster import simulate
from testbed.sim.profiled import ProfiledCostModel
from testbed.workload.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
# the 1B H200 profile shipped until 2026-11-28 (eager mixed steps): the calibration test below builds its run's gaps as
# engine_step + the term, which is exact for this profile's form (with the graphed profiles shipped now the fit
# comes out 1-2% low)
PROFILE = ROOT / "benchmarks/results/2026-11-24_h200_profiles_retired/Llama-3.2-1B_H200_tp1.json"
TRACE = ROOT / "traces/azure_conv_10min.jsonl"
BLOCKS, MAX_LEN, VOCAB = 4000, 4096, 128256


def _profile(step_s: float | None, row_s: float = 0.0, host: float = 1.0, request_s: float = 0.0) -> dict:
    prof = json.loads(PROFILE.read_text()) | {"scales": {"host": host}}
    if step_s is not None:
        prof["dp_replica_host"] = {"step_s": step_s, "row_s": row_s, "request_s": request_s}
    return prof


class Priced:
    """The real cost model, noting every batch it prices (so each can be priced again by another model)."""

    def __init__(self, cm: ProfiledCostModel) -> None:
        self.cm, self.batches = cm, []

    def step_time(self, so) -> float:
        self.batches.append(so)
        return self.cm.step_time(so)


@settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(step_s=st.floats(1e-5, 1e-3), row_s=st.floats(0.0, 5e-6), host=st.floats(0.7, 1.5),
       policy=st.sampled_from(["least_loaded", "round_robin"]), request_s=st.sampled_from([0.0, 4e-4]))
# a fast-forwarded stretch's last step (it finishes azure-18 at 1.18675 s) ends after replica 0 rejects azure-30
# (4,081 tokens) at 1.18515 s: the rejection's row goes first, as stepping records it
@example(step_s=9.795365473906027e-05, row_s=3.823674122256203e-06, host=0.8613719487464649, policy="round_robin",
         request_s=0.0)
def test_the_term_is_charged_on_every_dp_replica_step_and_never_at_dp_1(step_s, row_s, host, policy, request_s):
    trace = load_trace(str(TRACE), request_rate=30.0, limit=40, seed=0)
    config = EngineConfig(data_parallel_size=2, dp_policy=policy, max_model_len=MAX_LEN)
    with_term = ProfiledCostModel(_profile(step_s, row_s, host, request_s), data_parallel_size=2)
    without = ProfiledCostModel(_profile(None, host=host), data_parallel_size=2)
    single = ProfiledCostModel(_profile(step_s, row_s, host, request_s), data_parallel_size=1)
    priced = Priced(with_term)
    stepped = simulate(trace, config, priced, BLOCKS, MAX_LEN, VOCAB, fast_forward_decodes=False)
    assert {r[1] for r in stepped.records.requests} == {0, 1}  # both replicas served
    admitting = 0
    for so in priced.batches:  # each replica step pays host x (step_s + row_s x rows + request_s x requests it
        # schedules for the first time) more; a single engine nothing
        extra = with_term.step_time(so) - without.step_time(so)
        admitting += bool(so.new_req_ids)
        assert extra == pytest.approx(host * (step_s + row_s * len(so.requests) + request_s * len(so.new_req_ids)),
                                      rel=1e-6, abs=1e-12)
        assert single.step_time(so) == without.step_time(so)
    assert admitting >= 20
    # stretches of decodes priced in one go (decode_steps) charge it exactly as step by step
    fast = simulate(trace, config, with_term, BLOCKS, MAX_LEN, VOCAB, fast_forward_decodes=True)
    assert fast.records.requests == stepped.records.requests
    assert list(fast.records.steps) == list(stepped.records.steps)


def _simulate(tmp_path: Path, profile: dict, name: str, dp: int) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(profile))
    out = tmp_path / name
    assert main(["simulate", str(TRACE), "--limit", "150", "--request-rate", "12", "--model", "Llama-3.2-1B",
                 "--gpu", "H200", "--max-model-len", str(MAX_LEN), "--cost-model", str(path), "--no-progress",
                 "--format", "json", "-o", str(out), "-dp", str(dp)]) == 0
    return out


def test_a_single_engine_simulates_the_same_with_the_term_and_a_dp_run_slower(tmp_path, capsys):
    """Through `testbed simulate`: at DP=1 a profile with the term gives the very records of one without it; at
    DP=2 each replica's steps are longer."""
    runs = {(name, dp): _simulate(tmp_path, _profile(step_s), f"{name}{dp}", dp)
            for name, step_s in (("plain", None), ("term", 2e-4)) for dp in (1, 2)}
    capsys.readouterr()
    for f in ("steps.parquet", "requests.parquet"):
        assert pd.read_parquet(runs["plain", 1] / f).equals(pd.read_parquet(runs["term", 1] / f))
    median = {}  # a decode step's median time per batch size
    for k in ("plain", "term"):
        steps = pd.read_parquet(runs[k, 2] / "steps.parquet")
        decode = steps[steps["num_prefill_tokens"] == 0]
        counts = decode["num_reqs"].value_counts()
        median[k] = decode[decode["num_reqs"].isin(counts[counts >= 20].index)].groupby("num_reqs")["duration"].median()
    extra = (median["term"] - median["plain"]).dropna()
    assert len(extra) >= 3 and extra.between(1e-4, 3e-4).all(), extra  # contexts differ a little


def test_calibrate_fits_the_dp_term_apart_from_the_scales(tmp_path, capsys):
    """A DP run whose replicas spend `step_s` between their steps besides the update (as a real replica records
    it: its steps end when the update starts) on a machine with decode steps 10% slower: calibrating finds that
    term and the scales; with --dp-replica-host-only it finds the term and keeps the profile's scales."""
    true_step = 1.5e-4
    machine = json.loads(PROFILE.read_text()) | {"scales": {"decode": 1.1}, "dp_replica_host": {"step_s": true_step}}
    run = _simulate(tmp_path, machine, "run", 2)
    steps = pd.read_parquet(run / "steps.parquet")
    cm = ProfiledCostModel.from_file(PROFILE)
    last = steps.groupby("replica")["start"].transform("max") == steps["start"]
    decode = (steps["num_prefill_tokens"] == 0) & ~last  # the simulated step holds update + term: move them after it
    gap = [cm.engine_step(int(b)) + true_step for b in steps.loc[decode, "num_reqs"]]
    steps.loc[decode, "duration"] = steps.loc[decode, "duration"] - gap
    assert (steps["duration"] > 0).all()
    steps.to_parquet(run / "steps.parquet")
    capsys.readouterr()
    for only, out in ((False, tmp_path / "cal.json"), (True, tmp_path / "only.json")):
        assert main(["calibrate", str(run), "--cost-model", str(PROFILE), "-o", str(out),
                     *(["--dp-replica-host-only"] if only else [])]) == 0
        assert "dp replica host: 0.150 ms a step" in capsys.readouterr().out
        prof = json.loads(out.read_text())
        assert prof["dp_replica_host"]["step_s"] == pytest.approx(true_step, rel=1e-3)
        assert prof["scales"]["decode"] == pytest.approx(1.0 if only else 1.1, rel=1e-3)
        assert prof["scales"]["host"] == pytest.approx(1.0, rel=1e-3)
        assert prof["dp_replica_host"]["request_s"] < 5e-6  # this run's replicas took their requests in for free
    assert prof["calibration"]["error_after"]["mape"] < prof["calibration"]["error_before"]["mape"]
    single = tmp_path / "single"
    _simulate(tmp_path, json.loads(PROFILE.read_text()), "single", 1).rename(single)
    assert main(["calibrate", str(single), "--cost-model", str(PROFILE), "--dp-replica-host-only", "-o",
                 str(tmp_path / "x.json")]) != 0
    assert "a single engine's run" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"row_s": 1e-6}, {"step_s": -1.0}, {"step_s": "slow"},
                                 {"step_s": 1e-4, "request_s": -1e-4}, {"step_s": 1e-4, "request_s": float("inf")}])
def test_a_bad_dp_replica_host_section_is_refused(bad):
    with pytest.raises(ProfileError, match="dp_replica_host"):
        ProfiledCostModel(json.loads(PROFILE.read_text()) | {"dp_replica_host": bad}, name="p.json",
                          data_parallel_size=2)


def test_profile_measures_the_term_with_real_replica_processes(tmp_path, capsys):
    """`testbed profile --dp-replica-host --cost-model P`: the in-process engine loop and two real DP replica
    processes behind the coordinator run the same emulated steps; each replica's time between back-to-back decode
    steps is longer than the single engine's at every batch measured, and the profile written carries the term,
    which a DP simulation with it then charges."""
    out = tmp_path / "with_term.json"
    assert main(["profile", "--dp-replica-host", "--cost-model", str(PROFILE), "--max-model-len", str(MAX_LEN),
                 "-o", str(out)]) == 0
    assert "dp replica host on this host" in capsys.readouterr().out
    prof = json.loads(out.read_text())
    section = prof["dp_replica_host"]
    assert section["method"] == "measured" and section["batch"] == [1, 8, 32, 64]
    assert all(r > s for r, s in zip(section["replica_gap_s"], section["single_gap_s"])), section
    assert section["step_s"] > 0 and section["step_s"] + 64 * section["row_s"] < 5e-3
    assert {k: v for k, v in prof.items() if k != "dp_replica_host"} == json.loads(PROFILE.read_text())
    cm = ProfiledCostModel.from_file(out, data_parallel_size=2)
    assert cm.dp_step(8) == pytest.approx(section["step_s"] + 8 * section["row_s"])


@settings(max_examples=20, deadline=None)
@given(request_s=st.floats(0.0, 1e-3), step_s=st.floats(0.0, 3e-4), after=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**32 - 1))
def test_the_per_request_time_is_recovered_from_the_gaps_around_the_admitting_steps(request_s, step_s, after, seed):
    """fit_dp_admit: gaps (update to next schedule) that hold, besides the replica's step term and its update (a
    multiple of the engine term, more after a step with a chunk), request_s for each request a step schedules for
    the first time, the share `after` in the gap after that step (its notices and report) and the rest in the gap
    before it (its intake), give back request_s, whatever the steps' own lengths; the batches are a real
    simulation's, priced by the profile."""
    import random

    from testbed.sim.dp_host_fit import fit_dp_admit
    from testbed.sim.rescale import StepSample
    from testbed.sim.step_terms import DECODE_SYNC
    trace = load_trace(str(TRACE), request_rate=30.0, limit=60, seed=0)
    cm = ProfiledCostModel(_profile(None))
    priced = Priced(cm)
    simulate(trace, EngineConfig(max_model_len=MAX_LEN), priced, BLOCKS, MAX_LEN, VOCAB, fast_forward_decodes=False)
    rng = random.Random(seed)
    samples = [StepSample(*cm.terms(so), 0.0, len(so.requests), 0.0, len(so.new_req_ids)) for so in priced.batches]
    for s, nxt in zip(samples, samples[1:]):
        s.admitted_next = nxt.admitted
        s.gap = (step_s + 1.3 * s.terms[0] + (5e-5 if s.kind != DECODE_SYNC else 0.0)
                 + request_s * (after * s.admitted + (1.0 - after) * s.admitted_next) + rng.gauss(0, 1e-6))
        s.seconds = rng.uniform(1e-3, 5e-2) + s.gap  # the steps' own lengths say nothing of the intake
    samples[-1].gap = None  # the last step has no next one
    assert sum(s.admitted_next for s in samples) >= 40
    assert fit_dp_admit(samples) == pytest.approx(request_s, abs=2e-6)
