"""How stable `testbed profile --quick` is on one machine: its scales over several rounds in one process (one
executor), so in-process noise can be told from between-process noise (run it several times, and pinned with
`taskset -c ...`). GPU only: the anchors are real steps.

Usage: python benchmarks/quick_noise.py --model Llama-3.2-1B --rounds 3 [--json out.json]
Prints, per round, the fitted scales and the host-bound anchors (a sync decode step of one row, a mixed step,
the EngineCore's schedule + update timed alone), in milliseconds.
"""
from __future__ import annotations

import argparse
import json

from testbed.engine.config import EngineConfig
from testbed.profiling.profile_file import PROFILES_DIR, read_profile
from testbed.sim.quick_rescale import check_base, rescale_on
from testbed.worker.executor import create_executor

SHOWN = ("decode b=1 ctx=512|", "mixed 1|sync", "engine ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Llama-3.2-1B")
    ap.add_argument("--gpu", default="H100-SXM", help="the shipped profile's GPU name")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    base_path = str(PROFILES_DIR / f"{a.model}_{a.gpu}_tp1.json")
    config = EngineConfig()
    base = read_profile(base_path)
    check_base(base, base_path, config)
    executor = create_executor(a.model, config, "dummy")
    rounds = []
    for i in range(a.rounds):
        prof = rescale_on(executor, config, base, base_path)[0]
        anchors = {x["anchor"] + "|" + x["mode"]: x["measured_s"] * 1e3 for x in prof["calibration"]["anchors"]}
        rounds.append({"scales": prof["scales"], "anchors_ms": anchors})
        shown = {k: round(v, 4) for k, v in anchors.items() if k.startswith(SHOWN)}
        print(f"round {i}: scales {({k: round(v, 3) for k, v in prof['scales'].items()})} anchors ms {shown}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
