"""`testbed profile --quick`: a shipped profile rescaled to this machine from a few anchor steps measured here.

Machines of one kind differ on the GPU side and on the host side, so a shipped profile misses a new machine by
10-30% per step. A full sweep takes minutes; this measures a small anchor set on the real executor instead:
- decode-only steps: a few batches x two contexts per request (graphed: the decode component and the host);
- prefill chunks of 512, 2048 and 8192 tokens (or the longest one a step may carry), and one chunk after a
  long cached context (GEMM- and attention-bound);
- mixed steps drawn as a loaded server forms them (the profiler's own `random_step`);
- the EngineCore's schedule + update at two batch sizes and one admission (the host, without a model).
Each anchor is timed sync (repeated alone, as the profile's sweep times its points) and, where the executor
pipelines steps, as the async cycle. The base profile
predicts the same steps with the engine's term left out (the executor alone ran them), and rescale.fit_scales
fits the host / GEMM / attention / decode scales to the pairs. The result is the base profile with `scales`
and a `calibration` record listing every anchor: measured, predicted before and after, and how far it moved.

Invariant: the base profile's tables are not touched; only `scales` changes, so a rescaled profile loads and
predicts like any other, and rescaling it again starts from its scales. Each anchor's record keeps its rows (or
its batch / admitted tokens), so `refit_quick` fits the same measurements again on a CPU when the cost model's
terms change, with no GPU.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from testbed.engine.config import EngineConfig
from testbed.profiling.host_costs import engine_host_costs
from testbed.profiling.profile_file import base_profile, output_path
from testbed.profiling.step_measure import StepMeasurer
from testbed.profiling.synthetic_steps import Row, StepFactory, decode_rows
from testbed.sim.profiled import ProfiledCostModel
from testbed.sim.rescale import StepSample, error_report, fit_scales, rescaled_profile
from testbed.sim.step_terms import DECODE_SYNC, combine

DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 4096)
CHUNKS = (512, 2048, 8192)
LONG_CONTEXT = 8192  # the cached context of the one chunk that measures attention over a long prefix
NUM_MIXED = 4
REPS, WARMUP = 5, 2
HOST_STEPS_PER_REP = 6  # decode steps whose median is the engine's host time, per rep (30 at the default reps)


def anchor_steps(config: EngineConfig, max_model_len: int, capacity: int, graph_max: int,
                 seed: int = 0) -> list[tuple[str, list[Row]]]:
    """The anchor set for these engine limits: (name, rows) of every anchor that fits the cache and
    max_model_len. Shapes too large for these limits shrink to the largest that fit, so a small engine still
    measures each kind."""
    from testbed.profiling.sweep import random_step
    top_chunk = min(config.max_num_batched_tokens, max_model_len - 1)
    contexts = sorted({c for c in DECODE_CONTEXTS if c < max_model_len} or {max(1, max_model_len // 4)})
    batches = sorted({min(b, config.max_num_seqs, graph_max) for b in DECODE_BATCHES})
    chunks = sorted({min(n, top_chunk) for n in CHUNKS})
    long_ctx = min(LONG_CONTEXT, max_model_len - chunks[0] - 1)
    out: list[tuple[str, list[Row]]] = []
    out += [(f"decode b={b} ctx={c}", decode_rows(b, c)) for b in batches for c in contexts]
    out += [(f"chunk {n}", [(0, n, False)]) for n in chunks]
    if long_ctx > 0:
        out.append((f"chunk {chunks[0]} after {long_ctx}", [(long_ctx, chunks[0], False)]))
    rng = np.random.default_rng(seed)
    out += [(f"mixed {i}", random_step(rng, config, max_model_len, capacity)) for i in range(NUM_MIXED)]
    return [(name, rows) for name, rows in out
            if sum(c + n for c, n, _ in rows) <= capacity and max(c + n for c, n, _ in rows) <= max_model_len]


def _rows_summary(rows: list[Row]) -> dict:
    decodes = [c for c, _, d in rows if d]
    chunks = [(c, n) for c, n, d in rows if not d]
    return {"decodes": len(decodes), "mean_context": float(np.mean(decodes)) if decodes else 0.0,
            "chunks": [list(ch) for ch in chunks]}


def measure_anchors(executor, config: EngineConfig, base: dict, reps: int = REPS, warmup: int = WARMUP,
                    interleaved: bool = False) -> tuple[list[StepSample], list[dict]]:
    """Time every anchor on `executor` and pair it with the `base` profile's terms of the same step: the
    samples to fit, and one record per measurement (name, mode, rows, measured seconds; a sync one also its
    StepTiming medians, `timing`: which part of the step, host or device, moved on this machine).
    `interleaved`: the sync anchors timed in turn (StepMeasurer.sync_each) instead of each repeated alone, as the
    profile's sweep times its points. Alone is what `--quick` runs: timed in turn on one H200 they moved as much
    between rounds (host 1.09 / 1.21 against 1.09 / 1.10 alone) and a step after a different one took up to 0.2 ms
    more on the device (benchmarks/quick_anchors.py, RESULTS)."""
    cms = _cost_models(base)
    capacity = executor.num_gpu_blocks * config.block_size
    max_model_len = executor.max_model_len
    f = StepFactory(executor.num_gpu_blocks, config.block_size, executor.vocab_size, config.seed)
    m = StepMeasurer(executor, reps, warmup)
    samples: list[StepSample] = []
    records: list[dict] = []
    try:
        anchors = [(name, rows, f.step(rows)) for name, rows in anchor_steps(config, max_model_len, capacity,
                                                                             cms["sync"].graph_max)]
        timings = m.sync_each([so for _, _, so in anchors]) if interleaved else None
        for i, (name, rows, so) in enumerate(anchors):
            parts = timings[i] if timings is not None else m.sync(so)  # alone: each anchor's sync, then its async
            timed = {"sync": parts["wall_s"]}
            if m.can_async and (cms["async"].dec_async is not None or any(not d for _, _, d in rows)):
                timed["async"] = m.async_cycle(so, base.get("async_timing", "burst"))  # as its base timed them
            for mode, seconds in timed.items():
                samples.append(_step_sample(cms[mode], so, seconds))
                records.append({"anchor": name, "mode": mode, **_rows_summary(rows), "measured_s": seconds,
                                "rows": [[c, n, int(d)] for c, n, d in rows],
                                **({"timing": {k: round(v, 9) for k, v in parts.items()}} if mode == "sync" else {})})
    finally:
        executor.runner.record_timing = False
    # the EngineCore's own host work, the same scheduler a serving step runs, timed as the base profile timed it
    sync = cms["sync"]
    batches = sorted({1, min(64, config.max_num_seqs)})
    admit = min(2048, config.max_num_batched_tokens, max_model_len - 1)
    method = base["engine_host"].get("method", "isolated")
    host = engine_host_costs(config, max_model_len, batches, [admit], None if method == "isolated" else executor,
                             decode_steps=HOST_STEPS_PER_REP * reps, method=method)
    for b, seconds in zip(host["decode_batch"], host["decode_step_s"]):
        what = "cycle outside the runner" if method == "cycle" else "schedule+update"
        records.append({"anchor": f"engine {what} b={b}", "mode": "host", "measured_s": seconds, "batch": b})
        samples.append(_host_sample(sync, records[-1]))
    records.append({"anchor": f"engine admission of {admit} tokens", "mode": "host",
                    "measured_s": host["admit_step_s"]["plain"][0], "admit_tokens": admit})
    samples.append(_host_sample(sync, records[-1]))
    return samples, records


def _cost_models(base: dict) -> dict[str, ProfiledCostModel]:
    """The base profile's cost model for sync steps and for async cycles (anchors are timed both ways)."""
    return {mode: ProfiledCostModel(base, async_scheduling=(mode == "async")) for mode in ("sync", "async")}


