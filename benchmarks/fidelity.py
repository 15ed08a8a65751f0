"""Simulator fidelity: real `testbed replay` runs on a GPU against `testbed simulate` on the same trace,
flags, arrivals (same seed) and KV-cache size.

  # on a GPU: build the model once, profile it (optional), replay every case, write the run directories
  python benchmarks/fidelity.py real --model Llama-3.2-1B --out DIR [--profile-out PROFILE] [--cases a,b] [-tp 2]
  # anywhere (CPU): simulate each real run with each cost model and print the error table
  python benchmarks/fidelity.py sim DIR [DIR ...] [--profile PROFILE] [--json OUT] [--markdown OUT]
  python benchmarks/fidelity.py --sim-only          # the same over the committed runs (benchmarks/results/fidelity)
  # runs made with `real --rounds N` (each loaded case N times, round after round): the real runs against each other
  python benchmarks/fidelity.py spread SIM_JSON [--label profile]

Cases: for each trace a burst (every request at once) measures the real saturation rate; the loaded cases
then replay Poisson arrivals at a fraction of it (light 0.3, near saturation 0.8, overload 1.3). Errors
are (sim - real) / real of throughput, TTFT/TPOT/E2E mean/p50/p99 and the mean batch. Per-step error: the
simulator replays the real run's own step timeline (decision parity, so its batches are the real ones)
while the cost model predicts each of those steps; MAPE against the real cycle (schedule to schedule). An async run
recorded with its steps' schedule times (from 3b145d3) replays call for call the same way; one recorded before
replays no timeline: its decode-only steps are rebuilt from its requests table and priced at their shape instead.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path("benchmarks/fidelity")  # relative to ROOT, as recorded in the manifests


@dataclass(frozen=True)
class Case:
    name: str
    trace: str
    limit: int
    load: float | None  # fraction of the family's saturation rate; None = burst (measures it)
    family: str
    flags: dict = field(default_factory=dict)


CASES = [  # in the order they run: what a cut-short run keeps comes first
    Case("azure-burst", "azure_conv_3000.jsonl", 800, None, "azure"),
    Case("azure-80", "azure_conv_3000.jsonl", 2000, 0.8, "azure"),
    Case("mooncake-burst", "mooncake_600.jsonl", 200, None, "mooncake", {"enable_prefix_caching": True}),
    Case("mooncake-80", "mooncake_600.jsonl", 300, 0.8, "mooncake", {"enable_prefix_caching": True}),
    Case("long-burst", "long_context_120.jsonl", 40, None, "long"),
    Case("long-80", "long_context_120.jsonl", 80, 0.8, "long"),
    Case("azure-light", "azure_conv_3000.jsonl", 600, 0.3, "azure"),
    Case("azure-over", "azure_conv_3000.jsonl", 2000, 1.3, "azure"),
    Case("azure-80-async", "azure_conv_3000.jsonl", 2000, 0.8, "azure", {"async_scheduling": True}),
]
METRICS = [("output_throughput", None), ("request_throughput", None),
           *[(m, q) for m in ("ttft_s", "tpot_s", "e2e_s") for q in ("mean", "p50", "p99")], ("mean_batch_size", None)]
TARGETS = {"output_throughput": 0.02, "request_throughput": 0.02, "mean": 0.05, "p50": 0.05, "p99": 0.10,
           "mean_batch_size": None, "step_mape": 0.05}


# ---- GPU side ---------------------------------------------------------------------------------------
def real(args: argparse.Namespace) -> None:
    from testbed.engine.config import EngineConfig
    from testbed.entrypoints.replay import run_replay
    from testbed.worker.executor import create_executor
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tarball = Path(args.tar) if args.tar else out.parent / f"{out.name}.tar.gz"
    base = EngineConfig(max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size)
    t0 = time.perf_counter()
    executor = create_executor(args.model, base, "dummy")
    print(f"[fidelity] executor ready in {time.perf_counter() - t0:.0f} s: {executor.num_gpu_blocks} blocks", flush=True)
    if args.profile_out:
        from testbed.profiling.sweep import profile_executor
        prof = profile_executor(executor, args.model, base, "dummy", quick=args.smoke, progress=not args.no_progress,
                                reps=args.reps)
        Path(args.profile_out).write_text(json.dumps(prof, indent=1) + "\n")
        print(f"[fidelity] profile in {prof['sweep_wall_s']:.0f} s -> {args.profile_out}", flush=True)
    if args.quick_base:
        quick_rescale_here(executor, base, args.quick_base, args.quick_out or str(out / "quick_profile.json"))
    names = [c.name for c in CASES] if args.cases in (None, "all") else [] if args.cases == "none" else args.cases.split(",")
    chosen = [c for c in CASES if c.name in names]
    # --rounds N: the loaded cases again, round after round in the same order (A B C A B C), each run its own folder
    # (`azure-80-r2`, ...): how far the real system lies from itself, the floor under any simulator's error
    runs = [(c, c.name) for c in chosen] + [(c, f"{c.name}-r{k}") for k in range(2, args.rounds + 1)
                                           for c in chosen if c.load is not None]
    sat: dict[str, float] = {}
    for case, folder in runs:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"[fidelity] budget of {args.budget_s:.0f} s spent: skipping {folder}", flush=True)
            continue
        if case.load is not None and case.family not in sat:
            print(f"[fidelity] {folder}: no saturation rate for {case.family} (run its burst case): skipped")
            continue
        rate = math.inf if case.load is None else case.load * sat[case.family]
        cfg = EngineConfig(**{**base.to_dict(), **case.flags})
        t = time.perf_counter()
        _, s = run_replay(str(TRACES / case.trace), cfg, model=args.model, load_format="dummy", request_rate=rate,
                          limit=min(case.limit, args.limit or case.limit), output=out / folder, executor=executor)
        if case.load is None:
            sat[case.family] = s["request_throughput"]
        print(f"[fidelity] {folder}: rate {rate:.2f}/s, {s['num_finished']} done ({s['num_rejected']} rejected) in "
              f"{time.perf_counter() - t:.0f} s, {s['request_throughput']:.2f} req/s, TTFT p50 {s['ttft_s']['p50']} s, "
              f"TPOT p50 {s['tpot_s']['p50']} s, batch {s['mean_batch_size']:.1f}", flush=True)
        if folder in (args.eager_cases or "").split(","):  # the same arrivals with every step eager: before/after
            executor.runner.eager_steps = True
            try:
                t = time.perf_counter()
                _, e = run_replay(str(TRACES / case.trace), cfg, model=args.model, load_format="dummy",
                                  request_rate=rate, limit=min(case.limit, args.limit or case.limit),
                                  output=out / f"{folder}-eager", executor=executor)
            finally:
                executor.runner.eager_steps = False
            manifest = out / f"{folder}-eager" / "manifest.json"
            m = json.loads(manifest.read_text())
            m["execution"] = {"cuda_graphs": False, "why": "every step eager (the runner's eager_steps), to compare "
                              f"with {folder} on the same executor"}
            manifest.write_text(json.dumps(m, indent=1) + "\n")
            print(f"[fidelity] {folder}-eager: {e['num_finished']} done in {time.perf_counter() - t:.0f} s, "
                  f"{e['request_throughput']:.2f} req/s, TTFT p50 {e['ttft_s']['p50']} s, TPOT p50 "
                  f"{e['tpot_s']['p50']} s", flush=True)
        with tarfile.open(tarball, "w:gz") as tar:  # after every case: a timeout keeps them
            tar.add(out, arcname=out.name)
    executor.shutdown()


def quick_rescale_here(executor, config, base_path: str, out_path: str) -> None:
    """`testbed profile --quick` on the executor already built: the base profile rescaled to this machine."""
    from testbed.profiling.profile_file import read_profile, write_profile
    from testbed.sim.quick_rescale import check_base, rescale_on
    base = read_profile(base_path)
    check_base(base, base_path, config)
    prof, before, after = rescale_on(executor, config, base, base_path)
    write_profile(out_path, prof)
    print(f"[fidelity] quick rescale of {base_path} in {prof['calibration']['machine']['measure_s']:.0f} s: scales "
          f"{prof['scales']}; anchor MAPE {before['mape']:.1%} -> {after['mape']:.1%} -> {out_path}", flush=True)


# ---- CPU side ---------------------------------------------------------------------------------------
IDLE_GAP_S = 2e-3  # a step whose next one started later than this after it ended was followed by idle time


class Paired:
    """Replays a real run's step timeline (so the simulator forms the real batches) while `model` predicts
    each step; keeps (real cycle, predicted, decode-only, back-to-back) per step. A step followed by idle
    time (no request left until the next arrival) has no cycle to compare: its next start waited for the
    arrival, so only back-to-back steps are compared."""

    def __init__(self, recorded, model, durations: list[float]) -> None:
        self.recorded, self.model, self.durations, self.pairs = recorded, model, durations, []
        self.first_start = recorded.first_start  # the replay's first step starts where the run's did
        self.async_timeline = recorded.async_timeline  # an async run's: each step scheduled and updated as recorded

    def step_time(self, so) -> float:
        k = self.recorded.step
        real = self.recorded.step_time(so)
        busy = real <= self.durations[k] + IDLE_GAP_S
        self.pairs.append((real, self.model.step_time(so), so.num_decode_tokens == len(so.requests), busy))
        return real


def _value(summary: dict, key: str, q: str | None) -> float | None:
    v = summary[key] if q is None else summary[key][q]
    return None if v is None else float(v)


def read_case(run_dir: Path) -> tuple:
    """A committed real run as it is replayed here: (run, its engine config with the run's KV size and length, its
    trace file's path, the manifest's trace record)."""
    from testbed.engine.config import EngineConfig
    from testbed.runs.rundir import read_run
    run = read_run(run_dir)
    m = run.manifest
    cfg = EngineConfig(**{**m["config"], "num_gpu_blocks": m["num_gpu_blocks"], "max_model_len": m["max_model_len"]})
    tr = m["trace"]
    trace_path = str(ROOT / tr["path"]) if not Path(tr["path"]).is_absolute() else tr["path"]
    return run, cfg, trace_path, tr


def case_trace(trace_path: str, tr: dict, cfg) -> list:
    """The run's requests as it replayed them (its rate, burstiness, seed and limit)."""
    from testbed.workload.trace import load_trace
    return load_trace(trace_path, request_rate=tr["request_rate"], burstiness=tr["burstiness"], seed=cfg.seed,
                      limit=tr["limit"], fmt=tr["format"])


