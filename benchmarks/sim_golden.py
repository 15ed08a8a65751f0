"""Golden outputs of `testbed simulate`: save them on one commit, check another against them.

Speed work on the simulator must not change a single decision or record. This runs a fixed set of
simulations -- every replayable committed real run under benchmarks/results replayed with `--cost-model
recorded:RUN --like RUN` (decision parity; each batch held to the run's), plus synthetic cases covering the profiled and roofline
models, async scheduling, data parallelism with every routing policy, prefix caching, preemption,
the priority policy and whole-prompt prefill -- and keeps, per case, the summary.json text and a
digest of the content of steps.parquet and requests.parquet (and of the DP tables when written).

Usage:  python benchmarks/sim_golden.py save DIR     (on the reference commit)
        python benchmarks/sim_golden.py check DIR    (exit 1 and name the cases that differ)
The current reference is benchmarks/results/2026-11-28_d008799/golden.json: `check benchmarks/results/2026-11-28_d008799`
compares the working tree with it. It was saved once the roofline's constants were re-fitted to the shipped profiles
after two H200 ones were re-made (edd2194): against 2026-11-28_bd7f55d every case was identical but azure10-roofline,
as it must be, and 38 recorded runs committed since bd7f55d are in it for the first time. The one before it (bd7f55d)
was saved once the H200 profiles were re-made on the graphed engine, the
roofline's constants re-fitted to the shipped profiles and a step with a prefill chunk priced at the CUDA graph it
is padded to (3973e0d, 5e24bd9): against 2026-11-27_fac4a06, every recorded replay (124 cases) was identical and
the 15 synthetic cases priced by a profile or the roofline differed, as they must; 31 recorded runs committed
since fac4a06 are in it for the first time. The one before it (fac4a06) was saved once request rows were kept in the order their requests ended
(fac4a06): against the one before it (2026-11-26_cd734f8), 13 cases' requests.parquet held the same rows in another
order (a rejection inside a fast-forwarded stretch's last step now goes before that step's finishes, as stepping
records it) and every other table and summary was identical, but for mooncake-dp4-kv_aware, whose tables had
differed from cd734f8's entry in the environment of this save before that change too (not traced).
cd734f8's was saved once recorded replays started their first step where the run did and held every batch to the
recorded one (6d0f95b, 08210de). Earlier references: 2026-11-26_cd734f8, c6b5e19, ab984d9, fd719fe, b94ceec and
6f3747a (the simulator-speed work's start).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import random
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from testbed.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACES = ROOT / "traces"
SIM = ["--no-progress", "--format", "json"]
RECORD_FILES = ("steps.parquet", "requests.parquet", "routes.parquet", "publications.parquet")


def replayable_runs() -> list[Path]:
    """Committed real runs that `recorded:` can replay: not async-scheduled (their steps overlap), and not `bench
    serve` runs (they record when the client sent each request, not when the engine took it)."""
    runs = []
    for m in sorted(RESULTS.rglob("manifest.json")):
        manifest = json.loads(m.read_text())
        if (manifest.get("mode") == "real" and not (manifest.get("config") or {}).get("async_scheduling")
                and "server" not in manifest):
            runs.append(m.parent)
    return runs


def served(run: Path) -> list[str]:
    """The trace arguments of a replay of `run`: the run directory (none), unless it cannot give the workload (a
    prefix-caching run's prompts; the queue order of requests that arrived together at one engine, in runs recorded
    before the engine's `seq`): then the trace file its manifest names, drawn as the run drew it."""
    manifest = json.loads((run / "manifest.json").read_text())
    tr, path = manifest.get("trace") or {}, (manifest.get("trace") or {}).get("path")
    config = manifest.get("config") or {}
    lossy = config.get("enable_prefix_caching") or (  # a DP replay queues by the coordinator's record
        config.get("data_parallel_size", 1) == 1 and "seq" not in pq.read_schema(run / "requests.parquet").names)
    if not lossy or not path or not (ROOT / path).is_file():
        return []  # `--like RUN` with no trace: the run directory is the trace
    flags = [str(ROOT / path)]
    for key, flag in (("request_rate", "--request-rate"), ("burstiness", "--burstiness"), ("limit", "--limit")):
        if tr.get(key) is not None:
            flags += [flag, str(tr[key])]
    return flags


def priority_trace(path: Path) -> Path:
    """300 requests with priorities, bursty arrivals and mixed lengths (seeded: the same file every time)."""
    rng = random.Random(31)
    t = 0.0
    with path.open("w") as f:
        for i in range(300):
            t += rng.expovariate(40.0)
            f.write(json.dumps({"id": f"p{i}", "arrival_s": round(t, 6), "input_tokens": rng.randint(1, 3000),
                                "output_tokens": rng.randint(1, 400), "priority": rng.randint(0, 3)}) + "\n")
    return path


def cases(tmp: Path) -> dict[str, list[str]]:
    """name -> `testbed simulate` arguments (without -o)."""
    azure, moon = str(TRACES / "azure_conv_10min.jsonl"), str(TRACES / "mooncake_synthetic_tail500.jsonl")
    prio = str(priority_trace(tmp / "priority.jsonl"))
    out = {f"recorded:{run.relative_to(RESULTS)}": [*served(run), "--like", str(run), "--cost-model",
                                                    f"recorded:{run}"] for run in replayable_runs()}
    out |= {
        "azure10-profiled": [azure],
        "azure10-roofline": [azure, "--cost-model", "roofline"],
        "azure10-async": [azure, "--async-scheduling"],
        "azure10-tiny-cache": [azure, "--num-gpu-blocks", "300", "--limit", "600"],
        "azure10-no-chunked": [azure, "--no-enable-chunked-prefill", "--limit", "500", "--max-num-seqs", "32"],
        "azure10-1b-rate": [azure, "--model", "Llama-3.2-1B", "--request-rate", "30", "--limit", "800"],
        "priority-tiny": [prio, "--policy", "priority", "--num-gpu-blocks", "400", "--max-num-batched-tokens", "2048"],
        "priority-async": [prio, "--policy", "priority", "--async-scheduling", "--num-gpu-blocks", "500"],
        "mooncake-prefix": [moon, "--enable-prefix-caching", "--model", "Llama-3.2-1B"],
    }
    for policy in ("round_robin", "least_loaded", "kv_aware", "prefix_affinity"):
        out[f"mooncake-dp4-{policy}"] = [moon, "--enable-prefix-caching", "--model", "Llama-3.2-1B", "-dp", "4",
                                         "--dp-policy", policy, "--request-rate", "20"]
    out["azure10-dp3-interval"] = [azure, "-dp", "3", "--dp-stats-interval", "0.05", "--limit", "1500"]
    out["azure10-dp2-async"] = [azure, "-dp", "2", "--async-scheduling", "--limit", "1500"]
    return out


# Added after the references were saved: left out of the digests and summaries, so the references stay valid. The
# block moves are 0 in every case they hold (a change in them shows in the columns and keys they derive from);
# `scheduled` (async runs: each step's schedule time) is new in the records, its values held by
# tests/test_async_parity.py (a replay from it reproduces every step and request).
LATER_COLUMNS = ("num_swapped", "num_swapped_out", "blocks_swapped_out", "blocks_swapped_in", "blocks_copied",
                 "scheduled")
LATER_SUMMARY_KEYS = ("num_swap_preemptions", "num_blocks_swapped_out", "num_blocks_swapped_in", "num_blocks_copied")


def table_digest(path: Path) -> str:
    """sha256 of a parquet file's schema and values (not its bytes: those carry the writer's version)."""
    t = pq.read_table(path)
    t = t.drop_columns([c for c in LATER_COLUMNS if c in t.column_names])
    h = hashlib.sha256(str(t.schema).encode())
    for name in t.column_names:
        h.update(name.encode())
        h.update(repr(t.column(name).to_pylist()).encode())
    return h.hexdigest()


def run_case(args: list[str], out: Path) -> dict:
    """summary.json text (or the error printed) and record digests of one simulation."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli_main(["simulate", *args, "-o", str(out), *SIM])
    if rc != 0:
        return {"rc": rc, "error": [line.replace(str(ROOT), "<repo>") for line in stderr.getvalue().strip().splitlines()[-1:]]}
    data = json.loads((out / "summary.json").read_text())
    data.pop("expected_error", None)  # a statement about the cost model (error_bands.py), not the simulation's outcome
    for key in LATER_SUMMARY_KEYS:
        data.pop(key, None)
    summary = (json.dumps(data, indent=2, sort_keys=True) + "\n").replace(str(ROOT), "<repo>")  # wherever the checkout is
    return {"rc": 0, "summary": summary,
            **{f: table_digest(out / f) for f in RECORD_FILES if (out / f).exists()}}


def collect(only: str | None) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {}
        for i, (name, args) in enumerate(cases(tmp).items()):
            if only and only not in name:
                continue
            results[name] = run_case(args, tmp / f"run{i}")
            print(f"{name}: rc {results[name]['rc']}", file=sys.stderr, flush=True)
        return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("save", "check"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--only", default=None, help="cases whose name contains this text")
    a = ap.parse_args()
    results = collect(a.only)
    golden = a.dir / "golden.json"
    if a.action == "save":
        a.dir.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"saved {len(results)} cases to {golden}")
        return 0
    want = json.loads(golden.read_text())
    new = [name for name in results if name not in want]  # run directories committed after the reference
    for name in new:
        print(f"NEW {name}: no reference (committed after it); not compared")
    compared = {name: got for name, got in results.items() if name in want}
    bad = [name for name, got in compared.items() if want[name] != got]
    for name in bad:
        diff = [k for k in sorted(set(want[name]) | set(compared[name])) if want[name].get(k) != compared[name].get(k)]
        print(f"DIFFERS {name}: {', '.join(diff)}")
    print(f"{len(compared) - len(bad)}/{len(compared)} cases identical, {len(new)} new")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