def _step_sample(cm: ProfiledCostModel, so, seconds: float) -> StepSample:
    """An anchor step's measurement paired with `cm`'s terms of it (the executor alone ran it: no EngineCore term)."""
    kind, terms = cm.terms(so, engine=0.0)
    return StepSample(kind, terms, seconds)


def _host_sample(sync: ProfiledCostModel, record: dict) -> StepSample:
    """An EngineCore host anchor (a decode batch's cycle, or an admission) paired with the profile's engine term."""
    eng = sync.engine_step(record["batch"]) if "batch" in record else sync._engine(1, record["admit_tokens"])
    return StepSample(DECODE_SYNC, (eng, 0.0, 0.0, 0.0, 0.0), record["measured_s"])


def refit_quick(quick: dict, name: str = "quick profile") -> tuple[dict, dict, dict]:
    """A `profile --quick` result fitted again from its recorded anchors under this code's cost model (no GPU):
    (profile, error before, error after), as rescale_to_machine gives them. The measurements and the machine
    record are kept; only the terms they are paired with are computed again. ValueError for a profile that is not
    a quick rescale, or whose anchors predate recorded rows."""
    cal = quick.get("calibration") or {}
    anchors = cal.get("anchors") or []
    if cal.get("method") != "quick" or not anchors:
        raise ValueError(f"{name}: not a `testbed profile --quick` result (no calibration record of method 'quick')")
    if any("rows" not in a and "batch" not in a and "admit_tokens" not in a for a in anchors):
        raise ValueError(f"{name}: its anchors record no rows (made before they were kept), so they cannot be fitted "
                         "again; run `testbed profile --quick` on that machine once more")
    base = {k: v for k, v in quick.items() if k != "calibration"}
    base["scales"] = cal.get("base_scales") or {}
    cms = _cost_models(base)
    engine = base["engine"]
    f = StepFactory(1 << 20, int(engine["block_size"]), int(quick["model"].get("vocab_size") or 32000))
    samples, records = [], []
    for a in anchors:
        record = {k: v for k, v in a.items() if k not in FIT_FIELDS}  # what was measured; the fit's fields again below
        if "rows" in a:
            samples.append(_step_sample(cms[a["mode"]], f.step([(c, n, bool(d)) for c, n, d in a["rows"]]),
                                        a["measured_s"]))
        else:
            samples.append(_host_sample(cms["sync"], a))
        records.append(record)
    return rescale_to_machine(base, cal.get("base_profile", name), samples, records, cal.get("machine", {}))