def paired_steps(run_dir: Path, cfg, trace: list, model: str, gpu: str, spec: str, durations: list[float],
                 cls: type = Paired) -> Paired:
    """The run's own step timeline replayed (decision parity: the real batches) with cost model `spec` pricing each
    step: the `cls` (a Paired) that kept the pairs."""
    from testbed.sim.cluster import simulate
    from testbed.sim.cost_model import RecordedCostModel
    from testbed.sim.factory import load_cost_model
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec
    spec_m, gpu_m = get_model_spec(model), get_gpu_spec(gpu)
    paired = cls(RecordedCostModel.from_run_dir(run_dir), load_cost_model(spec, spec_m, gpu_m, cfg)[0], durations)
    simulate(trace, cfg, paired, cfg.num_gpu_blocks, cfg.max_model_len, spec_m.vocab_size)
    return paired


def decode_batches(steps, requests):
    """Each step's decode rows rebuilt from the requests table (an async run has no recorded timeline to replay): a
    request decodes in every step that ends after its first token and no later than its finish, its j-th decode row
    holding input + j tokens. (rows, sum of their contexts, the longest) per step, numpy arrays; requests that were
    preempted are left out, so a step that held one does not match its record (the caller keeps those that do)."""
    import numpy as np
    ends = (steps["start"] + steps["duration"]).to_numpy()
    rows, total, longest = (np.zeros(len(ends), dtype=np.int64) for _ in range(3))
    eps = 1e-9  # a request's first token and finish are stamped at the end of the step that made them
    for first, finish, tokens, preempted in zip(requests["first_token"], requests["finish"], requests["input_tokens"],
                                               requests["preemptions"]):
        if preempted or not np.isfinite(first):
            continue
        idx = np.arange(np.searchsorted(ends, first + eps, "left"), np.searchsorted(ends, finish + eps, "right"))
        ctx = tokens + np.arange(1, len(idx) + 1)
        rows[idx] += 1
        total[idx] += ctx
        np.maximum.at(longest, idx, ctx)
    return rows, total, longest


