"""A profile rescaled to another machine of its kind: per-component scales fitted to steps measured there.

`testbed calibrate RUN_DIR`: the run's own step timeline is replayed (`recorded:`, so every batch is the one the
run formed: decision parity; a data-parallel run's replicas each on their own timeline, every request routed as
the coordinator routed it, recorded_dp.py), the profile's terms of each step (step_terms.py) are paired with the time the step
took, and the scales of the host, GEMM, attention and decode components are fitted to those pairs. The result
is the profile with `scales` (used by ProfiledCostModel) and a `calibration` record of what was fitted, on what,
and the per-step error before and after.

The fit minimises the squared error of the steps' times (non-negative least squares), so the run's total time,
its throughput, is matched first and long steps weigh as much as the many short ones they outlast; it re-decides
which branch of each step's max (host- or device-bound) holds after every pass. A component that makes up less
than MIN_SHARE of the run's predicted time keeps its scale: the run says nothing about it.

One run rarely tells the components apart (host and decode time grow together from step to step), and scales
fitted to its noise transfer badly to other loads and to async scheduling. So the scales are then held towards
the one common scale that fits the run best, by a penalty SHRINK x (the fit's remaining error / the common
scale's) x the squared change in each component's time: where the separate scales explain little beyond the
common one they stay near it, and steps that a model with known scales made exactly (no error left) keep
them exactly.

A step's measured time is its cycle, schedule to next schedule (what the profile predicts), except before an idle
gap (the engine waited for arrivals): then its own recorded duration. The steps of all replicas of a data-parallel
run are fitted together. A DP replica's host work per step beyond a single engine's (publishing its outputs,
polling for inputs, its stats reports, in its own process) is fitted apart from the scales, from the time between
its steps (dp_host_fit.py): the calibrated profile carries it as `dp_replica_host`, which the simulator charges
DP replicas only, and the scales describe the machine, so the profile predicts a single engine too.
`--dp-replica-host-only` fits that term alone and keeps the profile's scales.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from pathlib import Path

import numpy as np

from testbed.sim.dp_host_fit import DPHostFit, fit_dp_admit, fit_dp_host, gap_samples, with_dp_term
from testbed.sim.profiled import dp_replica_host, fit_nonnegative
from testbed.sim.step_terms import COMPONENTS, DECODE_ASYNC, DECODE_SYNC, Scales, combine, design

MIN_SHARE = 0.01
SHRINK = 0.3  # chosen by calibration_study.py over nine folders of H100 and H200 runs (RESULTS, 2026-11-28): of
# 0.1 / 0.3 / 1 / 3 / 10, 0.3 held the most bounded metrics within target on the runs not fitted on (58%; 0.1 54%)
FAR = (0.5, 2.0)  # a scale outside this says more than 'another machine of the same kind'
PASSES = 6
POLISH_EVALS = 400
IDLE_GAP_S = 1e-3  # a cycle this much longer than the step itself held an idle wait


@dataclasses.dataclass
class StepSample:
    """One measured step: its kind and profile terms, and the seconds it took."""

    kind: int
    terms: tuple
    seconds: float
    rows: int = 0              # requests in the step
    gap: float | None = None   # update to next schedule, when the next step followed at once (a real run's record)
    admitted: int = 0          # requests the step schedules for the first time or resumes (its new_req_ids)
    admitted_next: int = 0     # those of the replica's next step (its intake falls in this step's gap)


def step_errors(samples: list[StepSample], scales: Scales) -> np.ndarray:
    """(predicted - measured) / measured of every step at these scales."""
    pred = np.array([combine(s.kind, s.terms, scales) for s in samples])
    meas = np.array([s.seconds for s in samples])
    return (pred - meas) / meas


def error_report(samples: list[StepSample], scales: Scales) -> dict:
    """Per-step error at these scales: mean absolute, median, the error of the steps' total time, and the first
    two for decode-only and mixed steps."""
    err = step_errors(samples, scales)
    meas = np.array([s.seconds for s in samples])
    out = {"steps": len(samples), "mape": float(np.mean(np.abs(err))), "median": float(np.median(err)),
           "total": float(((1 + err) * meas).sum() / meas.sum() - 1)}
    for name, kinds in (("decode", (DECODE_SYNC, DECODE_ASYNC)), ("mixed", None)):
        sel = np.array([(s.kind in kinds) if kinds else (s.kind not in (DECODE_SYNC, DECODE_ASYNC)) for s in samples])
        if sel.any():
            out[f"{name}_steps"] = int(sel.sum())
            out[f"{name}_mape"] = float(np.mean(np.abs(err[sel])))
            out[f"{name}_median"] = float(np.median(err[sel]))
    return out


def _sse(samples: list[StepSample], scales: Scales, meas: np.ndarray) -> float:
    pred = np.array([combine(s.kind, s.terms, scales) for s in samples])
    return float(((pred - meas) ** 2).sum())


def _design_matrix(samples: list[StepSample], scales: Scales) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(design matrix at `scales`, the scales as a vector, which components make up >= MIN_SHARE of the time)."""
    X = np.array([[r.get(c, 0.0) for c in COMPONENTS] for r in (design(s.kind, s.terms, scales) for s in samples)])
    cur = np.array([getattr(scales, c) for c in COMPONENTS])
    share = (X * cur).sum(axis=0) / max((X * cur).sum(), 1e-30)
    return X, cur, share >= MIN_SHARE


