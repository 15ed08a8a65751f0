"""The DP replica host term (the profile's `dp_replica_host`) on the committed 2-H100 DP runs: each group's real
runs simulated again with the profile its RESULTS row used, and with that profile plus the term fitted by
`testbed calibrate RUN --dp-replica-host-only` on one DP run of the group (or of another group on the same
profile), and with that profile plus the term measured on this host (`testbed profile --dp-replica-host
--cost-model PROFILE`: the real replica processes' loop against the in-process engine's, emulated steps), and
the errors before -> fitted -> measured.

  python benchmarks/dp_host_term.py --out OUT       # CPU, about 5 minutes on 2 shared cores

Per group: OUT/GROUP/profile_{dp,measured}.json (the profile with the fitted / measured term),
OUT/GROUP/{before,after,measured}/ (`dp.py --resimulate` outputs: dp_results.json, tables, decision parity of every
run replayed from its own timings), and OUT/dp_host.md: throughput and TTFT/TPOT/E2E mean/p50/p99 errors, before
-> fitted -> measured, per run; OUT/terms.json: each term and how it was obtained.

Then the same for a profile calibrated on a DP run (the f4fe111 Llama-3.2-1B DP=2 run at 80 req/s): its scales
fitted with the replicas' extra host work folded in (what `testbed calibrate` did before the term existed,
remade here from the same samples) against calibrate's scales + term now, simulating all four f4fe111 runs
(OUT/calibrated/, the second table of OUT/dp_host.md).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's testbed
DP = ROOT / "benchmarks/results/dp"
PROFILES = ROOT / "testbed/profiling/profiles"
CAPACITY = DP / "2026-11-26_4952de6_h100x2_llama-3.2-1b_capacity/profile.json"
F4 = DP / "2026-11-26_f4fe111_h100x2_llama-3.2-1b"
# (group, earlier dp.py outputs, the profile their RESULTS rows used, the DP run the term is fitted on)
GROUPS = [
    ("llama-3.1-8b", [DP / "2026-11-26_7c9000d_h100x2_llama-3.1-8b"], PROFILES / "Llama-3.1-8B_H100-SXM_tp1.json",
     DP / "2026-11-26_7c9000d_h100x2_llama-3.1-8b/runs/real-2x1-rate8"),
    ("llama-3.2-1b", [F4], PROFILES / "Llama-3.2-1B_H100-SXM_tp1.json", F4 / "runs/real-2x1-rate80"),
    ("llama-3.2-1b_policies", [DP / f"2026-11-26_7c9000d_h100x2_llama-3.2-1b_policies/{p}"
                               for p in ("round_robin", "kv_aware")], CAPACITY,
     DP / "2026-11-26_7c9000d_h100x2_llama-3.2-1b_policies/round_robin/runs/real-2x1-rate160"),
    # calibrate cannot replay the prefix-caching runs (its replay diverges from them): the f4fe111 fit, same profile
    ("llama-3.2-1b_mooncake", [DP / f"2026-11-26_7c9000d_h100x2_llama-3.2-1b_mooncake/{p}"
                               for p in ("least_loaded", "prefix_affinity")], PROFILES / "Llama-3.2-1B_H100-SXM_tp1.json",
     F4 / "runs/real-2x1-rate80"),
]
COLS = [("output_throughput", None), *[(k, q) for k in ("ttft_s", "tpot_s", "e2e_s") for q in ("mean", "p50", "p99")]]


def run(cmd: list[str], timeout: float) -> None:
    out = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")


def err(r: dict, k: str, q: str | None) -> float | None:
    return r.get("errors", {}).get(f"{k} {q}" if q else k)


def folded_calibration(run_dir: Path, profile: Path, out: Path) -> None:
    """The profile calibrated on a DP run with the replicas' host work folded into the scales: the scales fitted to
    every step's measured time as it is, no DP term (what calibrate did before it fitted the term apart)."""
    from testbed.engine.config import EngineConfig
    from testbed.profiling.profile_file import write_profile
    from testbed.runs.rundir import read_run
    from testbed.sim.like import run_setup
    from testbed.sim.profiled import ProfiledCostModel
    from testbed.sim.rescale import calibrated_profile, error_report, fit_scales, samples_from_run
    run = read_run(run_dir)
    model, _, engine = run_setup(run)
    config = EngineConfig(**engine)
    cm = ProfiledCostModel.from_file(profile)
    samples = samples_from_run(run, model, config, cm)
    scales = fit_scales(samples, cm.scales)
    write_profile(out, calibrated_profile(cm.profile, scales, f"{run_dir} (DP work folded into the scales)",
                                          error_report(samples, cm.scales), error_report(samples, scales),
                                          config.data_parallel_size))


