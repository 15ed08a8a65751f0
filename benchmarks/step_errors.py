"""Where a cost model's step times miss a real run: signed errors on the run's own batches, by kind and batch size.

`fidelity.py sim` reports the per-step MAPE; this says which steps carry it and which way. The simulator replays
the run's recorded step timeline (decision parity, so it forms the real batches) while the cost model prices
each step, as fidelity.py's Paired does. For back-to-back steps it prints, per step kind (decode-only or with a
prefill chunk) and batch-size band: the count, the signed mean and median error against the real cycle
(schedule to next schedule), and the real cycle, the real step duration (schedule to update) and the prediction,
in ms. The cycle minus the duration is the engine loop's work between steps that no step covers.

  python benchmarks/step_errors.py RUN_DIR [--profile PROFILE]      (default: the shipped profile)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import Paired, case_trace, paired_steps, read_case  # noqa: E402
from testbed.sim.async_timeline import replayable  # noqa: E402

BANDS = (1, 16, 32, 64, 128, 256, 1 << 30)


class SizedPaired(Paired):
    """Paired that also keeps each step's batch size, in the order of `pairs`."""

    def __init__(self, recorded, model, durations: list[float]) -> None:
        super().__init__(recorded, model, durations)
        self.batch: list[int] = []

    def step_time(self, so) -> float:
        self.batch.append(len(so.requests))
        return super().step_time(so)


def step_errors(run_dir: Path, profile: str | None = None) -> list[dict]:
    """One row per (kind, batch band) with steps: n, signed mean/median error, and mean cycle, duration and
    prediction (s). An async run is replayed call for call (its steps' `scheduled` times): its cycle is then
    update to update, what the profile's async tables price; one recorded before those times cannot be replayed."""
    run, cfg, trace_path, tr = read_case(run_dir)
    if not replayable(run):
        raise SystemExit(f"step_errors: {run_dir} ran with --async-scheduling before its steps recorded when they "
                         "were scheduled, so its batches cannot be replayed. Pick a sync run, or an async one "
                         "recorded since.")
    m = run.manifest
    durations = run.steps(columns=["duration"])["duration"].tolist()
    paired = paired_steps(run_dir, cfg, case_trace(trace_path, tr, cfg), m["model"]["name"], m["hardware"]["name"],
                          profile or "auto", durations, SizedPaired)
    real, pred, dec, busy = (np.array(x) for x in zip(*paired.pairs))
    batch, dur = np.array(paired.batch), np.array(durations[:len(real)])
    rows = []
    for kind, is_kind in (("decode", dec), ("mixed", ~dec)):
        for lo, hi in zip(BANDS, BANDS[1:]):
            sel = busy & is_kind & (batch >= lo) & (batch < hi)
            if not sel.any():
                continue
            err = (pred[sel] - real[sel]) / real[sel]
            rows.append({"kind": kind, "batch": f"{lo}-{hi - 1}" if hi < BANDS[-1] else f"{lo}+", "n": int(sel.sum()),
                         "mean_error": float(err.mean()), "median_error": float(np.median(err)),
                         "cycle_s": float(real[sel].mean()), "duration_s": float(dur[sel].mean()),
                         "predicted_s": float(pred[sel].mean())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--profile", default=None, help="profile JSON (default: the shipped one for the run)")
    a = ap.parse_args()
    print("| kind | batch | steps | mean error | median error | real cycle ms | real duration ms | predicted ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in step_errors(a.run_dir, a.profile):
        print(f"| {r['kind']} | {r['batch']} | {r['n']} | {r['mean_error']:+.1%} | {r['median_error']:+.1%} | "
              f"{r['cycle_s'] * 1e3:.2f} | {r['duration_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
