"""How a profile times an async decode cycle: the way profiles were measured before 680360e (the mean over one short
burst of back-to-back launches, its pipeline's fill and drain inside it) against the steady-state way
(StepMeasurer.async_cycle: completions timed once the pipeline is full, the median interval; the mean of the same
intervals kept beside it), alternating point by point on one executor.

  # on a GPU (dummy weights): every point of the shipped profile's decode and decode_tail async tables, --rounds times
  python benchmarks/async_cycles.py real --model Llama-3.2-1B --out DIR [--rounds 2]
  # anywhere: per way, the ratio to the burst way by batch, and the shipped profile with its async tables replaced by
  # this machine's (one profile per way: simulate this machine's async runs with each, fidelity.py sim --profile)
  python benchmarks/async_cycles.py analyze DIR/async_cycles_MODEL.json

The simulator prices an async decode step at the profile's cycle (sim/step_terms.py); on five H200s the burst-timed
shipped profiles priced the async runs' own decode batches 0.7-5% above what they took, the tail term and the host
branch excepted (so the table itself). On one H200 (2026-11-28, RESULTS) the steady way came out 0.954-0.971x the
burst way for the 1B and 0.968-0.989x for Qwen3-0.6B at every batch size, its mean within 0.003 of its median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

WAYS = ("burst", "steady_median", "steady_mean")
TABLES = {"decode": ("context", lambda t, b, c: [(c, 1, True)] * b),
          "decode_tail": ("delta", lambda t, b, d: [(t["base"], 1, True)] * (b - 1) + [(t["base"] + d, 1, True)])}


def real(args: argparse.Namespace) -> None:
    import torch

    from testbed.engine.config import EngineConfig
    from testbed.profiling.profile_file import base_profile
    from testbed.profiling.step_measure import StepMeasurer
    from testbed.profiling.sweep import device_name, profile_gpu
    from testbed.profiling.synthetic_steps import StepFactory
    from testbed.worker.executor import create_executor

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = EngineConfig()
    t0 = time.perf_counter()
    ex = create_executor(args.model, config, "dummy")
    base, base_name = base_profile(args.base, args.model, profile_gpu(ex.runner.device), 1)
    print(f"[async_cycles] executor ready in {time.perf_counter() - t0:.0f} s; base {base_name}", flush=True)
    m = StepMeasurer(ex, reps=5, warmup=1)
    f = StepFactory(ex.num_gpu_blocks, config.block_size, ex.vocab_size, config.seed)
    bs = config.block_size
    path = out / f"async_cycles_{args.model}.json"
    result = {"model": args.model, "gpu": device_name(ex.runner.device), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "base_profile": base_name, "tables": {}}
    for name, (col, rows) in TABLES.items():
        t = base[name]
        points = [(i, j) for i, row in enumerate(t["async_cycle_s"]) for j, v in enumerate(row) if v is not None]
        cells = {way: [[[] for _ in t[col]] for _ in t["batch"]] for way in WAYS}
        for k in range(args.rounds):
            start = time.perf_counter()
            for i, j in points:
                step_rows = rows(t, t["batch"][i], t[col][j])
                if sum(-(-(c + 1) // bs) for c, _, _ in step_rows) > ex.num_gpu_blocks:
                    continue
                so = f.step(step_rows)
                ex.execute(so)  # warm
                cells["burst"][i][j].append(m.async_cycle(so, "burst"))
                done = m.async_completions(so)
                gaps = [b - a for a, b in zip(done, done[1:])]
                cells["steady_median"][i][j].append(statistics.median(gaps))
                cells["steady_mean"][i][j].append(statistics.fmean(gaps))
            print(f"[async_cycles] {name} round {k + 1}: {len(points)} points in {time.perf_counter() - start:.0f} s",
                  flush=True)
            result["tables"][name] = {"batch": t["batch"], col: t[col], **({"base": t["base"]} if "base" in t else {}),
                                      **{way: cells[way] for way in WAYS}}
            path.write_text(json.dumps(result))  # after every round: a timeout keeps what ran
    print(f"[async_cycles] -> {path}")
    ex.shutdown()


def analyze(args: argparse.Namespace) -> None:
    from testbed.profiling.profile_file import read_profile
    data = json.loads(Path(args.json).read_text())
    base = read_profile(data["base_profile"])
    t = data["tables"]["decode"]
    print(f"{data['model']} on {data['gpu']} ({data['date']}): median over rounds, then over contexts, each way / burst")
    print("batch | burst ms | " + " | ".join(f"{w} / burst" for w in WAYS[1:]) + " | base profile / burst")
    for i, b in enumerate(t["batch"]):
        med = {w: [statistics.median(v) for v in t[w][i] if v] for w in WAYS}
        if not med["burst"]:
            continue
        bases = [base["decode"]["async_cycle_s"][i][j] for j, v in enumerate(t["burst"][i]) if v]
        ratios = [statistics.median(x / y for x, y in zip(med[w], med["burst"])) for w in WAYS[1:]]
        print(f"{b} | {statistics.median(med['burst']) * 1e3:.3f} | " + " | ".join(f"{r:.3f}" for r in ratios)
              + f" | {statistics.median(x / y for x, y in zip(bases, med['burst'])):.3f}")
    out = Path(args.json).parent
    for way in WAYS:  # the shipped profile with this machine's async tables, measured `way`
        prof = json.loads(json.dumps(base))
        for name, tab in data["tables"].items():
            prof[name]["async_cycle_s"] = [[statistics.median(v) if v else None for v in row] for row in tab[way]]
        prof["async_cycles"] = {"way": way, "source": str(args.json)}
        path = out / f"async_{way}_{data['model']}.json"
        path.write_text(json.dumps(prof))
        print(f"-> {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("real")
    p.add_argument("--model", default="Llama-3.2-1B")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--base", default="auto", help="the profile whose async tables' points are timed (default: the "
                                                  "shipped one for the model and this GPU)")
    p.set_defaults(func=real)
    p = sub.add_parser("analyze")
    p.add_argument("json")
    p.set_defaults(func=analyze)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