def _branch_nnls(samples: list[StepSample], start: Scales, meas: np.ndarray) -> Scales:
    """Non-negative least squares on the branch of every max that holds at the current scales, repeated until
    the branches settle (or PASSES); components under MIN_SHARE of the predicted time stay put."""
    scales = start
    for _ in range(PASSES):
        X, cur, free = _design_matrix(samples, scales)
        if not free.any():
            break
        y = meas - X[:, ~free] @ cur[~free]
        new = cur.copy()
        new[free] = [max(v, 1e-3) for v in fit_nonnegative(X[:, free].tolist(), y.tolist())]
        nxt = Scales(**dict(zip(COMPONENTS, new.tolist())))  # a component measured to cost nothing still costs
        if nxt == scales:
            break
        scales = nxt
    return scales


def _polish(objective, scales: Scales, free: list[str]) -> Scales:
    """Pattern search on `objective` (the exact, piecewise squared error, or it penalised): each free component
    up or down by a factor while that helps, the factor shrinking to 1e-5 (at most POLISH_EVALS evaluations).
    Branch-wise least squares can stop where a branch flips."""
    best, err = scales, objective(scales)
    step, evals = 0.25, 0
    while step > 1e-5 and evals < POLISH_EVALS:
        improved = False
        for c in free:
            for f in (1 + step, 1 / (1 + step)):
                trial = dataclasses.replace(best, **{c: max(getattr(best, c) * f, 1e-3)})
                e = objective(trial)
                evals += 1
                if e < err:
                    best, err, improved = trial, e, True
        if not improved:
            step /= 2
    return best


def fit_scales(samples: list[StepSample], base: Scales = Scales()) -> Scales:
    """The scales that minimise the squared error of the steps' times: branch-wise least squares from `base` and
    from every corner of [1/2, 2] (a step's max can hold a start on the wrong branch), the best polished on the
    exact error."""
    if not samples:
        raise ValueError("no measured steps to fit the scales to")
    meas = np.array([s.seconds for s in samples])
    if not (meas > 0).all():
        raise ValueError("every measured step must have a positive duration")
    starts = [base] + [Scales(*corner) for corner in itertools.product((0.5, 2.0), repeat=len(COMPONENTS))]
    fits = [base] + [_branch_nnls(samples, s, meas) for s in starts]  # never worse than where it started
    best = min(fits, key=lambda f: _sse(samples, f, meas))
    free = [c for c, f in zip(COMPONENTS, _design_matrix(samples, best)[2]) if f]  # the rest: the steps say little
    best = _polish(lambda s: _sse(samples, s, meas), best, free)
    return _shrunk(samples, best, base, meas, free)


def _shrunk(samples: list[StepSample], best: Scales, base: Scales, meas: np.ndarray, free: list[str]) -> Scales:
    """`best` held towards the common scale (see the module docstring): the free components of `base` times the
    one factor that fits the steps best. Never a larger error than `base`'s (then `best`, which has none larger)."""
    pred = np.array([combine(s.kind, s.terms, base) for s in samples])
    factor = float(pred @ meas / (pred @ pred))
    common = dataclasses.replace(base, **{c: getattr(base, c) * factor for c in free})
    err_best, err_common = _sse(samples, best, meas), _sse(samples, common, meas)
    if err_best <= 0.0 or err_common <= 0.0:
        return best
    X = _design_matrix(samples, best)[0]
    weight = dict(zip(COMPONENTS, SHRINK * err_best / err_common * (X ** 2).sum(axis=0)))

    def penalised(s: Scales) -> float:
        return _sse(samples, s, meas) + sum(weight[c] * (getattr(s, c) - getattr(common, c)) ** 2 for c in free)
    out = min((_polish(penalised, start, free) for start in (best, common)), key=penalised)
    return out if _sse(samples, out, meas) <= _sse(samples, base, meas) else best


