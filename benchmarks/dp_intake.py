"""A DP replica's intake of one routed request, on this host's CPU: the frame the coordinator sends decoded
(`Frames.decode`, msgspec + the frame's tag; the replica's input thread) and the request added to an engine
(`engine_proc.add_to_core`: its checks, the Request, the scheduler's queue; the replica's loop), against the add
alone (what a single engine in process pays for a request it is handed).

Usage: python benchmarks/dp_intake.py [--prompt-tokens 700] [--requests 2000] [--rounds 5] [--json OUT]

Each round decodes and adds --requests requests of --prompt-tokens tokens to a fresh engine; the medians over the
rounds are printed per request, with the host's CPU, Python and package versions.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from importlib import metadata

import numpy as np

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.params import SamplingParams
from testbed.runtime import dp_protocol as D
from testbed.runtime import protocol as P
from testbed.runtime.engine_proc import add_to_core
from testbed.runtime.frames import Frames

VOCAB = 128256


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def one_round(n: int, tokens: int, seed: int) -> tuple[float, float]:
    """(decode, add) seconds per request over n requests."""
    frames = Frames("benchmark-secret-of-32-characters", "dp_intake")
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    wire = [frames.encode(P.AddRequest(i, f"r{i}", rng.integers(1000, VOCAB, tokens).tolist(), 0.0, params))
            for i in range(n)]
    t = time.perf_counter()
    msgs = [frames.decode(f, D.to_replica_decoder, "dp_intake") for f in wire]
    decode = (time.perf_counter() - t) / n
    core = EngineCore(EngineConfig(max_model_len=8192), 1 << 20, 8192)
    t = time.perf_counter()
    for m in msgs:
        if add_to_core(core, m, None, VOCAB, 0.0) is not None:
            raise RuntimeError(f"request {m.request_id} was rejected")
    add = (time.perf_counter() - t) / n
    return decode, add


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rounds = [one_round(args.requests, args.prompt_tokens, r) for r in range(args.rounds)]
    decode, add = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
    out = {"cpu": cpu_name(), "python": platform.python_version(),
           "versions": {p: metadata.version(p) for p in ("msgspec", "numpy")}, "date": time.strftime("%Y-%m-%d"),
           "prompt_tokens": args.prompt_tokens, "requests": args.requests, "rounds": rounds,
           "decode_us": decode * 1e6, "add_us": add * 1e6, "intake_us": (decode + add) * 1e6}
    print(f"{out['cpu']}: a {args.prompt_tokens}-token request's frame decoded {decode * 1e6:.1f} us, added to an "
          f"engine {add * 1e6:.1f} us (the single engine's part), intake {(decode + add) * 1e6:.1f} us "
          f"(medians of {args.rounds} rounds of {args.requests})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
