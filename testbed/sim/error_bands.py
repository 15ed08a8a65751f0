"""The error to expect from a cost model, as measured: `testbed simulate` states it, `testbed compare` uses it.

A band is, per headline metric, the largest |sim - real| / real that benchmarks/fidelity.py measured for that
cost model (a shipped profile, or the roofline on that model and GPU) over its cases: real `testbed replay` runs
against simulations of the same requests, flags and KV size. `python benchmarks/fidelity.py bands SIM_JSON`
writes them to testbed/sim/error_bands.json. A cost model without fidelity runs gets no band, and the
statement says why (the roofline elsewhere: uncalibrated; a profile of your own: unknown, and how to get one).
"""
from __future__ import annotations

import json
from pathlib import Path

BANDS_FILE = Path(__file__).with_suffix(".json")  # testbed/sim/error_bands.json
# summary.json keys ("key" or "key.quantile") a band covers
METRICS = ("output_throughput", "ttft_s.mean", "ttft_s.p50", "ttft_s.p99", "tpot_s.mean", "tpot_s.p50",
           "tpot_s.p99", "e2e_s.mean", "e2e_s.p50", "e2e_s.p99")


def summary_value(summary: dict, key: str) -> float | None:
    """A summary.json value by "key" or "key.quantile"."""
    name, _, q = key.partition(".")
    v = summary.get(name)
    if q:
        v = v.get(q) if isinstance(v, dict) else None
    return None if v is None else float(v)


def band_key(kind: str, model: str, gpu: str, tp: int) -> str:
    """Where a band is filed: the shipped profile's name, or roofline_{model}_{gpu}_tp{N}."""
    return f"{model}_{gpu}_tp{tp}" if kind == "profile" else f"roofline_{model}_{gpu}_tp{tp}"


def bands_from_fidelity(cases: list[dict], source: str) -> dict:
    """Bands from benchmarks/fidelity.py's `sim --json` output (per case: real and per-cost-model summaries, the
    model, GPU and config): for each cost model and (model, GPU, TP), the largest |error| per metric, and
    `source` (what the real runs were)."""
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec
    out: dict[str, dict] = {}
    for case in cases:
        model, gpu = get_model_spec(case["model"]).name, get_gpu_spec(case["hardware"]).name
        tp = int(case["config"].get("tensor_parallel_size", 1))
        for kind, sim in case["sim"].items():
            entry = out.setdefault(band_key(kind, model, gpu, tp), {"cases": [], "bounds": {}, "source": source})
            entry["cases"].append(case["case"])
            for key in METRICS:
                real, pred = summary_value(case["real"], key), summary_value(sim, key)
                if real and pred is not None:
                    err = abs(pred - real) / abs(real)
                    entry["bounds"][key] = max(entry["bounds"].get(key, 0.0), err)
    return {"bands": out}


def load_bands(path: Path = BANDS_FILE) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"bands": {}}


def expected_error(cost_model, model: str, gpu: str, tp: int, bands: dict | None = None) -> dict:
    """What `testbed simulate` states about its cost model's error: {"basis": text, "bounds": {metric: fraction}}
    (no bounds when none were measured)."""
    from testbed.sim.cost_model import RecordedCostModel, RooflineCostModel
    from testbed.profiling.profile_file import shipped_profile
    from testbed.sim.profiled import ProfiledCostModel
    from testbed.sim.recorded_dp import RecordedDPRun
    bands = load_bands() if bands is None else bands
    from testbed.sim.lora_cost import WithLoRA
    if isinstance(cost_model, WithLoRA):  # no fidelity run covers LoRA's terms: the base model's band, said so
        base = expected_error(cost_model.base, model, gpu, tp, bands)
        return {"basis": f"{base['basis']}; LoRA's roofline terms are not covered by any fidelity run"}
    if isinstance(cost_model, RooflineCostModel):
        entry = bands["bands"].get(band_key("roofline", model, gpu, tp))
        if entry is None:
            return {"basis": f"uncalibrated: no fidelity runs of the roofline for {model} on {gpu} at TP={tp}"}
        return _measured(entry)
    if isinstance(cost_model, ProfiledCostModel):
        cal = cost_model.profile.get("calibration")
        if cal:
            after = cal.get("error_after", {})
            basis = (f"calibrated on {cal.get('fitted_on')}: per-step error there {after.get('mape', 0):.1%} "
                     "(mean absolute); no fidelity runs of this calibration")
            if cal.get("method") == "run" and cost_model.async_scheduling:
                basis += ("; it was fitted on a run without --async-scheduling, and such calibrations predicted "
                          "async runs 15-45% slow in benchmarks/fidelity.py's cross-machine runs (2026-11-26): "
                          "the shipped profile did better there")
            return {"basis": basis}
        shipped = shipped_profile(model, gpu, tp)
        entry = bands["bands"].get(band_key("profile", model, gpu, tp))
        if shipped is not None and entry is not None and Path(cost_model.name).resolve() == shipped.resolve():
            return _measured(entry)
        return {"basis": "unknown: no fidelity runs of this profile (benchmarks/fidelity.py measures them; "
                         "`testbed calibrate` fits a profile to a run of yours)"}
    if isinstance(cost_model, (RecordedCostModel, RecordedDPRun)):
        return {"basis": "exact: the recorded run's own step times (decisions replayed)"}
    return {"basis": "unknown"}


def _measured(entry: dict) -> dict:
    n = len(entry["cases"])
    return {"basis": f"the largest error over {n} fidelity case{'s' if n != 1 else ''}; {entry['source']}",
            "bounds": dict(entry["bounds"])}