class StepPairing:
    """The measured steps of a replay on a run's recorded timelines: `note(r, k, so)` pairs replica r's step k, the
    batch `so` the replay formed for it, with the profile's terms under `cost_model` (a ProfiledCostModel) and the
    time the step took, its cycle (schedule to the replica's next schedule; `starts`, `durations`: per replica, as
    steps.parquet records them) unless that held an idle wait (IDLE_GAP_S past its own duration)."""

    def __init__(self, cost_model, starts: list[list[float]], durations: list[list[float]]) -> None:
        from testbed.sim.cost_model import recorded_cycles
        self.cost_model, self.durations = cost_model, durations
        self.cycles = [recorded_cycles(s, d) for s, d in zip(starts, durations)]
        self.samples: list[StepSample] = []
        self._last: dict[int, StepSample] = {}  # each replica's latest sample, whose admitted_next this step gives

    def note(self, r: int, k: int, so) -> None:
        if so.requests:
            cycle, own = self.cycles[r][k], self.durations[r][k]
            kind, terms = self.cost_model.terms(so)
            back_to_back = cycle <= own + IDLE_GAP_S and k + 1 < len(self.cycles[r])
            sample = StepSample(kind, terms, cycle if cycle <= own + IDLE_GAP_S else own, len(so.requests),
                                cycle - own if back_to_back else None, len(so.new_req_ids))
            self.samples.append(sample)
            if r in self._last:
                self._last[r].admitted_next = sample.admitted
            self._last[r] = sample


def samples_from_run(run, model: str, config, cost_model, trace=None) -> list[StepSample]:
    """Replay a run (a read Run of `model` with engine `config`: one replica, or data-parallel replicas with the
    coordinator's record) from its recorded timelines and pair each step of every replica with its terms under
    `cost_model` (a ProfiledCostModel) and the time it took (StepPairing). `trace`: the requests it served (default:
    like.run_workload's, without a trace given)."""
    from testbed.sim.cluster import simulate
    from testbed.sim.cost_model import RecordedCostModel
    from testbed.sim.like import run_cache, run_workload
    from testbed.sim.recorded_dp import RecordedDPRun, simulate_recorded_dp
    from testbed.specs.presets import get_model_spec

    if config.async_scheduling:  # a step's recorded time is then the overlapped cycle, not the step's own work
        raise ValueError(f"{run.path}: an --async-scheduling run; calibration pairs each step with the time it took on "
                         "its own, which only a run without --async-scheduling records (its replay here is exact, "
                         "`testbed simulate --cost-model recorded:RUN`, but the fit takes sync runs): calibrate on a "
                         "sync run of the same machine")
    blocks, max_len = run_cache(run)
    config = dataclasses.replace(config, num_gpu_blocks=blocks, max_model_len=max_len)
    spec = get_model_spec(model)
    max_len = max_len or spec.max_position_embeddings
    cpu_blocks = run.manifest.get("num_cpu_blocks")
    if trace is None:
        trace, _ = run_workload(run, None, config.seed)
    if config.data_parallel_size > 1:  # every replica on its own timeline, routed as recorded
        rec = RecordedDPRun.from_run_dir(run.path)
        pairing = StepPairing(cost_model, rec.starts, rec.durations)
        simulate_recorded_dp(trace, config, rec, blocks, max_len, spec.vocab_size, cpu_blocks, on_step=pairing.note)
        return pairing.samples  # the replay ran every recorded step of every replica, or raised
    recorded = RecordedCostModel.from_run_dir(run.path)
    steps = run.steps(columns=["start", "duration"])
    pairing = StepPairing(cost_model, [steps["start"].tolist()], [steps["duration"].tolist()])

    class Paired:
        """The recorded time of each step (so the batches stay the run's), the step noted with the pairing."""
        first_start = recorded.first_start  # the replay's first step starts where the run's did, so its later ones do

        def step_time(self, so) -> float:
            k, seconds = recorded.step, recorded.step_time(so)  # raises when the replay outruns the record
            pairing.note(0, k, so)
            return seconds

    simulate(trace, config, Paired(), blocks, max_len, vocab_size=spec.vocab_size, num_cpu_blocks=cpu_blocks)
    if recorded.step != len(recorded.durations):
        raise ValueError(f"{run.path}: the replay used {recorded.step} of the run's {len(recorded.durations)} recorded "
                         "steps: its decisions diverged from the run's (was it made by another version?)")
    return pairing.samples