def table(lines: list[str], label: str, variants: list[list[dict]], terms: list[str]) -> None:
    """One row per run: each metric's error under each variant (its runs, in order), joined by arrows; `terms`:
    the DP term of each variant after the first, as the row shows it."""
    for runs in zip(*variants):
        cells = []
        for k, q in COLS:
            xs = [err(r, k, q) for r in runs]
            cells.append("-" if None in xs else " → ".join(f"{x:+.1%}" for x in xs))
        parity = {r.get("decision_parity", "?").split(":")[0] for r in runs}
        lines.append(f"| {label} | {runs[0]['layout']} | {runs[0]['rate']:g} | "
                     f"{' / '.join(terms) if runs[0]['dp'] > 1 else '-'} | " + " | ".join(cells)
                     + f" | {'/'.join(sorted(parity))} |")


def resimulate(earlier: Path, cost_model: Path, out: Path) -> list[dict]:
    run(["benchmarks/dp.py", "--resimulate", str(earlier), "--cost-model", str(cost_model), "--jobs", "1", "--out",
         str(out)], 1800)
    return json.loads((out / "dp_results.json").read_text())["runs"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--groups", nargs="*", default=None, help="only these groups")
    args = ap.parse_args()
    lines = ["| group | layout | rate | term | " + " | ".join(f"{k.removesuffix('_s')}{' ' + q if q else ''}"
                                                                for k, q in COLS) + " | parity |",
             "|---|---|---|---|" + "---|" * len(COLS) + "---|"]
    terms: dict = {}
    for group, earlier, profile, fit_on in GROUPS:
        if args.groups and group not in args.groups:
            continue
        g = args.out / group
        g.mkdir(parents=True, exist_ok=True)
        with_term = g / "profile_dp.json"
        run(["-m", "testbed.cli", "calibrate", str(fit_on), "--cost-model", str(profile), "--dp-replica-host-only",
             "-o", str(with_term)], 600)
        measured = g / "profile_measured.json"
        run(["-m", "testbed.cli", "profile", "--dp-replica-host", "--cost-model", str(profile), "--max-model-len",
             "4096", "-o", str(measured)], 600)
        prof, meas = json.loads(with_term.read_text()), json.loads(measured.read_text())["dp_replica_host"]
        term = prof["dp_replica_host"]["step_s"]
        terms[group] = {"profile": str(profile.relative_to(ROOT)), "fitted_on": str(fit_on.relative_to(ROOT)),
                        "dp_replica_host": prof["dp_replica_host"], "fit": prof["calibration"]["dp_replica_host"],
                        "measured": meas}
        shown = [f"{term * 1e3:.3f} ms", f"{meas['step_s'] * 1e3:.3f} ms + {meas['row_s'] * 1e6:.2f} us/row"]
        for e in earlier:
            table(lines, f"{group}{'/' + e.name if len(earlier) > 1 else ''}",
                  [resimulate(e, profile, g / "before" / e.name), resimulate(e, with_term, g / "after" / e.name),
                   resimulate(e, measured, g / "measured" / e.name)], shown)
        print(f"# {group}: term {term * 1e3:.3f} ms from {fit_on.relative_to(ROOT)}", file=sys.stderr, flush=True)
    if not args.groups or "calibrated" in args.groups:
        g = args.out / "calibrated"
        g.mkdir(parents=True, exist_ok=True)
        fit_on, base = F4 / "runs/real-2x1-rate80", PROFILES / "Llama-3.2-1B_H100-SXM_tp1.json"
        folded, separate = g / "profile_folded.json", g / "profile_dp.json"
        folded_calibration(fit_on, base, folded)
        run(["-m", "testbed.cli", "calibrate", str(fit_on), "--cost-model", str(base), "-o", str(separate)], 600)
        prof = {k: json.loads(p.read_text()) for k, p in (("folded", folded), ("separate", separate))}
        term = prof["separate"]["dp_replica_host"]["step_s"] * prof["separate"]["scales"]["host"]
        terms["calibrated"] = {k: {"scales": v["scales"], "dp_replica_host": v.get("dp_replica_host"),
                                   "error_before": v["calibration"]["error_before"],
                                   "error_after": v["calibration"]["error_after"]} for k, v in prof.items()}
        lines += ["", "scales folded: " + ", ".join(f"{k} {v:.3f}" for k, v in prof["folded"]["scales"].items())
                  + "; scales + term: " + ", ".join(f"{k} {v:.3f}" for k, v in prof["separate"]["scales"].items())
                  + f", term {term * 1e3:.3f} ms a step (host scale x step_s)", "", lines[0], lines[1]]
        table(lines, "calibrated on 2x1-rate80", [resimulate(F4, folded, g / "folded"),
                                                  resimulate(F4, separate, g / "separate")], [f"{term * 1e3:.3f} ms"])
    (args.out / "terms.json").write_text(json.dumps(terms, indent=1) + "\n")
    (args.out / "dp_host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
