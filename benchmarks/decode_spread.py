"""What a decode batch's spread of contexts costs on the GPU, against the same batch at its mean context.

  python benchmarks/decode_spread.py real --models Llama-3.2-1B,Qwen3-0.6B,Llama-3.1-8B [--in-loop FILE] --out DIR
  python benchmarks/decode_spread.py analyze DIR [--profile PROFILE.json]
`real` (one GPU): for each model, graphed decode steps of B rows (16-256) whose contexts are drawn lognormal
(CV 0.3-1.0, scaled to an exact mean of 400 / 1,200 / 2,500) against B rows at that mean, device time (forward
+ LM head and sampler) and the runner's host parts and wall as the profiler times a step; with --in-loop (a file of benchmarks/in_loop.py) also that
run's real azure-80 decode batches, on the first model, as they came, sorted long-first, short-first,
shuffled, and at their mean (does the rows' order, the decode kernel's launch order, change the spread's cost?).
With --async-cycles each batch's async cycle is timed too (StepMeasurer.async_cycle, the profile's way), and
`analyze` prints the async extra over the uniform batch beside the device extra, by the kernel's split count.
`analyze`: fits extra = kappa x (longest - mean) / splits, splits being the decode kernel's split count
(kernels/decode_attention.num_splits_for on 132 SMs), per model, and prints the fit's error against none;
for the real batches, each order against as-is and kappa from them; with --profile, the profile's decode_tail
term against the measured extra on the real batches.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import time
from typing import Callable

import numpy as np

B_GRID = (16, 32, 64, 96, 128, 192, 256)
MEANS = (400, 1200, 2500)
CVS = (0.0, 0.3, 0.6, 1.0)


def splits(batch: int, kv_heads: int, max_context: int) -> int:
    """The decode kernel's splits per sequence for a batch on an H100 (132 SMs; 64-token tiles)."""
    from testbed.kernels.decode_attention import num_splits_for
    return num_splits_for(batch, kv_heads, max_context, 64, 132)


def _contexts(rng: np.random.Generator, batch: int, mean: float, cv: float) -> list[int]:
    if cv == 0:
        c = np.full(batch, float(mean))
    else:
        s2 = math.log(1 + cv * cv)
        c = np.clip(rng.lognormal(-s2 / 2, math.sqrt(s2), batch) * mean, 32, 16000)
        c *= mean * batch / c.sum()
    return sorted((max(32, int(round(x))) for x in c), reverse=True)


