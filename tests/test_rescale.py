"""Profiles rescaled per component (sim/step_terms.py, sim/rescale.py, `testbed calibrate`): the fit recovers
known scales from steps timed with them, a calibrated profile round-trips through its file, an unscaled profile
predicts exactly what it did before scales existed, and calibrating on a simulated run made with known scales
finds them again through the CLI; bad inputs are refused with what to do."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import Phase, given, settings, strategies as st

from testbed.cli import main
from testbed.engine.config import EngineConfig
from testbed.profiling.profile_file import PROFILES_DIR, ProfileError
from testbed.sim.profiled import ProfiledCostModel
from testbed.sim.rescale import StepSample, calibrated_profile, error_report, fit_scales
from testbed.sim.step_terms import COMPONENTS, DECODE_ASYNC, Scales, combine, design
from testbed.profiling.sweep import random_step
from testbed.profiling.synthetic_steps import StepFactory

ROOT = Path(__file__).resolve().parents[1]
PROFILE = PROFILES_DIR / "Llama-3.2-1B_H200_tp1.json"
SAMPLE = ROOT / "traces/azure_conv_10min.jsonl"
scale = st.floats(0.5, 2.0)


def _steps(cm: ProfiledCostModel, n: int, seed: int = 0) -> list:
    """n random steps as a loaded server forms them (decode-only ones among them)."""
    rng = np.random.default_rng(seed)
    f = StepFactory(1 << 30, cm.block_size, 32000)
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    out = []
    for i in range(n):
        rows = random_step(rng, config, 4096, 1 << 30)
        if i % 3 == 0:  # a third decode-only
            rows = [r for r in rows if r[2]] or [(100, 1, True)]
        out.append(f.step(rows))
    return out


def _timed_with(cm: ProfiledCostModel, true: Scales, n: int = 90) -> list[StepSample]:
    return [StepSample(kind, terms, combine(kind, terms, true)) for kind, terms in (cm.terms(so) for so in _steps(cm, n))]


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(host=scale, gemm=scale, attention=scale, decode=scale)
def test_the_fit_recovers_the_scales_steps_were_timed_with(host, gemm, attention, decode):
    """Sync scheduling: every component adds up in every step, so each one the steps spend time in is found."""
    cm = ProfiledCostModel.from_file(PROFILE)
    true = Scales(host, gemm, attention, decode)
    samples = _timed_with(cm, true)
    fitted = fit_scales(samples)
    assert error_report(samples, fitted)["mape"] < 1e-3
    for c in COMPONENTS:
        share = sum(design(s.kind, s.terms, true).get(c, 0.0) * getattr(true, c) for s in samples) / sum(
            s.seconds for s in samples)
        if share > 0.05:
            assert getattr(fitted, c) == pytest.approx(getattr(true, c), rel=1e-2), (c, share)


def test_the_fit_under_async_scheduling_finds_the_bound_it_sees():
    """Async scheduling hides the smaller of host and device work in each step: the fit reproduces every step's
    time and finds the scales of the work that bounds the steps (host, decode), where each bounds some of them."""
    cm = ProfiledCostModel.from_file(PROFILE, async_scheduling=True)
    true = Scales(host=1.5, gemm=0.8, attention=1.1, decode=0.8)
    samples = _timed_with(cm, true)
    host_bound = sum(s.kind == DECODE_ASYNC and "host" in design(s.kind, s.terms, true) for s in samples)
    assert 5 <= host_bound < sum(s.kind == DECODE_ASYNC for s in samples)  # both bounds are seen
    fitted = fit_scales(samples)
    assert error_report(samples, fitted)["mape"] < 1e-3
    assert (fitted.host, fitted.decode) == (pytest.approx(1.5, rel=1e-2), pytest.approx(0.8, rel=1e-2))


def test_a_noisy_run_keeps_the_scales_near_one_common_scale(monkeypatch):
    """Steps timed with every component 10% slower and 5% noise per step: separate scales fitted freely explain
    some of the noise (one run hardly tells host from decode); the shrunk fit stays nearer the common scale, at
    the same error within 2%. Five noisy runs, so one lucky draw does not decide."""
    import testbed.sim.rescale as rescale
    cm = ProfiledCostModel.from_file(PROFILE)
    clean = _timed_with(cm, Scales(1.1, 1.1, 1.1, 1.1), n=120)
    spread = lambda s: max(abs(getattr(s, c) / 1.1 - 1) for c in COMPONENTS)  # noqa: E731
    shipped = rescale.SHRINK  # the constant `testbed calibrate` and `profile --quick` use, against no shrinking
    fits = {shipped: [], 0.0: []}
    for seed in range(5):
        rng = np.random.default_rng(seed)
        samples = [StepSample(s.kind, s.terms, s.seconds * (1 + 0.05 * rng.standard_normal())) for s in clean]
        for shrink in fits:
            monkeypatch.setattr(rescale, "SHRINK", shrink)
            fitted = fit_scales(samples)
            fits[shrink].append((spread(fitted), error_report(samples, fitted)["mape"]))
    (shrunk_spread, shrunk_err), (free_spread, free_err) = (np.mean(fits[k], axis=0) for k in (shipped, 0.0))
    assert shrunk_spread < 0.7 * free_spread and shrunk_err < 1.02 * free_err


def test_an_unscaled_profile_predicts_as_it_did_and_a_scaled_one_round_trips(tmp_path):
    cm = ProfiledCostModel.from_file(PROFILE)
    steps = _steps(cm, 40, seed=3)
    assert cm.scales == Scales()
    for so in steps:  # the terms recombine to the step time, with the old grouping of the sums
        assert combine(*cm.terms(so), Scales()) == cm.step_time(so)
    scales = Scales(1.3, 0.8, 1.1, 0.9)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(calibrated_profile(cm.profile, scales, "a run", {"mape": 0.2}, {"mape": 0.1})))
    again = ProfiledCostModel.from_file(path)
    assert again.scales == scales
    assert json.loads(path.read_text())["calibration"]["fitted_on"] == "a run"
    for so in steps:
        assert again.step_time(so) == combine(*cm.terms(so), scales)
    assert any(again.step_time(so) != cm.step_time(so) for so in steps)


@pytest.mark.parametrize("bad", [{"host": 0}, {"gpu": 1.2}, {"gemm": "fast"}])
def test_a_profile_with_bad_scales_is_refused(tmp_path, bad):
    data = json.loads(PROFILE.read_text()) | {"scales": bad}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="bad.json: .*scale"):
        ProfiledCostModel.from_file(path)


def _simulate(tmp_path: Path, profile: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    assert main(["simulate", str(SAMPLE), "--limit", "150", "--request-rate", "12", "--model", "Llama-3.2-1B",
                 "--gpu", "H200", "--max-model-len", "4096", "--cost-model", str(profile), "--no-progress",
                 "--format", "json", "-o", str(out), *extra]) == 0
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_calibrate_finds_the_scales_a_run_was_made_with(tmp_path, capsys, dp):
    """A simulated run stands in for a machine whose host is 30% slower and decode steps 10% slower than the profile's:
    calibrating the unscaled profile on that run's recorded steps finds those scales (decision parity makes
    every replayed batch the run's). A data-parallel run is replayed routed as recorded, and every step of each
    of its replicas is paired with its own time: a step paired with another's, or a replica left out, fails."""
    true = Scales(host=1.3, gemm=0.8, attention=1.0, decode=1.1)
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(json.loads(PROFILE.read_text()) | {"scales": true.to_dict()}))
    run = _simulate(tmp_path, machine, "run", "-dp", str(dp))
    capsys.readouterr()
    out = tmp_path / "calibrated.json"
    assert main(["calibrate", str(run), "--cost-model", str(PROFILE), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scales: host 1.300" in printed and "total time of the steps" in printed
    prof = json.loads(out.read_text())
    for c in ("host", "decode"):  # this profile's mixed steps are launch-bound (host): their GEMMs go unseen
        assert prof["scales"][c] == pytest.approx(getattr(true, c), rel=1e-3), (c, prof["scales"])
    cal = prof["calibration"]
    assert cal["error_after"]["mape"] < 1e-3 < cal["error_before"]["mape"]
    steps = pd.read_parquet(run / "steps.parquet", columns=["replica", "num_reqs"])
    assert steps["replica"].nunique() == dp == cal["data_parallel_size"]
    assert cal["error_after"]["steps"] == (steps["num_reqs"] > 0).sum()


def test_calibrate_refuses_what_it_cannot_use(tmp_path, capsys):
    run = _simulate(tmp_path, PROFILE, "run")
    dp_async = _simulate(tmp_path, PROFILE, "dp", "-dp", "2", "--async-scheduling")
    asyn = _simulate(tmp_path, PROFILE, "async", "--async-scheduling")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "manifest.json", bare / "manifest.json")
    out = tmp_path / "o.json"
    cases = [([str(run), "--cost-model", str(PROFILES_DIR / "Qwen3-0.6B_H200_tp1.json")], "profile is for Qwen3-0.6B"),
             ([str(run), "--cost-model", "roofline"], "calibrate rescales a profile"),
             ([str(dp_async)], "async-scheduling"),
             ([str(asyn)], "async-scheduling"),
             ([str(bare)], "bare")]
    capsys.readouterr()
    for argv, message in cases:
        assert main(["calibrate", *argv, "-o", str(out)]) != 0, argv
        err = capsys.readouterr().err
        assert "testbed calibrate: error:" in err and message in err, (argv, err)
    assert not out.exists()
