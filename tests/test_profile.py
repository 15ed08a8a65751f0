"""`testbed profile`: a calibrated cost model fitted to real step records (committed H200 runs), used by simulate."""
from __future__ import annotations

import json
from pathlib import Path

from testbed.cli import main

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "benchmarks/results/real_runs"
SAMPLE = ROOT / "traces/azure_conv_10min.jsonl"


def test_profile_fits_real_steps_and_simulate_uses_it(tmp_path, capsys):
    out = tmp_path / "profile.json"
    runs = [str(REAL / "serve_h200_llama3.2-1b_azure_rate4"), str(REAL / "serve_h200_llama3.2-1b_azure_rate16")]
    assert main(["profile", *runs, "--model", "Llama-3.2-1B", "--gpu", "H200", "-o", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["kind"] == "calibrated" and prof["model"] == "Llama-3.2-1B" and prof["num_rows"] > 30000
    assert 0 < prof["mape"] < 0.2 and prof["coefficients"]["intercept"] > 0
    # the committed profile is this fit (same runs, same code), so sim users without a GPU get it
    committed = json.loads((ROOT / "testbed/sim/profiles/Llama-3.2-1B_H200_tp1.json").read_text())
    assert committed["coefficients"] == prof["coefficients"]
    capsys.readouterr()
    assert main(["simulate", str(SAMPLE), "--limit", "50", "--model", "Llama-3.2-1B", "--gpu", "H200",
                 "--cost-model", str(out), "--format", "json", "--no-progress", "-o", str(tmp_path / "run")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_finished"] == 50
    c = prof["coefficients"]
    assert summary["tpot_s"]["p50"] >= c["intercept"]  # every decode step costs at least the fitted intercept


def test_profile_for_another_model_is_refused(tmp_path, capsys):
    prof = ROOT / "testbed/sim/profiles/Llama-3.2-1B_H200_tp1.json"
    code = main(["simulate", str(SAMPLE), "--limit", "5", "--model", "Llama-3.1-8B", "--cost-model", str(prof),
                 "--no-progress", "-o", str(tmp_path / "run")])
    assert code == 2 and "profile is for Llama-3.2-1B" in capsys.readouterr().err
