"""Why a TP=2 decode step is more than half a TP=1 one, on one GPU (no peers needed):

  python benchmarks/tp_gemms.py            # writes $OUT/gemm_l2.json (OUT defaults to /tmp); SKIP_GEMM=1: part 2 only
1. cuBLAS (F.linear, as the model runs it) on Llama-3.1-8B's per-rank GEMMs at TP=1 and TP=2, M = 1, 64, 256 rows:
   time and achieved bandwidth of each, replayed in a CUDA graph over 8 copies of each weight (so none is in L2).
2. A TP=2 layer's four GEMMs at M = 64 with two all-reduce-like waits (a spin kernel on the main stream, 0 / 8 /
   11 us) and the next GEMM's weight prefetched into L2 on a side stream during each wait, by a bulk L2 prefetch
   ("bulk") or a kernel that loads and drops it ("wide"), 8-32 MB: the layer's time with and without.
The engine's prefetch (kernels/l2_prefetch.py) came from part 2; benchmarks/tp.py measures it in real TP=2 engines."""
import json
import os

import torch
import triton

from testbed.kernels.l2_prefetch import l2_prefetch

dev = torch.device("cuda")
torch.manual_seed(0)
H, I, NH, NKV, D = 4096, 14336, 32, 8, 128
L = 8
OUT = os.environ.get("OUT", "/tmp")
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}


def shapes(tp):
    return {"qkv": ((NH + 2 * NKV) * D // tp, H), "o": (H, NH * D // tp), "gate_up": (2 * I // tp, H),
            "down": (H, I // tp)}


def graph_time(fn, reps=20, rounds=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    ts.sort()
    return ts[len(ts) // 2]


def prefetch(w, nbytes, out):
    """The engine's L2 prefetch (kernels/l2_prefetch.py): MODE "bulk", or "wide" (its "load" way)."""
    l2_prefetch(w, nbytes, "bulk" if MODE == "bulk" else "load", out)


if __name__ == "__main__":  # benchmarks/gemm_sweep.py imports graph_time and shapes
    for tp in (() if os.environ.get("SKIP_GEMM") else (1, 2)):
        sh = shapes(tp)
        W = {k: [torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)] for k, (n, kk) in sh.items()}
        for M in (1, 64, 256):
            X = {k: torch.randn(M, kk, device=dev, dtype=torch.bfloat16) for k, (n, kk) in sh.items()}
            row = {}
            for k in sh:
                t = graph_time(lambda: [torch.nn.functional.linear(X[k], W[k][l]) for l in range(L)]) / L
                nbytes = W[k][0].numel() * 2
                row[k] = {"ms": t, "TBps": nbytes / t / 1e9}
            tot = sum(r["ms"] for r in row.values())
            res[f"gemm_tp{tp}_M{M}"] = row | {"layer_ms": tot}
            print(f"tp{tp} M{M}", {k: f"{v['ms']*1e3:.1f}us {v['TBps']:.2f}TB/s" for k, v in row.items()}, f"layer {tot*1e3:.1f}us", flush=True)
        del W
        torch.cuda.empty_cache()

    # L2 prefetch during a wait, TP=2 shapes at M=64
    sh = shapes(2)
    W = {k: [torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)] for k, (n, kk) in sh.items()}
    M = 64
    X = {k: torch.randn(M, kk, device=dev, dtype=torch.bfloat16) for k, (n, kk) in sh.items()}
    side = torch.cuda.Stream()
    pout = torch.empty(1024, device=dev, dtype=torch.float32)
    hz = torch.cuda.get_device_properties(0).clock_rate if hasattr(torch.cuda.get_device_properties(0), "clock_rate") else 1980000
    res["clock_khz"] = hz


    def layers(wait_cycles, pf_bytes):
        F = torch.nn.functional.linear
        for l in range(L):
            F(X["qkv"], W["qkv"][l]); F(X["o"], W["o"][l])
            cur = torch.cuda.current_stream()
            if wait_cycles:
                if pf_bytes:
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        prefetch(W["gate_up"][l], pf_bytes, pout)
                torch.cuda._sleep(wait_cycles)
                if pf_bytes:
                    cur.wait_stream(side)
            F(X["gate_up"], W["gate_up"][l]); F(X["down"], W["down"][l])
            if wait_cycles:
                if pf_bytes:
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        prefetch(W["qkv"][(l + 1) % L], pf_bytes, pout)
                torch.cuda._sleep(wait_cycles)
                if pf_bytes:
                    cur.wait_stream(side)


    # calibrate the spin: cycles per us
    g1 = graph_time(lambda: [torch.cuda._sleep(100000) for _ in range(10)]) / 10
    cyc_per_us = 100000 / (g1 * 1e3)
    res["sleep_cycles_per_us"] = cyc_per_us
    print("cycles/us", cyc_per_us)
    out = {}
    for mode in ("bulk", "wide"):
        MODE = mode
        for pf in (16 << 20, 25 << 20):
            t = graph_time(lambda: [prefetch(W["gate_up"][l], pf, pout) for l in range(L)]) / L
            res[f"prefetch_alone_{mode}_{pf >> 20}MB_ms"] = t
            print(f"prefetch alone {mode} {pf>>20} MB: {t*1e3:.1f} us = {pf / t / 1e9:.2f} TB/s", flush=True)
        for wait_us in (0, 8, 11):
            cyc = int(wait_us * cyc_per_us)
            variants = [0] if not wait_us else [0, 8 << 20, 16 << 20, 25 << 20, 32 << 20]
            for pf in variants:
                ts = [graph_time(lambda: layers(cyc, pf)) / L for rep in range(3)]
                t = sorted(ts)[1]
                out[f"{mode}_wait{wait_us}_pf{pf >> 20}MB"] = t
                print(f"{mode} wait {wait_us}us prefetch {pf >> 20} MB: layer {t*1e3:.1f} us", flush=True)
    res["prefetch_layer_ms"] = out
    json.dump(res, open(os.path.join(OUT, "gemm_l2.json"), "w"), indent=1)