def real(args: argparse.Namespace) -> None:
    import torch

    from testbed.engine.config import EngineConfig
    from testbed.profiling.step_measure import StepMeasurer
    from testbed.profiling.synthetic_steps import StepFactory
    from testbed.specs.presets import get_model_spec
    from testbed.worker.executor import create_executor

    os.makedirs(args.out, exist_ok=True)
    models = args.models.split(",")
    if len(models) > 1:  # one process a model: an executor's KV cache is not handed back to the device before exit
        import subprocess
        import sys
        for k, model in enumerate(models):
            argv = ["real", "--out", args.out, "--models", model, *(["--async-cycles"] if args.async_cycles else []),
                    *(["--batches", args.batches] if args.batches else []),
                    *(["--means", args.means] if args.means else []),
                    *(["--in-loop", args.in_loop] if args.in_loop and k == 0 else [])]  # the first model's batches
            subprocess.run([sys.executable, __file__, *argv], check=True)
        return
    for k, model in enumerate(models):
        cfg = EngineConfig()
        t0 = time.time()
        ex = create_executor(model, cfg, "dummy")
        factory = StepFactory(ex.num_gpu_blocks, cfg.block_size, ex.vocab_size, 0, scattered=True)
        measure = StepMeasurer(ex, 5, 2)

        def timed(rows) -> dict[str, float]:
            so = factory.step(rows)
            t = measure.sync(so)
            cycle = {"async_cycle_s": measure.async_cycle(so)} if args.async_cycles else {}
            return {"device_s": t["forward_s"] + t["sample_s"], "prepare_s": t["prepare_s"],
                    "launch_s": t["launch_s"], "wall_s": t["wall_s"], **cycle}
        rng = np.random.default_rng(0)
        res = []
        grid_b = [int(b) for b in args.batches.split(",")] if args.batches else B_GRID
        grid_mean = [float(m) for m in args.means.split(",")] if args.means else MEANS
        for batch in grid_b:
            for mean in grid_mean:
                for cv in CVS:
                    for _ in range(1 if cv == 0 else 2):
                        cc = _contexts(rng, batch, mean, cv)
                        if sum(x // cfg.block_size + 1 for x in cc) > 0.9 * ex.num_gpu_blocks:
                            continue  # past this model's KV cache
                        res.append({"B": batch, "mean": sum(cc) / batch, "cv": float(np.std(cc) / np.mean(cc)),
                                    "max": max(cc), "ctx": cc, **timed([(x - 1, 1, True) for x in cc])})
        out = {"model": model, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__,
               "kv_heads": get_model_spec(model).num_key_value_heads, "date": time.strftime("%Y-%m-%d"),
               "lognormal": res}
        if k == 0 and args.in_loop:
            out["real_batches"] = _real_batches(args.in_loop, lambda rows: timed(rows)["device_s"])
        with open(os.path.join(args.out, f"decode_spread_{model}.json"), "w") as fh:
            json.dump(out, fh)
        print(f"[spread] {model}: {len(res)} batches in {time.time() - t0:.0f} s", flush=True)
        ex.shutdown()


def _real_batches(path: str, device_s: Callable[[list], float]) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        d = json.load(fh)
    run80, lo = d["steps"]["azure-80"], d["window_start"]
    rng = random.Random(0)
    res = []
    for i in d["isolated"]:
        rows = [tuple(r) for r in run80[lo + int(i)]["rows"]]
        if not all(r[2] for r in rows):
            continue
        batch = len(rows)
        mean = sum(r[0] + r[1] for r in rows) / batch
        shuffled = rows[:]
        rng.shuffle(shuffled)
        orders = {"asis": rows, "desc": sorted(rows, key=lambda r: r[0] + r[1], reverse=True),
                  "asc": sorted(rows, key=lambda r: r[0] + r[1]), "shuffled": shuffled,
                  "uniform": [(int(round(mean)) - 1, 1, True)] * batch}
        res.append({"step": i, "B": batch, "mean": mean, "max": max(r[0] + r[1] for r in rows),
                    **{name: device_s(rr) for name, rr in orders.items()}})
    return res


def analyze(args: argparse.Namespace) -> None:
    files = sorted(f for f in os.listdir(args.dir) if f.startswith("decode_spread_") and f.endswith(".json"))
    print("| model | GPU | batches | kappa (us a token) | device time, error without the term: mean / max | "
          "with it: mean / max | the runner's prepare + launch, spread less uniform (ms, median) |")
    print("|---|---|---|---|---|---|---|")
    loaded = []
    for name in files:
        with open(os.path.join(args.dir, name)) as fh:
            d = json.load(fh)
        loaded.append(d)
        uni = {(r["B"], round(r["mean"])): r for r in d["lognormal"] if r["cv"] == 0}
        pts = [(r, uni[(r["B"], round(r["mean"]))]) for r in d["lognormal"]
               if r["cv"] > 0 and (r["B"], round(r["mean"])) in uni]
        x = np.array([(r["max"] - r["mean"]) / splits(r["B"], d["kv_heads"], r["max"]) for r, _ in pts])
        base = np.array([u["device_s"] for _, u in pts])
        y = np.array([r["device_s"] for r, _ in pts])
        kappa = float(x @ (y - base) / (x @ x))
        none, fit = np.abs(base / y - 1), np.abs((base + kappa * x) / y - 1)
        host = [(r["prepare_s"] + r["launch_s"]) - (u["prepare_s"] + u["launch_s"]) for r, u in pts
                if "prepare_s" in r]
        print(f"| {d['model']} | {d['gpu']} | {len(pts)} | {kappa * 1e6:.3f} | {100 * none.mean():.1f}% / "
              f"{100 * none.max():.1f}% | {100 * fit.mean():.1f}% / {100 * fit.max():.1f}% | "
              f"{1e3 * np.median(host):.3f} |" if host else "")
    for d in loaded:
        pts = [(r, {(u["B"], round(u["mean"])): u for u in d["lognormal"] if u["cv"] == 0}.get((r["B"], round(r["mean"]))))
               for r in d["lognormal"] if r["cv"] > 0 and "async_cycle_s" in r]
        pts = [(r, u) for r, u in pts if u is not None]
        if pts:
            print(f"\n{d['model']}: async cycle against device time, spread batch less the uniform one at its mean "
                  "(ms, medians by split count and mean context)")
            print("| splits | mean context | batches | longest - mean | device extra | async extra | uniform: async cycle "
                  "| uniform: device |")
            print("|---|---|---|---|---|---|---|---|")
            keyed: dict = {}
            for r, u in pts:
                keyed.setdefault((splits(r["B"], d["kv_heads"], r["max"]), round(u["mean"], -2)), []).append((r, u))
            for (s, m), group in sorted(keyed.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
                med = lambda f: 1e3 * float(np.median([f(r, u) for r, u in group]))  # noqa: E731
                print(f"| {s} | {m:.0f} | {len(group)} | {med(lambda r, u: r['max'] - r['mean']) / 1e3:.0f} | "
                      f"{med(lambda r, u: r['device_s'] - u['device_s']):.3f} | "
                      f"{med(lambda r, u: r['async_cycle_s'] - u['async_cycle_s']):.3f} | "
                      f"{med(lambda r, u: u['async_cycle_s']):.3f} | {med(lambda r, u: u['device_s']):.3f} |")
    for d in loaded:
        rb = d.get("real_batches")
        if not rb:
            continue
        a = np.array([[r[k] for k in ("asis", "desc", "asc", "shuffled", "uniform")] for r in rb])
        x = np.array([(r["max"] - r["mean"]) / splits(r["B"], d["kv_heads"], r["max"]) for r in rb])
        print(f"\n{d['model']}, {len(rb)} real azure-80 decode batches (B {int(np.median([r['B'] for r in rb]))}, "
              f"mean context {np.median([r['mean'] for r in rb]):.0f}, longest {np.median([r['max'] for r in rb]):.0f}, "
              "medians):")
        print(f"- device time as they came {1e3 * np.median(a[:, 0]):.3f} ms, at their mean context "
              f"{1e3 * np.median(a[:, 4]):.3f} ms ({np.median(a[:, 0] / a[:, 4]):.3f}x)")
        print("- sorted long-first / short-first / shuffled against as they came: "
              + " / ".join(f"{v:.4f}" for v in np.median(a[:, 1:4] / a[:, :1], axis=0)))
        print(f"- kappa from them: {1e6 * np.median((a[:, 0] - a[:, 4]) / x):.3f} us a token")
        if args.profile:
            from testbed.engine.config import EngineConfig
            from testbed.sim.factory import load_cost_model
            from testbed.specs.hardware import get_gpu_spec
            from testbed.specs.presets import get_model_spec
            cm, _ = load_cost_model(args.profile, get_model_spec(d["model"]), get_gpu_spec("H100-SXM"), EngineConfig())
            tail = np.array([cm.dec_tail(r["B"], r["max"] - r["mean"]) if cm.dec_tail else 0.0 for r in rb])
            print(f"- the profile's decode_tail term {1e3 * np.median(tail):.3f} ms against the measured extra "
                  f"{1e3 * np.median(a[:, 0] - a[:, 4]):.3f} ms ({np.median(tail / (a[:, 0] - a[:, 4])):.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("real", help="on a GPU: the spread batches and, with --in-loop, a run's real ones")
    r.add_argument("--models", default="Llama-3.2-1B,Qwen3-0.6B,Llama-3.1-8B")
    r.add_argument("--in-loop", default=None, help="an in_loop.py file (json.gz) whose azure-80 batches to re-time")
    r.add_argument("--out", required=True)
    r.add_argument("--batches", default=None, help="comma-separated batch sizes (default: B_GRID)")
    r.add_argument("--means", default=None, help="comma-separated mean contexts (default: MEANS)")
    r.add_argument("--async-cycles", action="store_true",
                   help="also time each batch's async cycle (the profile's steady way): what a spread costs where "
                        "the loop overlaps the host with the device")
    a = sub.add_parser("analyze", help="the fit and the order test from a folder of `real` files")
    a.add_argument("dir")
    a.add_argument("--profile", default=None, help="compare its decode_tail term on the real batches")
    args = ap.parse_args()
    (real if args.cmd == "real" else analyze)(args)


if __name__ == "__main__":
    main()
