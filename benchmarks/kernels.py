"""GPU benchmark of the Triton kernels: copy bandwidth, paged decode attention, paged prefill vs SDPA.

    python benchmarks/kernels.py --out results.json [--quick] [--sweep {decode,prefill,all}] [--no-check]

(1) device copy bandwidth (bytes read + written / time of a large copy_); (2) paged decode attention
(bf16, 32 query / 8 KV heads, head_dim 128, block_size 16, shuffled block tables): time (CUDA-graph
replay, median), effective bandwidth = KV bytes read / time and its fraction of the copy bandwidth, and
of a copy moving the same bytes timed the same way (the floor for a kernel of that size);
(3) paged prefill attention vs torch SDPA(is_causal=True) on the same (unpaged for SDPA) shapes, the two
timed in alternating chunks (`paired_ms`) so that both see the same clocks as the GPU warms.
Correctness is checked against the torch reference / SDPA. --sweep also tries tile / warp / stage
settings and reports the fastest, to pick defaults for a new GPU.
"""

import argparse
import datetime
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from testbed.kernels import (paged_decode_attention_ref, paged_prefill_attention_ref, store_kvcache,  # noqa: E402
                             store_kvcache_ref)
from testbed.kernels.decode_attention import choose_num_splits, paged_decode_attention_triton  # noqa: E402
from testbed.kernels.prefill_attention import paged_prefill_attention_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16


def time_ms(fn, reps: int, warmup: int = 5, graph: bool = False) -> float:
    """Median milliseconds of fn over reps, timed with CUDA events (optionally as a replayed CUDA graph).

    fn may be a list of calls: they run in sequence (captured into one graph) and the time is per call,
    as Triton's do_bench_cudagraph measures short kernels without the graph's own launch cost."""
    calls = fn if isinstance(fn, list) else [fn]

    def fn():
        for c in calls:
            c()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        fn = g.replay
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / len(calls)


def paired_ms(a, b, reps: int, rounds: int = 15) -> tuple[float, float]:
    """Median milliseconds of a and of b, timed in alternating chunks of reps calls. A compute-bound kernel's
    time drifts as the GPU warms (SDPA at 1 x 8192 on H200: 0.88, then 1.01 ms a second later), so timing one
    after the other favours whichever ran first; alternating gives both the same clocks."""
    times = [(time_ms(a, reps), time_ms(b, reps)) for _ in range(rounds)]
    return statistics.median(t for t, _ in times), statistics.median(t for _, t in times)


def sized_copy_gbs(nbytes: int, reps: int, copies: int = 3, rounds: int = 4) -> float:
    """Bandwidth (read + write) of copies of nbytes / 2 bytes, `copies` buffers in turn `rounds` times, launched
    back to back: the floor for a kernel that moves nbytes once, fixed costs included. (Not in a CUDA graph: a
    captured copy_ becomes a memcpy node, which ran at 2.8 TB/s on H200 where the copy kernel runs at 4.3.)"""
    n = nbytes // 2
    bufs = [(torch.empty(n, dtype=torch.uint8, device="cuda").random_(), torch.empty(n, dtype=torch.uint8,
                                                                                      device="cuda"))
            for _ in range(copies)]
    ms = time_ms([lambda s=s, d=d: d.copy_(s) for s, d in bufs] * rounds, reps)
    return 2 * n / (ms * 1e-3) / 1e9


def copy_bandwidth(gib: float, reps: int) -> float:
    """Device copy bandwidth in GB/s, counting bytes read + written, of one large copy (gib GiB copied)."""
    return sized_copy_gbs(2 * int(gib * 2**30), reps, copies=1, rounds=1)