def rescaled_profile(profile: dict, scales: Scales, record: dict, before: dict, after: dict) -> dict:
    """A copy of `profile` carrying the fitted scales and the `calibration` record of the fit (`record` says how
    and on what it was fitted); the measured tables are left as they are."""
    out = copy.deepcopy(profile)
    out["scales"] = scales.to_dict()
    out["calibration"] = {**record, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          "base_scales": Scales.from_dict(profile.get("scales")).to_dict(),
                          "error_before": before, "error_after": after}
    return out


def calibrated_profile(profile: dict, scales: Scales, source: str, before: dict, after: dict,
                       data_parallel_size: int = 1, dp_host: DPHostFit | None = None, trace: str | None = None) -> dict:
    """A copy of `profile` carrying the scales fitted to the run at `source` (of `data_parallel_size` replicas),
    and the record of the fit; with `dp_host` (a DP run's fitted term, in the run's seconds) its
    `dp_replica_host` section too, in the profile's host seconds (the simulator charges host scale x step_s)."""
    record = {"method": "run", "fitted_on": source, "data_parallel_size": data_parallel_size}
    if trace is not None:  # the requests the replay served, where not the run directory's
        record["trace"] = trace
    if dp_host is not None:
        record["dp_replica_host"] = dp_host.to_dict()
    out = rescaled_profile(profile, scales, record, before, after)
    if dp_host is not None:
        out["dp_replica_host"] = {"step_s": dp_host.step_s / scales.host, "row_s": 0.0,
                                  "request_s": dp_host.request_s / scales.host, "method": "calibrate",
                                  "fitted_on": source}
    return out


def calibrate(run_dir: str | Path, cost_model: str = "auto", dp_host_only: bool = False,
              trace: str | Path | None = None) -> tuple[dict, dict, dict]:
    """(calibrated profile, per-step error before, after) of `cost_model` ('auto': the profile shipped for the
    run's model, GPU and TP; or a profile file) fitted to a run's recorded steps, replayed with the requests it
    served (`trace`: the trace it served; default as like.run_workload). A data-parallel run also gives
    the DP replica's host term (dp_host_fit.py), fitted apart from the scales; `dp_host_only`: that term alone,
    the profile's scales kept."""
    from testbed.engine.config import EngineConfig
    from testbed.runs.rundir import read_run
    from testbed.sim.like import run_setup, run_workload
    from testbed.sim.profiled import ProfiledCostModel
    from testbed.sim.factory import load_cost_model
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec

    run = read_run(run_dir)
    model, gpu, engine = run_setup(run)
    if model is None or gpu is None or not engine:
        raise ValueError(f"{run_dir}: the run records no model or GPU preset, or no engine flags; calibrate takes a "
                         "`testbed replay` run directory of a preset model on a preset GPU")
    config = EngineConfig(**engine)
    if cost_model in ("roofline",) or cost_model.startswith("recorded:"):
        raise ValueError(f"--cost-model {cost_model}: calibrate rescales a profile; give 'auto' or a profile file")
    dp = config.data_parallel_size
    if dp_host_only and dp == 1:
        raise ValueError(f"--dp-replica-host-only: {run_dir} is a single engine's run; the DP replica's host term is "
                         "fitted to a data-parallel run (`testbed replay -dp N`)")
    # a single engine's terms: a DP run's replica term is fitted on its own, from the gaps between steps
    cm, _ = load_cost_model(cost_model, get_model_spec(model), get_gpu_spec(gpu),
                            dataclasses.replace(config, data_parallel_size=1))
    if not isinstance(cm, ProfiledCostModel):
        raise ValueError(f"--cost-model {cost_model}: no profile ships for {model} on {gpu}; give a profile file "
                         "(`testbed profile` writes one)")
    requests, source = run_workload(run, trace, config.seed)
    samples = samples_from_run(run, model, config, cm, requests)
    if dp == 1:
        before = error_report(samples, cm.scales)
        scales = fit_scales(samples, cm.scales)
        after = error_report(samples, scales)
        return calibrated_profile(cm.profile, scales, str(run_dir), before, after, trace=source), before, after
    base = dp_replica_host(cm.profile, cm.name)
    before = error_report(with_dp_term(samples, *(base or (0.0, 0.0, 0.0))), cm.scales)  # as the profile simulates it
    fit = fit_dp_host(*gap_samples(samples))
    request_s = fit_dp_admit(samples)  # from the gaps, as step_s
    fit = dataclasses.replace(fit, request_s=request_s, requests=sum(s.admitted_next for s in samples))
    scales = cm.scales
    if not dp_host_only:  # the machine's scales from the steps less the DP replica's own work
        scales = fit_scales([dataclasses.replace(s, seconds=max(s.seconds - fit.step_s - request_s * s.admitted_next,
                                                                1e-6)) for s in samples], cm.scales)
    after = error_report(with_dp_term(samples, fit.step_s / scales.host, 0.0, request_s / scales.host), scales)
    return calibrated_profile(cm.profile, scales, str(run_dir), before, after, dp, fit, source), before, after