FIT_FIELDS = ("predicted_before_s", "predicted_after_s", "moved")  # what rescale_to_machine adds to each anchor


def rescale_to_machine(base: dict, base_name: str, samples: list[StepSample], records: list[dict],
                       machine: dict) -> tuple[dict, dict, dict]:
    """(rescaled profile, error before, error after): the scales fitted to the anchors, and each anchor's
    prediction before and after with how far the machine moved it (measured / predicted - 1)."""
    before_scales = ProfiledCostModel(base).scales
    scales = fit_scales(samples, before_scales)
    before, after = error_report(samples, before_scales), error_report(samples, scales)
    anchors = []
    for s, r in zip(samples, records):
        pred, now = combine(s.kind, s.terms, before_scales), combine(s.kind, s.terms, scales)
        anchors.append({**r, **dict(zip(FIT_FIELDS, (pred, now, s.seconds / pred - 1)))})
    record = {"method": "quick", "fitted_on": f"{len(samples)} anchor steps measured on {machine.get('device_name')}",
              "base_profile": base_name, "machine": machine, "anchors": anchors}
    return rescaled_profile(base, scales, record, before, after), before, after


def quick_profile(model: str, config: EngineConfig, base: dict, base_name: str, load_format: str = "auto",
                  dtype: str = "auto", device: str | None = None, enforce_eager: bool = False,
                  reps: int | None = None) -> tuple[dict, dict, dict]:
    """Build the executor a serving run would use, measure the anchors on it and rescale `base` (a profile of
    the same model, TP and block size made on another machine of this kind)."""
    from testbed.worker.executor import create_executor
    check_base(base, base_name, config)
    t0 = time.perf_counter()
    executor = create_executor(model, config, load_format, dtype, device, enforce_eager)
    try:
        return rescale_on(executor, config, base, base_name, reps or REPS, setup_s=time.perf_counter() - t0)
    finally:
        executor.shutdown()


