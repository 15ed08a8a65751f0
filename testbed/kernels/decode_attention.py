"""Triton paged decode attention with split-K (flash-decoding), GQA-aware.

One program = (sequence, KV head, split): it loads each K/V tile of its share of the sequence once
for all query heads of the KV head's group (padded to >= 16 rows for tl.dot), keeps an online
softmax in fp32 and writes either the final output (one split) or a normalised partial output plus
its log-sum-exp; a reduce kernel then combines the splits. Splits are fixed per launch (so CUDA
graphs can capture it) and each sequence's tiles are divided among them from its own seq_len.
`attend_tile` is shared with the prefill kernel.

Split launches load each program's block-table entries into registers once, before the loop (when they
span at most MAX_BT_WIDTH entries): with no block-table load inside the loop, Triton's pipeliner keeps
num_stages - 1 K/V tiles in flight. With the load in the loop it gives the load stages of its own (sm_90
TTGIR of Triton 3.6: 1 K/V buffer at 4 stages, 2 at 6).

On Hopper both kernels of a split launch are programmatic dependent launches: the split kernel reads
only seq_lens and the block table (both written before the step's first kernel) before `gdc_wait`, so
its launch and start-up overlap the previous kernel's tail; the reduce starts while the split kernel
runs and waits for it.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from testbed.kernels.reference import check_cache, check_heads

LOG2E = 1.4426950408889634
MAX_BT_WIDTH = 128  # block-table entries a split program may hold in registers (1 x 131072 on H200 takes 128;
# 256, which 2 x 131072 would take, faulted with an illegal address on H200, Triton 3.6)


@triton.jit
def attend_tile(q, acc, l_i, m_i, K, V, bt_row, start, q_pos, kv_head_off_k, kv_head_off_v,
                stride_kb, stride_kp, stride_vb, stride_vp, offs_d, mask_d, qk_scale,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                FP32_DOT: tl.constexpr, bt_vec=0, bt_first=0, BT_WIDTH: tl.constexpr = 0):
    """Fold keys [start, start+BLOCK_N) into the online softmax (base 2) of rows q; key j is visible iff j <= q_pos.

    q_pos must be < seq_len, so no key past the sequence is read. Cache block ids are gathered per key
    from the block table, so BLOCK_N is independent of the cache block size: loaded from bt_row, or with
    BT_WIDTH > 0 taken from bt_vec, which holds the row's entries bt_first .. bt_first + BT_WIDTH - 1 (they
    must cover every key of the tile, masked ones too). With CAUSAL False every key of the tile must be
    visible to every row (no masks at all when EVEN_D: head_dim == BLOCK_D).
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    pos = (offs_n % PAGE).to(tl.int64)
    if CAUSAL:
        in_range = offs_n <= tl.max(q_pos, 0)
    if BT_WIDTH > 0:
        blk = tl.gather(bt_vec, offs_n // PAGE - bt_first, 0).to(tl.int64)
    elif CAUSAL:
        blk = tl.load(bt_row + offs_n // PAGE, mask=in_range, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    k_ptrs = K + kv_head_off_k + blk[:, None] * stride_kb + pos[:, None] * stride_kp + offs_d[None, :]
    v_ptrs = V + kv_head_off_v + blk[:, None] * stride_vb + pos[:, None] * stride_vp + offs_d[None, :]
    if CAUSAL:
        kv_mask = in_range[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per step outside CUDA graphs
def _decode_kernel(Q, K, V, BlockTables, SeqLens, Out, MidO, MidLse, qk_scale, num_heads, num_splits,
                   stride_qs, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                   stride_bt, stride_os, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
                   PDL: tl.constexpr, BT_WIDTH: tl.constexpr):
    if PDL:  # let the reduce kernel launch now; it waits (gdc_wait) until this grid has finished and flushed
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    bt_first = tile_lo * BLOCK_N // PAGE
    bt_vec = 0
    if BT_WIDTH > 0:  # this split's block ids (the wrapper checked that BT_WIDTH entries cover its tiles)
        offs_p = bt_first + tl.arange(0, BT_WIDTH)
        bt_vec = tl.load(bt_row + offs_p, mask=offs_p < tl.cdiv(seq_len, PAGE), other=0)
    if PDL:  # everything below may read what the previous kernel wrote (q, and the cache through its store)
        tl.extra.cuda.gdc_wait()

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_mask = mask_g[:, None] & mask_d[None, :]
    q = tl.load(Q + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + seq_len - 1
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_lo, tile_hi):
        acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, K, V, bt_row, tile * BLOCK_N, q_pos, kv_head * stride_kh,
                                    kv_head * stride_vh, stride_kb, stride_kp, stride_vb, stride_vp, offs_d,
                                    mask_d, qk_scale, PAGE, BLOCK_N, True, HEAD_DIM == BLOCK_D, FP32_DOT,
                                    bt_vec, bt_first, BT_WIDTH)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        row = (seq * num_heads + heads).to(tl.int64) * num_splits + split
        tl.store(MidO + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MidLse + row, lse, mask=mask_g)
    else:
        tl.store(Out + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=q_mask)


@triton.jit
def _reduce_kernel(MidO, MidLse, Out, num_heads, num_splits, stride_os, stride_oh,
                   HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program = (sequence, head, BLOCK_D slice of head_dim); it runs right after the split kernel, so
    only latency counts: the partial outputs are loaded before the log-sum-exps, so both loads are in flight
    at once (loading them after the max had put a second round trip on the critical path)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    row = (seq * num_heads + head).to(tl.int64) * num_splits + offs_s
    o = tl.load(MidO + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    lse = tl.load(MidLse + row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0))
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(Out + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def interpreting() -> bool:
    """True under the Triton CPU interpreter (there, dots run in fp32: its bf16 arithmetic is not exact)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA compute capability 9.0+ (never under the interpreter)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence so that about 2x the SM count programs run; a power of 2, from shapes only."""
    return num_splits_for(num_seqs, num_kv_heads, max_context, block_n, sm_count(device))


def num_splits_for(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, sms: int) -> int:
    """choose_num_splits on a GPU of `sms` streaming multiprocessors (no device needed: for analyses)."""
    programs = num_seqs * num_kv_heads
    target = 2 * sms
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs), triton.cdiv(max_context, block_n), 256)
    return triton.next_power_of_2(max(splits, 1))


def split_edges(num_kv_heads: int, sms: int, max_seqs: int, block_n: int = 64) -> list[int]:
    """Both ends of every run of batch sizes, 1 to max_seqs, that the kernel splits alike at a long context (its
    programs per sequence change between runs, and with them how far one long row's extra keys delay the whole
    step): the batch sizes a profile's uneven-context table is measured at, so that no lookup interpolates across
    a change of split (at 8 KV heads on 132 SMs: 2 splits from 17 to 32 rows, 1 from 33)."""
    edges, last = {max_seqs}, None
    for b in range(1, max_seqs + 1):
        splits = num_splits_for(b, num_kv_heads, 1 << 20, block_n, sms)
        if splits != last:
            edges.update((b - 1, b) if b > 1 else (b,))
            last = splits
    return sorted(edges)


def split_bt_width(max_blocks: int, page: int, block_n: int, num_splits: int) -> int:
    """Block-table entries (a power of 2) that cover any split's tiles, from the table's width alone."""
    tiles = triton.cdiv(triton.cdiv(max_blocks * page, block_n), num_splits)
    return triton.next_power_of_2(triton.cdiv(tiles * block_n, page) + (block_n % page != 0))


def default_tiles(head_dim: int, split: bool, bt_in_registers: bool) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) measured fastest on H200 (bf16, GQA 4, block size 16); see the wrapper."""
    if not split:
        return (64, 2, 2) if head_dim <= 64 else (64, 4, 3)
    if bt_in_registers:
        return (32, 2, 3) if head_dim <= 64 else (16, 1, 4)
    return (64, 2, 2) if head_dim <= 64 else (32, 2, 6)


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, num_seqs: int, where: str) -> None:
    """Shape/dtype/device checks shared by the Triton wrappers (no device sync)."""
    check_cache(k_cache, v_cache)
    check_heads(q, k_cache)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"{where}: block_tables {tuple(block_tables.shape)} must be [num_seqs={num_seqs}, max_blocks] "
                         f"and seq_lens {tuple(seq_lens.shape)} [num_seqs]")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError(f"{where}: block_tables and seq_lens must be int32, got {block_tables.dtype}/{seq_lens.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError(f"{where}: k_cache/v_cache/block_tables must be contiguous in their last dim")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"{where}: all tensors must be on one device, got {devices}")


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  num_splits: int | None = None, *, block_n: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  pdl: bool | None = None) -> torch.Tensor:
    """Triton version of `paged_decode_attention_ref`; block_n keys per loop iteration, tunable launch knobs.

    Defaults (`default_tiles`) from sweeps on H200 (bf16, GQA 4, block size 16, `benchmarks/RESULTS.md`):
    - no split: head_dim <= 64 takes 64 keys, 2 warps and 2 stages (batch 256: -6% time at 384 tokens of
      context, -11% at 1,152, against 4 warps); head_dim 128 takes 64 keys, 4 warps and 3 stages (64 x 4096:
      -4.5% against 2 stages);
    - split, block ids in registers (a split spans at most MAX_BT_WIDTH table entries): head_dim <= 64 takes
      32 keys, 2 warps and 3 stages, head_dim 128 16 keys, 1 warp and 4 stages (705d249: 1 x 32768 -4.4%,
      1 x 8192 at head_dim 64 -15% against the in-loop block-table load with its own best tiles);
    - split, wider spans (block ids loaded per tile, as before 705d249): 64 keys / 2 warps / 2 stages up to
      head_dim 64, else 32 keys / 2 warps / 6 stages.
    Splits are chosen for 64-key tiles either way.

    pdl: programmatic dependent launches for a split launch (Hopper+, None: when supported; see the module
    docstring). With num_splits > 1 a second kernel combines the splits (measured faster on H100 than letting
    the last split program of each group combine them: that serial tail cost more than the extra launch).
    """
    num_seqs, num_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, "paged_decode_attention")
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * page, block_n or 64, q.device)
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    pdl = split and (supports_pdl(q.device) if pdl is None else pdl)  # only split launches chain two kernels
    # the span for the tiles that a split with its block ids in registers takes (block_n as given, or its default)
    bt_width = split_bt_width(block_tables.shape[1], page, block_n or default_tiles(head_dim, True, True)[0],
                              num_splits) if split else 0
    bt_width = bt_width if bt_width <= MAX_BT_WIDTH else 0
    block_n, num_warps, num_stages = (default if given is None else given for given, default in zip(
        (block_n, num_warps, num_stages), default_tiles(head_dim, split, bt_width > 0)))
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    mid_o = torch.empty((num_seqs, num_heads, num_splits, head_dim) if split else (1,), dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty((num_seqs, num_heads, num_splits) if split else (1,), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse, scale * LOG2E, num_heads, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT=split, FP32_DOT=q.dtype == torch.float32 or interpreting(), PDL=pdl,
        BT_WIDTH=bt_width, num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}))
    if split:
        # Slices of 32 of head_dim with one warp per 64 splits (1 x 32768 on H200: 1.0 us less than one
        # program per head with 4 warps, which also loaded the partials only after the max).
        block_s = triton.next_power_of_2(num_splits)
        red_d = min(32, block_d)
        _reduce_kernel[(num_seqs, num_heads, triton.cdiv(head_dim, red_d))](
            mid_o, mid_lse, out, num_heads, num_splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            BLOCK_S=block_s, BLOCK_D=red_d, PDL=pdl, num_warps=max(1, min(4, block_s // 64)),
            **({"launch_pdl": True} if pdl else {}))
    return out