def async_decode_errors(run_dir: Path, cost_model) -> dict | None:
    """Per-step errors of an async run's decode-only steps, each priced by `cost_model` at its batch rebuilt from the
    requests table (decode_batches; only steps whose rebuilt rows and context equal their record, and not followed by
    idle time), against the step's recorded cycle. None if no step qualifies."""
    import numpy as np
    import pandas as pd

    from testbed.engine.outputs import SchedulerOutput
    steps = pd.read_parquet(run_dir / "steps.parquet").reset_index(drop=True)
    rows, total, longest = decode_batches(steps, pd.read_parquet(run_dir / "requests.parquet"))
    gap = steps["start"].shift(-1) - (steps["start"] + steps["duration"])  # the next step's start after this end
    keep = ((steps["num_prefill_tokens"] == 0) & (steps["num_reqs"] == rows) & (steps["num_decode_tokens"] == rows)
            & (steps["sum_context_tokens"] == total) & (rows > 0) & (gap.fillna(np.inf) <= IDLE_GAP_S)).to_numpy()
    if not keep.any():
        return None
    def priced(b: int, ctx: int, top: int) -> float:
        so = SchedulerOutput(requests=[None] * b, num_decode_tokens=b, total_num_scheduled_tokens=b)
        so.sum_context_tokens = so.sum_attn_pairs = ctx  # a step prices its rows by shape, not by request
        so.max_context_tokens = top
        return cost_model.step_time(so)
    real = steps["duration"].to_numpy()[keep]
    miss = np.abs(np.array([priced(int(b), int(c), int(t)) for b, c, t in zip(rows[keep], total[keep], longest[keep])])
                  - real)
    err = miss / real
    return {"all": float(err.mean()), "decode": float(err.mean()), "eager": None, "steps": int(keep.sum()),
            "idle_followed": None, "time_weighted": float(miss.sum() / real.sum()),
            "basis": "decode-only steps, batches rebuilt from the requests table (an async run recorded before its "
                     "steps' schedule times replays no timeline)"}