def rescale_on(executor, config: EngineConfig, base: dict, base_name: str, reps: int = REPS,
               setup_s: float = 0.0) -> tuple[dict, dict, dict]:
    """`base` (check_base passed: checked before the executor was built) rescaled from the anchors measured on an
    executor built for `config` (`setup_s`: how long building it took, recorded beside the measuring time)."""
    from testbed.profiling.sweep import device_name, profile_gpu
    from testbed.runs.rundir import environment_info
    t0 = time.perf_counter()
    samples, records = measure_anchors(executor, config, base, reps)
    env = environment_info()
    machine = {"device_name": device_name(executor.runner.device), "gpu": profile_gpu(executor.runner.device),
               "host": env.get("host"), "git_sha": env.get("git_sha"), "setup_s": round(setup_s, 2),
               "measure_s": round(time.perf_counter() - t0, 2), "sync_anchors": "alone"}
    return rescale_to_machine(base, base_name, samples, records, machine)


def check_base(base: dict, base_name: str, config: EngineConfig) -> None:
    """Refuse a base profile whose steps are not this engine's (another TP or block size)."""
    tp, bs = int(base["tensor_parallel_size"]), int(base["engine"]["block_size"])
    if tp != config.tensor_parallel_size:
        raise ValueError(f"{base_name}: a profile at TP={tp}; this engine runs -tp {config.tensor_parallel_size}: "
                         "give --cost-model a profile of the same TP")
    if bs != config.block_size:
        raise ValueError(f"{base_name}: a profile with --block-size {bs}; this engine runs --block-size "
                         f"{config.block_size}: pass --block-size {bs} or another profile")


def quick_rescale(args, config: EngineConfig, model: str | None, out: Path, many: bool) -> tuple[dict, Path]:
    """`profile --quick`: the base profile (--cost-model: 'auto' is the one shipped for this model, this GPU and
    TP) rescaled from anchor steps measured on this machine; prints how far the anchors moved. Returns the
    profile and the path to write it to."""
    from testbed.profiling.sweep import profile_gpu
    from testbed.sim.rescale import print_fit
    name = Path(model).name if model and args.load_format != "dummy" else (model or "SmolLM2-135M-Instruct")
    gpu = None
    if args.cost_model == "auto":
        import torch
        gpu = profile_gpu(torch.device(args.device) if args.device
                          else torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    base, base_path = base_profile(args.cost_model, name, gpu, config.tensor_parallel_size)
    ProfiledCostModel(base, name=base_path)  # a malformed or attention-less profile is refused here
    if base["model"]["name"] != name:
        raise ValueError(f"--cost-model {base_path}: a profile of {base['model']['name']}, not of {name}")
    prof, before, after = quick_profile(model, config, base, base_path, args.load_format, args.dtype, args.device,
                                        args.enforce_eager, args.reps)
    machine = prof["calibration"]["machine"]
    print(f"rescaled {base_path} to {machine['device_name']} from {len(prof['calibration']['anchors'])} anchor "
          f"measurements in {machine['setup_s'] + machine['measure_s']:.0f} s (engine start {machine['setup_s']:.0f} s)")
    for a in prof["calibration"]["anchors"]:
        print(f"  {a['anchor']:<34}{a['mode']:>6}  measured {a['measured_s'] * 1e3:9.3f} ms  moved {a['moved']:+7.1%}")
    print_fit(prof["scales"], before, after)
    return prof, output_path(out, many, name, machine["gpu"], config.tensor_parallel_size)
