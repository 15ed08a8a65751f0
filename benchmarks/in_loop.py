"""A step's host and device time inside a loaded real run against the same step timed the way `testbed profile`
times it (alone, repeated), on one GPU: which side of a step a profile misses in a loaded run.

  # on a GPU: replay the Azure burst and azure-80 (benchmarks/fidelity.py's cases) with every step's StepTiming
  # recorded, then re-run a window of azure-80's steps as synthetic steps on the same executor
  python benchmarks/in_loop.py real --model Llama-3.2-1B --out DIR [--limit 2000] [--window 400] [--isolated 240]
  # anywhere: the table, and a profile's prediction of each part (the shipped one by default)
  python benchmarks/in_loop.py analyze DIR/in_loop_MODEL.json.gz [--profile PROFILE]  (default: the shipped one for
                                                                                   the GPU the replays ran on)

For each step of the two replays the runner's StepTiming (worker/timing.py: host prepare, launch, output; device
forward and LM head + sampler from CUDA events) and the step's cycle (its start to the next step's start, as
`testbed calibrate` pairs them) are kept with the step's rows (cached tokens, new tokens, decode or not). Then the
middle 2 x --window steps of azure-80 are rebuilt as synthetic steps (profiling/synthetic_steps.py, blocks scattered
as a long-running engine hands them out) and re-run in their order, each once, twice over ("sequential"), and
--isolated of them are timed as the profiler times a step (StepMeasurer.sync: a warm-up, then the median of 5).
`analyze` gives, per step kind (decode-only or with a prefill chunk), the medians of in-loop / isolated and
sequential / isolated for each part, and a profile's prediction against the in-loop parts: the whole cycle, the
engine's share (the cycle less the runner's wall) and the runner's share, and its runner share against the steps
timed alone (the profile's own model of those shapes, with no loop involved).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import TRACES  # noqa: E402
from gpu_clocks import log_gpu_clocks  # noqa: E402

PARTS = ("prepare_s", "launch_s", "output_s", "forward_s", "sample_s", "wall_s")


def _rows(so) -> list[tuple[int, int, bool]]:
    """(cached tokens, new tokens, decode) of each row of a step, as StepFactory.step takes them."""
    out = []
    for i, r in enumerate(so.requests):
        c, n = int(so.num_computed_before[i]), int(so.num_new_tokens[i])
        out.append((c, n, n == 1 and c >= r.num_prompt_tokens))
    return out


def _timing(t) -> dict[str, float]:
    return {k: round(getattr(t, k), 7) for k in PARTS}


def real(args: argparse.Namespace) -> None:
    import pandas as pd

    from testbed.engine.config import EngineConfig
    from testbed.entrypoints.replay import run_replay
    from testbed.profiling.step_measure import StepMeasurer
    from testbed.profiling.synthetic_steps import StepFactory
    from testbed.specs.presets import get_model_spec
    from testbed.worker.executor import create_executor

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smi = log_gpu_clocks(out / f"smi_{args.model}.csv", 200)  # clocks, power, temperature beside the runs
    base = EngineConfig()
    t0 = time.perf_counter()
    ex = create_executor(args.model, base, "dummy")
    print(f"[in_loop] executor ready in {time.perf_counter() - t0:.0f} s: {ex.num_gpu_blocks} blocks", flush=True)
    runner = ex.runner
    runner.record_timing = True
    launch = runner.execute_async
    log: list[dict] = []

    def logged(so):  # the runner's own launch, its output's StepTiming kept with the step's rows
        wait, rows = launch(so), _rows(so)

        def done():
            o = wait()
            log.append({"rows": rows, **_timing(o.timing)})
            return o
        return done

    runner.execute_async = logged
    steps, sat = {}, None
    for name, limit, load in (("azure-burst", args.burst_limit, None), ("azure-80", args.limit, 0.8)):
        log.clear()
        rate = math.inf if load is None else load * sat
        t = time.perf_counter()
        run_dir = out / f"run_{args.model}_{name}"
        _, s = run_replay(str(TRACES / "azure_conv_3000.jsonl"), EngineConfig(), model=args.model, load_format="dummy",
                          request_rate=rate, limit=limit, output=run_dir, executor=ex)
        sat = s["request_throughput"] if load is None else sat
        start = pd.read_parquet(run_dir / "steps.parquet")["start"].to_numpy()
        if len(start) != len(log):
            raise RuntimeError(f"{name}: {len(start)} recorded steps but {len(log)} executed")
        cycles = np.append(np.diff(start), np.nan)
        steps[name] = [{**e, "cycle_s": None if math.isnan(c) else round(float(c), 7)} for e, c in zip(log, cycles)]
        print(f"[in_loop] {name}: {len(log)} steps in {time.perf_counter() - t:.0f} s, {s['request_throughput']:.2f} "
              f"req/s, TPOT p50 {s['tpot_s']['p50']}", flush=True)
    runner.execute_async = launch

    run80 = steps["azure-80"]
    lo = max(0, len(run80) // 2 - args.window)
    window = run80[lo: lo + 2 * args.window]
    factory = StepFactory(ex.num_gpu_blocks, base.block_size, get_model_spec(args.model).vocab_size, seed=1,
                          scattered=True)
    sos = [factory.step([tuple(r) for r in s["rows"]]) for s in window]
    sequential = [[_timing(ex.execute(so).timing) for so in sos] for _ in range(2)]
    measurer = StepMeasurer(ex, reps=5, warmup=1)
    pick = sorted(random.Random(0).sample(range(len(sos)), min(args.isolated, len(sos))))
    isolated = {i: {k: round(v, 7) for k, v in measurer.sync(sos[i]).items() if k in PARTS} for i in pick}
    parts = _attention_parts(measurer, factory, [window[i]["rows"] for i in pick], pick) if args.parts else None
    if smi is not None:
        smi.terminate()
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"model": args.model, "gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "steps": steps, "window_start": lo, "sequential": sequential, "isolated": isolated,
              **({"parts": parts} if parts is not None else {})}
    path = out / f"in_loop_{args.model}.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(result, fh)
    print(f"[in_loop] {len(isolated)} isolated, 2 x {len(sos)} sequential in {time.perf_counter() - t0:.0f} s -> {path}")
    ex.shutdown()


def _attention_parts(measurer, factory, rows_of: list, ids: list[int]) -> dict:
    """For each step with a prefill chunk among `ids` (rows `rows_of`): the device time in attention of the whole
    step and of the parts a profile adds up for it (its chunks alone; its decode rows beside a ROW_CHUNK-token chunk,
    as the profile's decode_rows table measures them), and the step's eager forward; plus the ROW_CHUNK chunk alone
    (the floor the profile takes off once)."""
    from testbed.profiling.sweep import ROW_CHUNK
    small = [(0, ROW_CHUNK, False)]
    out: dict = {"row_chunk_attention_s": round(measurer.attention_s(factory.step(small)), 8)}
    runner = measurer.runner
    for i, rows in zip(ids, rows_of):
        rows = [tuple(r) for r in rows]
        chunks, decodes = [r for r in rows if not r[2]], [r for r in rows if r[2]]
        if not chunks:
            continue
        so = factory.step(rows)
        rec = {"attention_s": measurer.attention_s(so),
               "chunks_attention_s": measurer.attention_s(factory.step(chunks))}
        if decodes:
            rec["rows_attention_s"] = measurer.attention_s(factory.step(decodes + small))
        runner.eager_steps = True
        try:
            rec["eager_forward_s"] = measurer.sync(so)["forward_s"]
        finally:
            runner.eager_steps = False
        out[i] = {k: round(v, 8) for k, v in rec.items()}
    return out


def _kind(rows) -> str:
    return "decode" if all(d for _, _, d in rows) else "mixed"


def analyze(args: argparse.Namespace) -> None:
    from testbed.engine.config import EngineConfig
    from testbed.profiling.sweep import gpu_preset_name
    from testbed.profiling.synthetic_steps import StepFactory
    from testbed.sim.factory import load_cost_model
    from testbed.specs.hardware import get_gpu_spec
    from testbed.specs.presets import get_model_spec

    with gzip.open(args.file, "rt") as fh:
        d = json.load(fh)
    print(f"{d['model']} on {d['gpu']} ({d['date']}, torch {d['torch']})\n")
    run80, lo = d["steps"]["azure-80"], d["window_start"]
    print("| step kind | part | steps | in-loop / isolated | sequential / isolated (1st, 2nd pass) | "
          "in-loop, isolated (ms) |")
    print("|---|---|---|---|---|---|")
    for kind in ("decode", "mixed"):
        picked = [(run80[lo + int(i)], d["sequential"][0][int(i)], d["sequential"][1][int(i)], iso)
                  for i, iso in d["isolated"].items() if _kind(run80[lo + int(i)]["rows"]) == kind]
        for part in PARTS if picked else ():
            a = np.array([[s[part], q0[part], q1[part], iso[part]] for s, q0, q1, iso in picked])
            ratio = np.median(a[:, :3] / a[:, 3:], axis=0)
            print(f"| {kind} | {part} | {len(a)} | {ratio[0]:.3f} | {ratio[1]:.3f}, {ratio[2]:.3f} | "
                  f"{1e3 * np.median(a[:, 0]):.3f}, {1e3 * np.median(a[:, 3]):.3f} |")
    gpu = get_gpu_spec(gpu_preset_name(d["gpu"]))  # 'auto': the profile shipped for the GPU the replays ran on
    cm, desc = load_cost_model(args.profile, get_model_spec(d["model"]), gpu, EngineConfig())
    if not hasattr(cm, "terms"):
        print(f"\n{desc}: not a profile (no terms to compare)")
        return
    print(f"\nagainst {desc.split(';')[0]}: medians of predicted / in-loop (sum over the steps in brackets); steps "
          "followed by an idle gap left out")
    # the runner's share: the step priced without the engine term (its scale applied, as step_time applies it)
    factory = StepFactory(1 << 20, 16, 1000, seed=1)

    def priced(rows) -> tuple[float, float]:
        so = factory.step([tuple(r) for r in rows])
        return cm.step_time(so), cm.step_time(so, engine=0.0)

    print("| steps timed alone | step kind | steps | runner share: predicted / alone | alone (ms) |")
    print("|---|---|---|---|---|")
    for kind in ("decode", "mixed"):
        alone = [(priced(run80[lo + int(i)]["rows"])[1], iso["wall_s"]) for i, iso in d["isolated"].items()
                 if _kind(run80[lo + int(i)]["rows"]) == kind]
        if alone:
            a = np.array(alone)
            print(f"| azure-80 window | {kind} | {len(a)} | {np.median(a[:, 0] / a[:, 1]):.3f} | "
                  f"{1e3 * np.median(a[:, 1]):.3f} |")
    print()
    print("| case | step kind | steps | cycle | engine share: predicted, in-loop (ms) | runner share |")
    print("|---|---|---|---|---|---|")
    for case, steps in d["steps"].items():
        acc: dict[str, list] = {"decode": [], "mixed": []}
        for s in steps:
            cyc = s["cycle_s"]
            if cyc is None or cyc > 2 * s["wall_s"] + 0.002:
                continue
            pred, runner = priced(s["rows"])
            acc[_kind(s["rows"])].append((pred, cyc, pred - runner, cyc - s["wall_s"], runner, s["wall_s"]))
        for kind, v in acc.items():
            a = np.array(v)
            print(f"| {case} | {kind} | {len(a)} | {np.median(a[:, 0] / a[:, 1]):.3f} ({a[:, 0].sum() / a[:, 1].sum():.3f}) "
                  f"| {1e3 * np.median(a[:, 2]):.3f}, {1e3 * np.median(a[:, 3]):.3f} | {np.median(a[:, 4] / a[:, 5]):.3f} "
                  f"({a[:, 4].sum() / a[:, 5].sum():.3f}) |")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("real", help="on a GPU: the replays and the synthetic re-runs")
    r.add_argument("--model", default="Llama-3.2-1B")
    r.add_argument("--out", required=True)
    r.add_argument("--limit", type=int, default=2000, help="requests of the azure-80 replay")
    r.add_argument("--burst-limit", type=int, default=800, help="requests of the burst (it measures the saturation rate)")
    r.add_argument("--window", type=int, default=400, help="half the azure-80 steps re-run as synthetic steps")
    r.add_argument("--isolated", type=int, default=240, help="of those, how many are timed alone")
    r.add_argument("--parts", action="store_true", help="also time the attention of each isolated step with a chunk, "
                   "of its chunks alone and of its decode rows beside a small chunk (what a profile adds up)")
    a = sub.add_parser("analyze", help="the tables, from real's JSON")
    a.add_argument("file")
    a.add_argument("--profile", default="auto", help="cost model whose prediction is compared (default: shipped)")
    args = ap.parse_args()
    real(args) if args.cmd == "real" else analyze(args)


if __name__ == "__main__":
    main()
