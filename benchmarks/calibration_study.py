"""Which profile transfers to a machine's other loads: the ways a user can make one, scored on committed real runs.

For each folder of real runs of one machine (benchmarks/results/fidelity/<date>_<commit>_<gpu>_<model>/, made by
`fidelity.py real`), four profiles:
  shipped           the shipped profile for the model and GPU, as it is
  quick             the folder's quick_profile.json (`testbed profile --quick` on that machine), its anchors fitted
                    again under this code's cost model where they kept their rows (quick_rescale.refit_quick)
  calibrated        `testbed calibrate` of the shipped profile on the folder's azure-light run
  quick+calibrated  `testbed calibrate --cost-model quick_profile.json` on the same run
  quick, GPU only   the quick profile with its host scale put back to its base's: how much of what `--quick` gains
                    or loses comes from its host anchors (the noisiest: the host's state moves them between rounds)
each simulated (fidelity.py's sim_case) on every run of the folder but azure-light, the run the calibrations are
fitted on; a bounded metric (throughput 2%; TTFT, TPOT, E2E mean and p50 5%, p99 10%) is within target as
`fidelity.py cross` counts it. Prints one row per folder and the totals. CPU only; a folder takes minutes.

  python benchmarks/calibration_study.py DIR [DIR ...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import error_rows, sim_case, within_target  # noqa: E402

from testbed.profiling.profile_file import write_profile  # noqa: E402
from testbed.sim.quick_rescale import refit_quick  # noqa: E402
from testbed.sim.rescale import calibrate  # noqa: E402

FITTED_ON = "azure-light"
WAYS = ("shipped", "quick", "calibrated", "quick+calibrated", "quick, GPU only")


def profiles(folder: Path, tmp: Path) -> dict[str, str | None]:
    """The profile file of each way that this folder allows (None: the shipped one)."""
    quick = folder / "quick_profile.json"
    out: dict[str, str | None] = {"shipped": None}
    bases = {"calibrated": "auto"}
    if quick.is_file():
        q = json.loads(quick.read_text())
        if any("rows" in a for a in q["calibration"]["anchors"]):
            q = refit_quick(q, str(quick))[0]
            quick = tmp / f"{folder.name}_quick.json"
            write_profile(quick, q)
        out["quick"] = str(quick)
        bases["quick+calibrated"] = str(quick)
        host = (q["calibration"].get("base_scales") or {}).get("host", 1.0)
        gpu_only = tmp / f"{folder.name}_quick_gpu.json"
        write_profile(gpu_only, {**q, "scales": {**q["scales"], "host": host}})
        out["quick, GPU only"] = str(gpu_only)
    for way, base in bases.items():
        profile, _, _ = calibrate(folder / FITTED_ON, base)
        path = tmp / f"{folder.name}_{way}.json"
        write_profile(path, profile)
        out[way] = str(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="folders of one machine's real runs (with an azure-light run)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    missing = [str(d) for d in args.dirs if not (d / FITTED_ON / "manifest.json").is_file()]
    if missing:
        ap.error(f"no {FITTED_ON} run in {', '.join(missing)}: the calibrations are fitted on it")
    rows, totals = [], {w: [0, 0] for w in WAYS}
    with tempfile.TemporaryDirectory() as d:
        for folder in args.dirs:
            runs = sorted(p.parent for p in folder.glob("*/manifest.json") if p.parent.name != FITTED_ON)
            row = {"folder": folder.name, "runs": [r.name for r in runs]}
            for way, profile in profiles(folder, Path(d)).items():
                per_run = {r.name: within_target({e["metric"]: e["profile"] for e in error_rows(sim_case(r, profile))})
                           for r in runs}
                held, total = (sum(x[i] for x in per_run.values()) for i in (0, 1))
                row[way] = {"held": held, "total": total, "runs": per_run}
                totals[way][0] += held
                totals[way][1] += total
            rows.append(row)
            print(f"| {folder.name} | " + " | ".join(f"{row[w]['held']}/{row[w]['total']}" if w in row else "-"
                                                    for w in WAYS) + " |", flush=True)
    print("| all | " + " | ".join(f"{h}/{t} ({h / t:.0%})" if t else "-" for h, t in totals.values()) + " |")
    print("columns: " + ", ".join(WAYS))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "totals": totals}, indent=1) + "\n")


if __name__ == "__main__":
    main()
