"""`testbed profile --quick`'s anchors measured several times on one executor: whether what they move is the machine
or the way and the moment they are measured.

  # on a GPU (dummy weights): writes OUT/quick_anchors_MODEL.json and one rescaled profile per round
  python benchmarks/quick_anchors.py real --model Llama-3.2-1B --out DIR [--rounds 2]
  # anywhere: per round the fitted scales, and per sync decode anchor each StepTiming part beside the base profile's
  python benchmarks/quick_anchors.py analyze DIR/quick_anchors_MODEL.json

`profile --quick` measures its anchors right after the engine is built, as a user runs it. On the committed quick
rescales of four H100s and an H200 the sync decode anchors came out 0.1-0.5 ms slower than the base profile predicts
while the same steps timed async matched within 0.05 ms, and the fit read that as a host 1.2-1.6x slower; on the
same machines the light real runs' decode steps did not show it. Here the anchors are measured --rounds times each way,
alternating: each sync anchor repeated alone (as the profile's sweep times its points, and `--quick`) and all of
them in turn (StepMeasurer.sync_each), with the GPU's clocks logged (nvidia-smi every
100 ms) and every sync anchor's StepTiming parts kept (host: prepare, launch, output; device: forward, LM head +
sampler). `analyze` puts each part beside the base profile's decode table at the same batch and context, so a move
shows as host or device. (The rounds of 2026-11-28_235d08e were this script's first version: four rounds of the
anchors alone, at start-up, again, after 5 s of back-to-back decode steps and after 10 s idle.)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import log_gpu_clocks  # noqa: E402

PARTS = ("prepare_s", "launch_s", "wait_s", "output_s", "forward_s", "sample_s", "wall_s")


def real(args: argparse.Namespace) -> None:
    import torch

    from testbed.engine.config import EngineConfig
    from testbed.profiling.profile_file import base_profile
    from testbed.profiling.sweep import profile_gpu
    from testbed.sim.quick_rescale import check_base, measure_anchors, rescale_to_machine
    from testbed.worker.executor import create_executor

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smi = log_gpu_clocks(out / f"smi_{args.model}.csv", 100)  # clocks, power, temperature beside the runs
    config = EngineConfig()
    t0 = time.perf_counter()
    ex = create_executor(args.model, config, "dummy")
    gpu = profile_gpu(ex.runner.device)
    base, base_name = base_profile("auto", args.model, gpu, 1)
    check_base(base, base_name, config)
    print(f"[quick_anchors] executor ready in {time.perf_counter() - t0:.0f} s; base {base_name}", flush=True)
    rounds = []
    for k in range(args.rounds):
        for label, interleaved in (("alone", False), ("interleaved", True)):
            label = f"{label}_{k + 1}"
            start = time.time()
            samples, records = measure_anchors(ex, config, base, interleaved=interleaved)
            prof, before, after = rescale_to_machine(base, base_name, samples, records,
                                                     {"device_name": torch.cuda.get_device_name(), "gpu": gpu,
                                                      "sync_anchors": "interleaved" if interleaved else "alone"})
            (out / f"quick_{args.model}_{label}.json").write_text(json.dumps(prof))
            rounds.append({"label": label, "start": start, "end": time.time(), "scales": prof["scales"],
                           "anchors": prof["calibration"]["anchors"], "mape_before": before, "mape_after": after})
            print(f"[quick_anchors] {label}: {time.time() - start:.1f} s, scales "
                  f"{ {c: round(v, 3) for c, v in prof['scales'].items()} }", flush=True)
    ex.runner.record_timing = False
    if smi is not None:
        smi.terminate()
    result = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "base_profile": base_name, "rounds": rounds}
    path = out / f"quick_anchors_{args.model}.json"
    path.write_text(json.dumps(result))
    print(f"[quick_anchors] -> {path}")
    ex.shutdown()


def analyze(args: argparse.Namespace) -> None:
    from testbed.profiling.profile_file import PROFILES_DIR, read_profile

    d = json.loads(Path(args.file).read_text())
    base = read_profile(PROFILES_DIR / Path(d["base_profile"]).name)
    dec = base["decode"]
    print(f"{d['model']} on {d['gpu']} ({d['date']}), base {d['base_profile']}\n")
    print("| round | host | gemm | attention | decode | anchor MAPE before -> after |")
    print("|---|---|---|---|---|---|")
    for r in d["rounds"]:
        s = r["scales"]
        print(f"| {r['label']} | {s['host']:.3f} | {s['gemm']:.3f} | {s['attention']:.3f} | {s['decode']:.3f} | "
              f"{r['mape_before']['mape']:.1%} -> {r['mape_after']['mape']:.1%} |")
    print("\nsync decode anchors, measured - base profile (ms), by part:\n")
    print("| round | anchor | " + " | ".join(p[:-2] for p in PARTS) + " | async measured - base |")
    print("|---|---|" + "---|" * (len(PARTS) + 1))
    for r in d["rounds"]:
        asyncs = {a["anchor"]: a for a in r["anchors"] if a["mode"] == "async"}
        for a in r["anchors"]:
            if a["mode"] != "sync" or not a["anchor"].startswith("decode") or "timing" not in a:
                continue
            b, c = (int(x.split("=")[1]) for x in a["anchor"].split()[1:3])
            i, j = dec["batch"].index(b), dec["context"].index(c)
            diffs = [(a["timing"][p] - dec[p][i][j]) * 1e3 for p in PARTS]
            am = asyncs.get(a["anchor"])
            ad = "" if am is None else f"{(am['measured_s'] - dec['async_cycle_s'][i][j]) * 1e3:+.3f}"
            print(f"| {r['label']} | b={b} ctx={c} | " + " | ".join(f"{x:+.3f}" for x in diffs) + f" | {ad} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("real")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--rounds", type=int, default=2, help="rounds of each way, alternating")
    a = sub.add_parser("analyze")
    a.add_argument("file")
    args = p.parse_args()
    (real if args.cmd == "real" else analyze)(args)


if __name__ == "__main__":
    sys.exit(main())