def sim_case(run_dir: Path, profile: str | None, gpu: str | None = None,
             cost_models: tuple[str, ...] = ("roofline", "profile")) -> dict:
    import numpy as np

    from testbed.sim.run import run_simulation
    run, cfg, trace_path, tr = read_case(run_dir)
    m = run.manifest
    model, gpu = m["model"]["name"], gpu or m["hardware"]["name"]
    kw = dict(model=model, gpu=gpu, request_rate=tr["request_rate"], burstiness=tr["burstiness"], limit=tr["limit"],
              trace_format=tr["format"], progress=False)
    models = {k: v for k, v in (("roofline", "roofline"), ("profile", profile or "auto")) if k in cost_models}
    result = {"case": run_dir.name, "real": run.summary, "sim": {}, "step_mape": {}, "config": m["config"],
              "hardware": m["hardware"]["name"], "model": model}
    for name, spec in models.items():
        result["sim"][name] = run_simulation(trace_path, cfg, cost_model=spec, **kw)[1]
    from testbed.sim.async_timeline import replayable
    if not replayable(run):
        # an async run recorded before its steps' schedule times (no replay): its decode-only steps, rebuilt
        from testbed.sim.factory import load_cost_model
        from testbed.specs.hardware import get_gpu_spec
        from testbed.specs.presets import get_model_spec
        for name, spec in models.items():
            cm = load_cost_model(spec, get_model_spec(model), get_gpu_spec(gpu), cfg)[0]
            errors = async_decode_errors(run_dir, cm)
            if errors is not None:
                result["step_mape"][name] = errors
    else:  # per-step errors on the real batches, the run's own timeline replayed (an async one call for call)
        trace = case_trace(trace_path, tr, cfg)
        durations = run.steps(columns=["duration"])["duration"].tolist()
        for name, spec in models.items():
            paired = paired_steps(run_dir, cfg, trace, model, gpu, spec, durations)
            real_t, pred_t, dec, busy = (np.array(x) for x in zip(*paired.pairs))
            real_t, pred_t, dec = real_t[busy], pred_t[busy], dec[busy]
            err = np.abs(pred_t - real_t) / real_t
            result["step_mape"][name] = {"all": float(err.mean()), "decode": float(err[dec].mean()) if dec.any() else None,
                                         "eager": float(err[~dec].mean()) if (~dec).any() else None,
                                         "steps": int(len(err)), "idle_followed": int((~busy).sum()),
                                         "time_weighted": float(np.abs(pred_t - real_t).sum()
                                                                                         / real_t.sum())}
    return result