def paged_cache(seq_lens: list[int], seed: int = 0):
    """Random bf16 paged K/V caches holding seq_lens tokens in shuffled blocks; returns caches and block tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [triton.cdiv(n, BLOCK_SIZE) for n in seq_lens]
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    perm = torch.randperm(sum(blocks), device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    return k_cache, v_cache, tables


def check_correctness() -> list[dict]:
    """Triton vs torch reference on the GPU over GQA ratios, dtypes, head dims, cache block sizes and splits."""
    tol = {torch.float32: 5e-3, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # fp32 dots run as TF32 on the GPU
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    configs = [(g, dt, 128, 16) for g in (1, 3, 4, 8) for dt in (torch.float16, torch.bfloat16, torch.float32)]
    configs += [(1, torch.float16, 64, 32), (3, torch.bfloat16, 64, 16), (4, torch.float16, 80, 16)]
    for group, dtype, head_dim, page in configs:
        kv_heads, seq_lens, q_lens = 2, [1, 17, 300, 1029, 64], [1, 5, 300, 1, 64]
        blocks = [triton.cdiv(n, page) for n in seq_lens]
        num_blocks = sum(blocks) + 4
        shape = (num_blocks, page, kv_heads, head_dim)
        k_cache = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        v_cache = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        tables = torch.full((len(seq_lens), max(blocks) + 2), -1, dtype=torch.int32, device="cuda")
        for i, (n, start) in enumerate(zip(blocks, itertools.accumulate([0] + blocks))):
            tables[i, :n] = perm[start:start + n]
        tables[4, :2] = tables[3, :2]  # a shared prefix
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        heads, scale = kv_heads * group, head_dim ** -0.5
        q = torch.randn(len(seq_lens), heads, head_dim, device="cuda", generator=gen).to(dtype)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
        err = max((paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale, s).float() - ref.float())
                  .abs().max().item() for s in (None, 1, 7, 64))
        cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device="cuda")
        qp = torch.randn(sum(q_lens), heads, head_dim, device="cuda", generator=gen).to(dtype)
        # This step's keys/values (views of one fused tensor, like the model's qkv split), stored into the cache
        # at positions seq_len - q_len.. too, so the kernel (new keys from kn/vn) and the cache agree.
        fused = torch.randn(sum(q_lens), 2, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        kn, vn = fused[:, 0], fused[:, 1]
        pos = torch.cat([torch.arange(n - m, n, device="cuda") for n, m in zip(seq_lens, q_lens)])
        seq_of = torch.repeat_interleave(torch.arange(len(seq_lens), device="cuda"),
                                         torch.tensor(q_lens, device="cuda"))
        store_kvcache(kn, vn, k_cache, v_cache, tables.long()[seq_of, pos // page] * page + pos % page)
        ref = paged_prefill_attention_ref(qp, kn, vn, k_cache, v_cache, cu, lens, tables, scale)
        variants = [dict(block_m=64), dict(),  # defaults: TMA for the new keys on Hopper where the layout allows
                    dict(block_n=32 if dtype == torch.float32 else 128, num_stages=2, short_q=0, pack_gqa=False),
                    dict(pack_gqa=True, use_tma=False),  # (short_q=0: one launch for all; group 3 packs padded)
                    dict(short_q=64 // triton.next_power_of_2(group))]  # decode-like rows in a second launch
        err_p = max((paged_prefill_attention_triton(qp, kn, vn, k_cache, v_cache, cu, lens, tables, scale, **kw)
                     .float() - ref.float()).abs().max().item() for kw in variants)
        key = torch.randn(6, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        slots = torch.tensor([3, -1, 0, num_blocks * page - 1, -1, 40], device="cuda")
        k1, v1, k2, v2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        store_kvcache(key, key, k1, v1, slots)
        store_kvcache_ref(key, key, k2, v2, slots)
        store_ok = torch.equal(k1, k2) and torch.equal(v1, v2)
        ok = err <= tol[dtype] and err_p <= tol[dtype] and store_ok
        rows.append({"group": group, "dtype": str(dtype), "head_dim": head_dim, "block_size": page,
                     "decode_err": err, "prefill_err": err_p, "store_ok": store_ok, "ok": ok})
        if not ok:
            print(f"CORRECTNESS FAILURE: {rows[-1]}")
    print(f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} configurations match the references")
    return rows


def host_overhead_us(calls: int = 200) -> dict:
    """Host (Python + launch) microseconds per eager call on a tiny problem, where the GPU is never the bottleneck."""
    import time
    k_cache, v_cache, tables = paged_cache([16])
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    lens = torch.tensor([16], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    key = torch.randn(1, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.tensor([3], device="cuda")
    fns = {"store_kvcache": lambda: store_kvcache(key, key, k_cache, v_cache, slots),
           "decode_1split": lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 1.0, 1),
           "decode_4splits": lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 1.0, 4),
           "prefill": lambda: paged_prefill_attention_triton(q, key, key, k_cache, v_cache, cu, lens, tables, 1.0)}
    res = {}
    for name, fn in fns.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        res[name] = (time.perf_counter() - t0) / calls * 1e6
    return res


def bench_decode(batch: int, context: int, copy_gbs: float, reps: int, sweep: bool, copies: int = 3,
                 rounds: int = 4) -> dict:
    """Decode attention over `copies` distinct KV caches, called in turn `rounds` times inside one CUDA graph
    (so no call finds its cache in L2 and the graph's launch cost is spread over copies x rounds calls).
    Also against a copy that moves the same bytes, timed the same way (`sized_copy_gbs`).

    The caches are allocated from fresh device memory (empty_cache first), as in a fresh process: carved from the
    blocks that the previous shape's caches left in torch's allocator, the same 1 x 32768 kernel measured 41.8
    instead of 38.0 us per call on H200 (commit 45ea4ba, `benchmarks/results/2026-11-21_45ea4ba/placement.log`)."""
    torch.cuda.empty_cache()
    caches = [paged_cache([context] * batch, seed=c) for c in range(copies)]
    k_cache, v_cache, tables = caches[0]
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()

    def one(cache, **kw):
        return lambda: paged_decode_attention_triton(q, *cache, lens, scale, **kw)

    def run(**kw):
        return [one(c, **kw) for c in caches] * rounds

    ref = paged_decode_attention_ref(q[:2], k_cache, v_cache, tables[:2], lens[:2], scale)
    err = (one(caches[0])()[:2].float() - ref.float()).abs().max().item()
    err_1split = (one(caches[0], num_splits=1)()[:2].float() - ref.float()).abs().max().item()
    ms = time_ms(run(), reps, graph=True)
    single_ms = time_ms(one(caches[0]), reps, graph=True)
    eager_ms = time_ms(one(caches[0]), reps)
    splits = choose_num_splits(batch, KV_HEADS, tables.shape[1] * BLOCK_SIZE, 64, q.device)
    res = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "auto_num_splits": splits, "time_us": ms * 1e3,
           "single_graph_time_us": single_ms * 1e3, "eager_time_us": eager_ms * 1e3, "timing": (
               f"per call, {copies} KV caches x {rounds} rounds in one CUDA graph"),
           "eff_bw_gbs": kv_bytes / (ms * 1e-3) / 1e9, "max_abs_err": err, "max_abs_err_1split": err_1split}
    res["frac_of_copy_bw"] = res["eff_bw_gbs"] / copy_gbs
    res["sized_copy_gbs"] = sized_copy_gbs(kv_bytes, reps, copies, rounds)
    res["frac_of_sized_copy_bw"] = res["eff_bw_gbs"] / res["sized_copy_gbs"]
    if sweep:
        trials = []
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        # Split counts: powers of 2 and multiples of the SM count per KV head (whole waves of programs).
        split_opts = [None] if batch * KV_HEADS >= 2 * sms else sorted(
            {16, 32, 64, 128} | {max(1, round(k * sms / (batch * KV_HEADS))) for k in (1, 2, 3, 4)})
        for block_n, warps, stages in itertools.product([32, 64, 128], [4, 8], [2, 3, 4]):
            for splits in split_opts:
                try:
                    t = time_ms(run(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages), reps,
                                graph=True)
                except Exception as e:  # e.g. out of shared memory for a large tile
                    print(f"  decode sweep skip block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}")
                    break
                trials.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "num_splits": splits,
                               "time_us": t * 1e3, "eff_bw_gbs": kv_bytes / (t * 1e-3) / 1e9,
                               "frac_of_copy_bw": kv_bytes / (t * 1e-3) / 1e9 / copy_gbs})
        res["sweep_best"] = min(trials, key=lambda r: r["time_us"])
        res["sweep_top"] = sorted(trials, key=lambda r: r["time_us"])[:8]
        res["sweep"] = trials
    return res


def bench_prefill(batch: int, length: int, reps: int, sweep: bool) -> dict:
    k_cache, v_cache, tables = paged_cache([length] * batch, seed=1)
    total = batch * length
    q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    pos = torch.arange(length, device="cuda")
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    store_kvcache(k, v, k_cache, v_cache, slots)
    cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    group = HEADS // KV_HEADS
    qs = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
    ks = k.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(group, 1).contiguous()
    vs = v.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(group, 1).contiguous()
    qs = qs.contiguous()

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    def run(**kw):
        return lambda: paged_prefill_attention_triton(q, k, v, k_cache, v_cache, cu, lens, tables, scale, **kw)

    expect = sdpa().transpose(1, 2).reshape(total, HEADS, HEAD_DIM)
    err = (run()().float() - expect.float()).abs().max().item()
    sdpa_ms, ms = paired_ms(sdpa, run(), max(reps // 3, 3))
    flops = 4 * batch * HEADS * HEAD_DIM * length * (length + 1) / 2  # causal: ~half the score matrix
    res = {"batch": batch, "length": length, "time_ms": ms, "sdpa_time_ms": sdpa_ms, "ratio_vs_sdpa": ms / sdpa_ms,
           "tflops": flops / (ms * 1e-3) / 1e12, "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
           "max_abs_err_vs_sdpa": err}
    if sweep:
        trials = []

        def trial(**kw):
            try:
                s_ms, t = paired_ms(sdpa, run(**kw), max(reps // 3, 3), rounds=5)
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  prefill sweep skip {kw}: {type(e).__name__}")
                return
            trials.append({**kw, "time_ms": t, "ratio_vs_sdpa": t / s_ms, "tflops": flops / (t * 1e-3) / 1e12})

        for bm, bn, warps, stages in itertools.product([64, 128], [64, 128], [4, 8], [2, 3, 4]):
            trial(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        # the best tiles again with one program per query head instead of GQA packing, and with pointer loads
        for best in sorted(trials, key=lambda r: r["time_ms"])[:4]:
            knobs = {key: best[key] for key in ("block_m", "block_n", "num_warps", "num_stages")}
            trial(**knobs, pack_gqa=False)
            trial(**knobs, use_tma=False)
        res["sweep_best"] = min(trials, key=lambda r: r["time_ms"])
        res["sweep_top"] = sorted(trials, key=lambda r: r["time_ms"])[:8]
        res["sweep"] = trials
    return res


def print_table(header: str, rows: list[dict], line) -> None:
    """One results table: the header, `line(row)` per row, and each row's sweep winner when it was swept."""
    print("\n" + header)
    for r in rows:
        print(line(r))
        if "sweep_best" in r:
            print(f"{'':>20} best: {r['sweep_best']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kernel_results.json", help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="small shapes and few repetitions (smoke run)")
    parser.add_argument("--sweep", choices=["none", "decode", "prefill", "all"], default="none",
                        help="also sweep tile sizes / num_warps / num_stages (and num_splits for decode)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (default 30)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness grid vs the references")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU (the kernels' CPU path is the torch reference)")
    reps = args.reps or (5 if args.quick else 30)
    decode_shapes = [(8, 1024), (1, 4096)] if args.quick else [(64, 4096), (1, 32768)]
    prefill_shapes = [(2, 512), (1, 1024)] if args.quick else [(4, 2048), (1, 8192)]

    checks = [] if args.no_check else check_correctness()
    overhead = host_overhead_us()
    print("host overhead per eager call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items()))
    copy_gbs = copy_bandwidth(0.25 if args.quick else 1.0, reps)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    decode = [bench_decode(b, n, copy_gbs, reps, args.sweep in ('decode', 'all')) for b, n in decode_shapes]
    prefill = [bench_prefill(b, n, reps, args.sweep in ('prefill', 'all')) for b, n in prefill_shapes]

    print_table(f"{'decode batch x ctx':>20} {'time us':>9} {'1-graph':>9} {'GB/s':>7} {'% copy':>7} {'% same-size copy':>17} "
                f"{'max err':>9}",
                decode, lambda r: f"{r['batch']:>9} x {r['context']:<8} {r['time_us']:9.1f} "
                                  f"{r['single_graph_time_us']:9.1f} {r['eff_bw_gbs']:7.0f} "
                                  f"{100 * r['frac_of_copy_bw']:6.1f}% {100 * r['frac_of_sized_copy_bw']:8.1f}% of "
                                  f"{r['sized_copy_gbs']:4.0f} {r['max_abs_err']:9.2e}")
    print_table(f"{'prefill batch x len':>20} {'ours ms':>9} {'SDPA ms':>9} {'ratio':>6} {'TFLOP/s':>8} {'max err':>9}",
                prefill, lambda r: f"{r['batch']:>9} x {r['length']:<8} {r['time_ms']:9.3f} {r['sdpa_time_ms']:9.3f} "
                                   f"{r['ratio_vs_sdpa']:6.3f} {r['tflops']:8.1f} {r['max_abs_err_vs_sdpa']:9.2e}")

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "quick": args.quick,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                        "dtype": str(DTYPE)},
              "correctness_ok": all(r["ok"] for r in checks), "correctness": checks, "host_overhead_us": overhead,
              "copy_bw_gbs": copy_gbs, "decode": decode, "prefill": prefill}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
