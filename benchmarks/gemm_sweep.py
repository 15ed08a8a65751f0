"""cuBLAS (F.linear; also under cuBLASLt) against a Triton split-K GEMM swept over tile shapes, on Llama-3.1-8B's
per-rank GEMMs at TP=1 and TP=2, at decode sizes (M = 1 and 64 tokens), on one GPU.

  python benchmarks/gemm_sweep.py        (writes $OUT/skinny.json, default /tmp)

Each GEMM runs over 8 distinct weights (none stays in L2) inside a CUDA graph, median of 5 rounds of 20 replays;
a Triton configuration (BLOCK_N, BLOCK_K, split, stages, warps) counts only if its result is within 2% of cuBLAS's.
Prints µs and TB/s of weight read per GEMM: how far below the HBM roofline the smaller TP=2 shapes run, and
which kernel is fastest where (kernels/gemm_push.py takes the best TP=2 tile found here).
"""
import itertools
import json
import os

import torch, triton, triton.language as tl
import torch.nn.functional as F

from tp_gemms import graph_time, shapes  # benchmarks/tp_gemms.py

dev = torch.device("cuda")
L = 8  # distinct weights a GEMM cycles through


@triton.jit
def _gemm(A, W, C, P, M, N, K, k_per, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k0 = pid_k * k_per
    for k in range(k0, k0 + k_per, BK):
        rk = k + tl.arange(0, BK)
        a = tl.load(A + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(W + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(a, tl.trans(w))
    if SPLIT == 1:
        tl.store(C + rm[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        tl.store(P + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _reduce(P, C, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * MN + i, mask=i < MN, other=0.0)
    tl.store(C + i, acc.to(C.dtype.element_ty), mask=i < MN)


def gemm(a, w, cfg, c, p):
    BN, BK, SPLIT, stages, warps = cfg
    M, K = a.shape
    N = w.shape[0]
    k_per = triton.cdiv(triton.cdiv(K, SPLIT), BK) * BK
    _gemm[(triton.cdiv(N, BN), SPLIT)](a, w, c, p, M, N, K, k_per, BM=max(16, triton.next_power_of_2(M)), BN=BN, BK=BK,
                                       SPLIT=SPLIT, num_stages=stages, num_warps=warps)
    if SPLIT > 1:
        _reduce[(triton.cdiv(M * N, 1024),)](p, c, M * N, SPLIT=SPLIT, BLOCK=1024)


def main() -> None:
    # (BLOCK_N, BLOCK_K, split, stages, warps)
    cfgs = [*itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 3, 4, 8), (3, 4), (4,)),
            *[(128, 128, s, 3, 8) for s in (1, 2, 4)]]
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for tp in (1, 2):
        for name, (N, K) in shapes(tp).items():
            Ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
            for M in (1, 64):
                a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                p = torch.empty(8, M, N, device=dev, dtype=torch.float32)
                t_cub = graph_time(lambda: [F.linear(a, w) for w in Ws]) / L
                torch.backends.cuda.preferred_blas_library("cublaslt")
                t_lt = graph_time(lambda: [F.linear(a, w) for w in Ws]) / L
                torch.backends.cuda.preferred_blas_library("cublas")
                ref = F.linear(a, Ws[0]).float()
                best = None
                for cfg in cfgs:
                    try:
                        gemm(a, Ws[0], cfg, c, p)
                        err = (c.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
                        if err > 2e-2:
                            continue
                        t = graph_time(lambda: [gemm(a, w, cfg, c, p) for w in Ws]) / L
                    except Exception:  # a tile that does not fit the GPU's shared memory
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                bytes_ = N * K * 2
                row = {"tp": tp, "gemm": name, "M": M, "cublas_us": t_cub * 1e3, "cublas_TBps": bytes_ / t_cub / 1e9,
                       "cublaslt_TBps": bytes_ / t_lt / 1e9, "triton_us": best[0] * 1e3 if best else None,
                       "triton_TBps": bytes_ / best[0] / 1e9 if best else None, "cfg": best[1] if best else None}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "skinny.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