def error_rows(res: dict) -> list[dict]:
    rows = []
    for key, q in METRICS:
        real = _value(res["real"], key, q)
        row = {"metric": key if q is None else f"{key} {q}", "real": real}
        for name, s in res["sim"].items():
            v = _value(s, key, q)
            row[name] = None if real in (None, 0) or v is None else (v - real) / real
        rows.append(row)
    return rows


def markdown(results: list[dict]) -> str:
    lines = []
    for res in results:
        c = res["config"]
        flags = ", ".join(k for k in ("async_scheduling", "enable_prefix_caching") if c.get(k)) or "sync"
        lines.append(f"\n#### {res['case']} ({res['model']}, {res['hardware']}, {flags}; "
                     f"{res['real']['num_finished']} requests, real {res['real']['request_throughput']:.2f} req/s)\n")
        names = list(res["sim"])
        lines.append("| metric | real | " + " | ".join(f"{n} error" for n in names) + " |")
        lines.append("|---|---|" + "---|" * len(names))
        for r in error_rows(res):
            real = "-" if r["real"] is None else f"{r['real']:.4g}"
            lines.append(f"| {r['metric']} | {real} | "
                         + " | ".join("-" if r[n] is None else f"{r[n]:+.1%}" for n in names) + " |")
        for n in names:
            sm = res["step_mape"].get(n)
            if sm:
                eager = "-" if sm["eager"] is None else f"{sm['eager']:.1%}"
                lines.append(f"| per-step MAPE ({n}) | {sm['steps']} steps | all {sm['all']:.1%}, decode "
                             f"{(sm['decode'] or 0):.1%}, eager {eager}, time-weighted "
                             f"{sm['time_weighted']:.1%}{'; ' + sm['basis'] if 'basis' in sm else ''} |"
                             + " |" * (len(names) - 1))
    return "\n".join(lines) + "\n"


def sim(args: argparse.Namespace) -> None:
    runs = sorted({p.parent for d in args.dirs for p in Path(d).rglob("manifest.json")})
    results = []
    for r in runs:
        t = time.perf_counter()
        results.append(sim_case(r, args.profile, args.gpu, tuple(args.cost_models.split(","))))
        print(f"[fidelity] simulated {r.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    text = markdown(results)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")


CROSS_COLUMNS = [("output_throughput", None), ("ttft_s", "mean"), ("ttft_s", "p50"), ("tpot_s", "mean"),
                 ("tpot_s", "p50"), ("e2e_s", "mean"), ("e2e_s", "p50")]


def within_target(errs: dict[str, float | None]) -> tuple[int, int]:
    """(bounded metrics within their target, bounded metrics) of one case's errors by metric (error_rows' names)."""
    held = total = 0
    for metric, e in errs.items():
        target = TARGETS.get(metric.split()[-1])
        if target is not None and e is not None:
            total += 1
            held += abs(e) <= target
    return held, total