def cmd_calibrate(args) -> int:
    import sys
    from testbed.profiling.profile_file import write_profile
    profile, before, after = calibrate(args.run_dir, args.cost_model, args.dp_replica_host_only, args.trace)
    out = write_profile(args.output, profile)
    print_fit(profile["scales"], before, after)
    fit = profile["calibration"].get("dp_replica_host")
    if fit is not None:
        print(f"dp replica host: {fit['step_s'] * 1e3:.3f} ms a step (gap = {fit['update_scale']:.2f} x engine term "
              f"+ that, over {fit['steps']} back-to-back decode steps), {fit['request_s'] * 1e3:.3f} ms a request "
              f"taken in (over {fit['requests']} requests)")
    print(f"wrote {out} (use: testbed simulate TRACE --cost-model {out})", file=sys.stderr)
    return 0


def print_fit(scales: dict, before: dict, after: dict) -> None:
    """The fitted scales and the per-step error before and after, as calibrate and profile --quick print them."""
    print("scales: " + ", ".join(f"{k} {v:.3f}" for k, v in scales.items()))
    print(f"{'steps':<12}{'count':>7}{'MAPE before':>13}{'after':>8}{'median before':>15}{'after':>8}")
    for name, prefix in (("all", ""), ("decode-only", "decode_"), ("mixed", "mixed_")):
        if prefix + "mape" in before:
            print(f"{name:<12}{before.get(prefix + 'steps', before['steps']):>7}{before[prefix + 'mape']:>13.1%}"
                  f"{after[prefix + 'mape']:>8.1%}{before[prefix + 'median']:>+15.1%}{after[prefix + 'median']:>+8.1%}")
    print(f"total time of the steps: {before['total']:+.1%} before, {after['total']:+.1%} after")
    far = {k: v for k, v in scales.items() if not FAR[0] <= v <= FAR[1]}
    if far:
        import sys
        print("warning: " + ", ".join(f"{k} x{v:.3g}" for k, v in far.items()) + f" lies outside [{FAR[0]}, {FAR[1]}]: "
              "machines of one kind differ less; were the steps timed on a loaded machine, or is the profile for "
              "another kind of GPU? Re-measure on an idle machine, or make a full profile (`testbed profile`)",
              file=sys.stderr)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="rescale a profile to this machine from the steps a real run recorded")
    p.add_argument("run_dir", help="a `testbed replay` run directory (one replica or -dp N, without "
                   "--async-scheduling), of the layout the profile will simulate")
    p.add_argument("--cost-model", default="auto",
                   help="the profile to rescale: 'auto' (the one shipped for the run's model, GPU and TP) or a file")
    p.add_argument("--output", "-o", required=True, help="the calibrated profile JSON to write")
    p.add_argument("--trace", default=None,
                   help="the trace the run served, drawn as the run drew it (its --request-rate, --burstiness and "
                        "--limit); default: the one its manifest names, where that file is here, else the run "
                        "directory (which cannot give a prefix-caching run's prompts)")
    p.add_argument("--dp-replica-host-only", action="store_true",
                   help="with a data-parallel run: fit only the DP replica's host term per step (what its engine "
                        "process does between steps beyond a single engine) and keep the profile's scales")
    p.set_defaults(func=cmd_calibrate)
