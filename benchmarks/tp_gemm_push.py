"""The row-parallel GEMM that pushes its own tiles to the peers (kernels/gemm_push.py) against cuBLAS followed
by the fused all-reduce + residual add + RMSNorm's push (needs 2 GPUs).

  python benchmarks/tp_gemm_push.py --out gemm_push.json [--rows 1,16,64,128,256]

On 2 ranks, Llama-3.1-8B's TP=2 row-parallel shapes (o_proj: 4,096 x 2,048 a rank, down_proj: 4,096 x 7,168),
for each step size T: a chain of 8 layers (8 distinct weights, so none stays in L2), each a GEMM then the norm
(tp_all_reduce.FusedAllReduceNorm; the residual stream runs through the chain), captured in one CUDA graph and
replayed, in three ways, alternating over rounds:
  cublas  F.linear, then the fused call (it pushes the rows itself);
  push    FusedAllReduceNorm.gemm (the GEMM pushes each tile as it is done), then the fused call (it only waits,
          sums and normalises; on Hopper the norm launches while the GEMM runs, programmatic dependent
          launch); push_nopdl: the same, launched one after the other;
  gemm    F.linear alone (no peers): what the GEMM costs without any all-reduce.
Prints and writes µs a layer (median of the rounds), the push's saving, and the largest difference of the
chain's outputs between push and cublas relative to their size (the two GEMMs sum K in different orders).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp import _time_ms, on_two_ranks  # benchmarks/tp.py

HIDDEN, LAYERS, EPS = 4096, 8, 1e-5
SHAPES = {"o_proj": 2048, "down_proj": 7168}  # K a rank at TP=2 (Llama-3.1-8B: 32 x 128 heads, 14,336 / 2)


def _worker(rank: int, port: int, rows_list: list[int], rounds: int, q) -> None:
    faulthandler.dump_traceback_later(280, exit=True)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from testbed.worker import tp_all_reduce as tar
    fused = tar.FusedAllReduceNorm(256, HIDDEN, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(rank)
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    out = []
    for name, k in SHAPES.items():
        ws = [torch.randn(HIDDEN, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5 for _ in range(LAYERS)]
        for t in rows_list:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, generator=g)
            res0 = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)

            def chain(way: str):
                r = res0
                for w in ws:
                    if way == "gemm":
                        r = F.linear(x, w) + r
                        continue
                    if way.startswith("push"):
                        fused.pdl = way == "push"
                        y = fused.gemm(x, w)
                    else:
                        y = F.linear(x, w)
                    _, r = fused(y, r, norm_w, EPS)
                return r

            ways = ["cublas", "push", "push_nopdl", "gemm"]
            graphs, outs = {}, {}
            for way in ways:
                fused.turn, fused.pushed = 0, None
                chain(way)  # warm-up: compiles
                torch.cuda.synchronize()
                dist.barrier()
                graph = torch.cuda.CUDAGraph()
                fused.turn, fused.pushed = 0, None
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    outs[way] = chain(way)
                graphs[way] = graph
            times = {w: [] for w in ways}
            for _ in range(rounds):
                for way in ways:
                    dist.barrier()
                    times[way].append(_time_ms(graphs[way].replay, 20) * 1e3 / LAYERS)
            ref = outs["cublas"].float()
            row = {"gemm": name, "tokens": t, **{f"{w}_us": statistics.median(v) for w, v in times.items()},
                   **{f"{w}_max_rel_diff": float((outs[w].float() - ref).abs().max() / ref.abs().max())
                      for w in ways if w.startswith("push")}}
            row["push_saving_us"] = row["cublas_us"] - row["push_us"]
            out.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        q.put({"gpu": torch.cuda.get_device_name(), "rounds": rounds, "rows": out})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="gemm_push.json")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    res = on_two_ranks(_worker, [int(r) for r in args.rows.split(",")], args.rounds)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