def cross_rows(labelled: list[tuple[str, list[dict]]], exclude: dict[str, set[str]]) -> list[dict]:
    """One row per (model, case, cost model) of several `sim --json` outputs: the errors of CROSS_COLUMNS, the
    worst p99, the step MAPE, and how many bounded metrics hold their target. `exclude`: cases a label must not
    be judged on (the run a profile was calibrated on)."""
    rows = []
    for label, results in labelled:
        for res in results:
            if res["case"] in exclude.get(f"{res['model']}:{label}", set()):
                continue
            errs = {r["metric"]: r["profile"] for r in error_rows(res)}
            row = {"model": res["model"], "case": res["case"], "cost_model": label, "hardware": res["hardware"]}
            for key, q in CROSS_COLUMNS:
                row[key if q is None else f"{key} {q}"] = errs[key if q is None else f"{key} {q}"]
            p99 = [errs[f"{m} p99"] for m in ("ttft_s", "tpot_s", "e2e_s") if errs[f"{m} p99"] is not None]
            row["worst p99"] = max(p99, key=abs) if p99 else None
            row["step MAPE"] = (res["step_mape"].get("profile") or {}).get("all")
            row["within target"] = "{}/{}".format(*within_target(errs))
            rows.append(row)
    return rows


def cross(args: argparse.Namespace) -> None:
    """The cross-machine table: the same real runs simulated with several profiles (e.g. the shipped one, the
    one `profile --quick` rescaled on the run's machine, and one calibrated on another run of that machine)."""
    labelled, exclude = [], {}
    for item in args.sim:
        label, _, path = item.partition("=")
        labelled.append((label, json.loads(Path(path).read_text())))
    for item in args.exclude or []:
        key, _, cases = item.partition("=")
        exclude[key] = set(cases.split(","))
    rows = cross_rows(labelled, exclude)
    cols = [k if q is None else f"{k} {q}" for k, q in CROSS_COLUMNS] + ["worst p99", "step MAPE"]
    lines = ["| model | case | cost model | " + " | ".join(c.replace("_s", "").replace("output_", "")
                                                          for c in cols) + " | within target |",
             "|---|---|---|" + "---|" * (len(cols) + 1)]
    order = {label: i for i, (label, _) in enumerate(labelled)}
    for r in sorted(rows, key=lambda r: (r["model"], r["case"], order[r["cost_model"]])):
        cells = ["-" if r[c] is None else (f"{r[c]:.1%}" if c == "step MAPE" else f"{r[c]:+.1%}") for c in cols]
        lines.append(f"| {r['model']} | {r['case']} | {r['cost_model']} | " + " | ".join(cells)
                     + f" | {r['within target']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def base_case(name: str) -> str:
    """The case a run folder replays: `azure-80-r2` -> `azure-80` (fidelity.py real --rounds)."""
    head, _, k = name.rpartition("-r")
    return head if head and k.isdigit() else name


def spread_rows(results: list[dict], label: str) -> list[dict]:
    """Per (model, case) replayed in several rounds on one machine (a `sim --json` output over them): the real runs
    against each other (every later round's errors against the first, as if it were a simulation of it) and the
    cost model `label` against every round, each as bounded metrics within their target; and, per metric, whether
    the simulated value lies inside the rounds' range."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for res in results:
        groups.setdefault((res["model"], base_case(res["case"])), []).append(res)
    rows = []
    for (model, case), runs in sorted(groups.items()):
        if len(runs) < 2:
            continue
        runs.sort(key=lambda r: (r["case"] != case, r["case"]))  # the first round first
        first = runs[0]
        real_pairs = [within_target({r["metric"]: r["round"] for r in error_rows(
            {"real": first["real"], "sim": {"round": other["real"]}})}) for other in runs[1:]]
        sim_held = [within_target({r["metric"]: r[label] for r in error_rows(res)}) for res in runs]
        inside = total = 0
        for key, q in METRICS:
            if TARGETS.get(q or key) is None:
                continue
            reals = [_value(res["real"], key, q) for res in runs]
            simulated = _value(runs[0]["sim"][label], key, q)
            if None in reals or simulated is None:
                continue
            total += 1
            inside += min(reals) <= simulated <= max(reals)
        rows.append({"model": model, "case": case, "rounds": len(runs),
                     "real vs first round": ", ".join("{}/{}".format(*p) for p in real_pairs),
                     f"{label} vs each round": ", ".join("{}/{}".format(*h) for h in sim_held),
                     f"{label} inside the rounds' range": f"{inside}/{total}"})
    return rows


def spread(args: argparse.Namespace) -> None:
    """How far the real system lies from itself (fidelity.py real --rounds), beside a cost model's error."""
    rows = spread_rows(json.loads(Path(args.sim_json).read_text()), args.label)
    cols = list(rows[0]) if rows else []
    text = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


def bands(args: argparse.Namespace) -> None:
    """The error bands of every cost model the sim JSON covers, into the bands file the simulator reads."""
    from testbed.sim.error_bands import BANDS_FILE, bands_from_fidelity
    out = Path(args.out) if args.out else BANDS_FILE
    data = bands_from_fidelity(json.loads(Path(args.sim_json).read_text()), args.source)
    if args.merge and out.is_file():  # keep the bands of (cost model, model, GPU, TP) these runs do not cover
        old = json.loads(out.read_text())["bands"]
        data["bands"] = {**{k: v for k, v in old.items() if k not in data["bands"]}, **data["bands"]}
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(data['bands'])} bands to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("real")
    p.add_argument("--model", default="Llama-3.2-1B")
    p.add_argument("--out", required=True)
    p.add_argument("--profile-out", default=None)
    p.add_argument("--tar", default=None, help="tarball of the run directories, rewritten after every case "
                                               "(default: beside --out)")
    p.add_argument("--smoke", action="store_true", help="a tiny profile sweep (smoke test)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while profiling")
    p.add_argument("--reps", type=int, default=None, help="timed runs per profile point (default 5)")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs the model is split over (the "
                                                                            "TP=2 case: -tp 2 on 2 GPUs)")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip the remaining cases after this many seconds")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests per case (smoke tests)")
    p.add_argument("--quick-base", default=None, help="rescale this profile to the machine first (profile --quick)")
    p.add_argument("--quick-out", default=None, help="where the rescaled profile goes (default: OUT/quick_profile.json)")
    p.add_argument("--eager-cases", default=None, help="comma-separated cases to replay again with every step eager")
    p.add_argument("--rounds", type=int, default=1, help="replay the loaded cases this many times, round after round "
                                                         "(folders CASE-r2, ...): the real runs' spread")
    p.set_defaults(func=real)
    p = sub.add_parser("sim")
    p.add_argument("dirs", nargs="+", help="folders holding the real run directories")
    p.add_argument("--profile", default=None, help="profile JSON (default: the shipped one for the run's model/GPU)")
    p.add_argument("--gpu", default=None, help="GPU preset (default: the real run's device)")
    p.add_argument("--cost-models", default="roofline,profile", help="which to simulate each run with: roofline, "
                                                                      "profile or both (the default)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.set_defaults(func=sim)
    p = sub.add_parser("cross", help="one table of the same runs simulated with several profiles")
    p.add_argument("--sim", action="append", required=True, metavar="LABEL=JSON",
                   help="a `sim --json` output and the name of its cost model (repeat)")
    p.add_argument("--exclude", action="append", metavar="MODEL:LABEL=CASE,...",
                   help="cases a cost model is not judged on, e.g. the run it was calibrated on")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.set_defaults(func=cross)
    p = sub.add_parser("spread", help="the real runs of several rounds against each other, beside a cost model")
    p.add_argument("sim_json", help="the JSON `fidelity.py sim --json` wrote over runs made with `real --rounds`")
    p.add_argument("--label", default="profile", help="the cost model to judge beside them (profile, roofline)")
    p.add_argument("--markdown", default=None)
    p.set_defaults(func=spread)
    p = sub.add_parser("bands", help="write the error bands `testbed simulate` states from a `sim --json` output")
    p.add_argument("sim_json", help="the JSON `fidelity.py sim --json` wrote")
    p.add_argument("--source", required=True, help="what the real runs were, e.g. 'benchmarks/fidelity.py, real "
                                                   "runs of 2026-11-24 at 795c0af, 643d33b, 829b07c'")
    p.add_argument("--out", default=None, help="bands file (default: testbed/sim/error_bands.json)")
    p.add_argument("--merge", action="store_true", help="keep the file's bands that these runs do not cover")
    p.set_defaults(func=bands)
    argv = sys.argv[1:]
    if argv[:1] == ["--sim-only"]:  # the spelling: the CPU side only, on the committed runs by default
        argv = ["sim", *(argv[1:] or [str(ROOT / "benchmarks/results/fidelity")])]
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
