"""Triton paged prefill/extend attention (chunked prefill, prefix-cache hits, mixed q_len == 1 rows).

Extend design (as SGLang's extend attention / FlashAttention varlen): sequence i's queries are its last
q_len tokens; its keys are the cached prefix, positions < ctx = seq_len - q_len (read from the paged
cache by per-key block-table gathers, visible to every query, so only the bound at ctx is masked), then
this step's new tokens, read from the contiguous new k / v tensors [num_tokens, num_kv_heads, head_dim]
(rows cu_seqlens_q[i]..): through TMA tensor descriptors when the layout allows it (Hopper, or the
interpreter), else through pointer loads. New-key tiles below the query tile are loaded and folded with
no mask at all; only the diagonal tiles get the causal mask (the "two stage" loop of the Triton tutorial).
Online softmax in base 2, fp32 accumulation.

One or two launches of one kernel, with no host sync (grids depend only on total tokens and num_seqs,
so CUDA graphs can capture them):
- long: one program per (tile of BLOCK_Q queries of one sequence, query head) -- the FlashAttention
  layout. Sequence i owns program ids [cu_q[i] // BLOCK_Q + i, cu_q[i+1] // BLOCK_Q + i + 1), found by a
  binary search; surplus ids exit. Ids are taken in reverse so the heaviest (last, most causal keys)
  tiles of each sequence start first. With pack_gqa a tile instead packs BLOCK_Q queries x the KV
  head's group of query heads (one program per KV head).
- short (only where the long launch is not GQA-packed): one program per (sequence, KV head) for
  sequences with q_len <= short_q (decode rows mixed into a prefill step), GQA-packed, so the group
  shares each K/V tile and a 1-token row does not pay for a full tile per query head. Each launch skips
  the other's sequences. A packed long launch already has that layout, so it takes every row itself.
"""

import functools

import torch
import triton
import triton.language as tl

from testbed.kernels.decode_attention import LOG2E, attend_tile, check_paged_args, interpreting

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None


@triton.jit
def _load_new_tile(New, row0, start, col, stride_t, q_len, offs_d, mask_d, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr, USE_TMA: tl.constexpr, EVEN_D: tl.constexpr, FP32_DOT: tl.constexpr):
    """Rows [start, start+BLOCK_N) of this step's new K or V (a descriptor with USE_TMA, else pointers whose
    rows past q_len read 0 when MASKED), upcast to fp32 for FP32_DOT."""
    if USE_TMA:
        x = New.load([row0 + start, col])
    else:
        offs_n = start + tl.arange(0, BLOCK_N)
        ptrs = New + (row0 + offs_n).to(tl.int64)[:, None] * stride_t + col + offs_d[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=(offs_n < q_len)[:, None] & mask_d[None, :], other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    if FP32_DOT:
        x = x.to(tl.float32)
    return x


@triton.jit
def _new_keys_tile(q, acc, l_i, m_i, KNew, VNew, row0, start, col_k, col_v, stride_kt, stride_vt, q_rel, q_len,
                   offs_d, mask_d, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                   EVEN_D: tl.constexpr, FP32_DOT: tl.constexpr):
    """Fold new keys [start, start+BLOCK_N) (indices within the sequence's q_len new tokens, at token rows
    row0 + index of KNew/VNew) into the online softmax of rows q.

    MASKED False: every key of the tile must be visible to every row (no masks at all). MASKED True: key j
    is visible to row r iff j <= q_rel[r] (q_rel < q_len). With USE_TMA, KNew/VNew are 2-D descriptors
    [num_tokens, num_kv_heads * head_dim] (block [BLOCK_N, head_dim], head_dim == BLOCK_D) and col_k/col_v
    the head's column; else pointers, col_k/col_v the head's element offset.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    k = _load_new_tile(KNew, row0, start, col_k, stride_kt, q_len, offs_d, mask_d, BLOCK_N, MASKED, USE_TMA, EVEN_D,
                       FP32_DOT)
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(offs_n[None, :] <= q_rel[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # With TMA, rows of a diagonal tile past the sequence are the next sequence's tokens (finite values) or
    # TMA's zero fill: their p is exactly 0, so they are not masked (a tl.where here cost 2-4% on H200).
    v = _load_new_tile(VNew, row0, start, col_v, stride_vt, q_len, offs_d, mask_d, BLOCK_N, MASKED, USE_TMA, EVEN_D,
                       FP32_DOT)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


# The block-table width is not specialised (Triton compiles a variant per int arg == 1 or divisible by 16,
# and the width follows the step's longest sequence); num_seqs is (== 1 makes single prompts 12% faster),
# and `warm_up_prefill_variants` compiles its classes at start-up instead of mid-serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q, KNew, VNew, KCache, VCache, Out, CuSeqlensQ, SeqLens, BlockTables, NumLive, qk_scale, num_seqs,
                    short_q, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kb, stride_kp, stride_kch, stride_vb, stride_vp, stride_vch, stride_bt,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, G_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SHORT: tl.constexpr,
                    USE_TMA: tl.constexpr, FP32_DOT: tl.constexpr, LIVE: tl.constexpr):
    # Rows of a tile: BLOCK_Q queries x G_ROWS heads (G_ROWS 1: program axis 1 is the query head; else it is
    # the KV head and its GROUP query heads, padded to G_ROWS, share the tile).
    BLOCK_M: tl.constexpr = BLOCK_Q * G_ROWS
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    if SHORT:  # one program per sequence, all its <= short_q <= BLOCK_Q queries in one tile
        seq = tl.program_id(0)
        q_begin = tl.load(CuSeqlensQ + seq)
        q_len = tl.load(CuSeqlensQ + seq + 1) - q_begin
        seq_len = tl.load(SeqLens + seq)
        q_start = q_len * 0
        skip = q_len > short_q
    else:
        tile_id = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest tiles first
        n_seqs = num_seqs
        if LIVE:  # only the first *NumLive sequences have queries: the tiles past theirs exit at once
            n_seqs = tl.load(NumLive)
            if tile_id >= tl.load(CuSeqlensQ + n_seqs) // BLOCK_Q + n_seqs:
                return
        # Binary search: the largest seq with cu_q[seq] // BLOCK_Q + seq <= tile_id (strictly increasing in seq;
        # seq 0 starts at 0). (Loading all of cu_seqlens_q at once instead measured slower on H200.)
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + n_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = tl.load(CuSeqlensQ + mid) // BLOCK_Q + mid <= tile_id
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        seq = lo
        q_begin = tl.load(CuSeqlensQ + seq)
        q_len = tl.load(CuSeqlensQ + seq + 1) - q_begin
        seq_len = tl.load(SeqLens + seq)
        q_start = (tile_id - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
        skip = q_len <= short_q  # the short launch does it
    if skip | (q_start >= q_len):
        return
    ctx = seq_len - q_len  # cached prefix length = absolute position of the sequence's first query

    head_id = tl.program_id(1)
    if G_ROWS == 1:
        kv_head = head_id // GROUP
        head_base = head_id
    else:
        kv_head = head_id
        head_base = head_id * GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    qi = q_start + offs_m // G_ROWS  # query index within the sequence's new tokens
    g = offs_m % G_ROWS
    row_mask = (qi < q_len) & (g < GROUP)
    io_mask = row_mask[:, None] & mask_d[None, :]
    tok = (q_begin + qi).to(tl.int64)
    heads = head_base + g
    q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) cached prefix [0, ctx) from the paged cache: every row sees all of it. The runtime branch skips the
    # loops' pipeline prologue for fresh prompts (H200, 4 x 2048: 0.314 ms with it, 0.346 ms without).
    if ctx > 0:
        bt_row = BlockTables + seq.to(tl.int64) * stride_bt
        off_kc = kv_head * stride_kch
        off_vc = kv_head * stride_vch
        last_ctx = tl.zeros([BLOCK_M], tl.int32) + (ctx - 1)
        pre_full = ctx // BLOCK_N
        for tile in range(0, pre_full):
            acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, KCache, VCache, bt_row, tile * BLOCK_N, last_ctx, off_kc,
                                        off_vc, stride_kb, stride_kp, stride_vb, stride_vp, offs_d, mask_d, qk_scale,
                                        PAGE, BLOCK_N, False, EVEN_D, FP32_DOT)
        for tile in range(pre_full, tl.cdiv(ctx, BLOCK_N)):  # the partial tile at ctx (0 or 1 iteration)
            acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, KCache, VCache, bt_row, tile * BLOCK_N, last_ctx, off_kc,
                                        off_vc, stride_kb, stride_kp, stride_vb, stride_vp, offs_d, mask_d, qk_scale,
                                        PAGE, BLOCK_N, True, EVEN_D, FP32_DOT)

    # 2) this step's keys from KNew/VNew: tiles below the query tile unmasked, then the diagonal tile(s).
    if USE_TMA:
        col_k = kv_head * HEAD_DIM
        col_v = kv_head * HEAD_DIM
    else:
        col_k = kv_head * stride_kh
        col_v = kv_head * stride_vh
    q_rel = tl.minimum(qi, q_len - 1)  # padding rows act as the last query: no key past the sequence
    new_full = q_start // BLOCK_N
    for tile in range(0, new_full):
        acc, l_i, m_i = _new_keys_tile(q, acc, l_i, m_i, KNew, VNew, q_begin, tile * BLOCK_N, col_k, col_v,
                                       stride_kt, stride_vt, q_rel, q_len, offs_d, mask_d, qk_scale,
                                       BLOCK_N, False, USE_TMA, EVEN_D, FP32_DOT)
    for tile in range(new_full, tl.cdiv(tl.minimum(q_start + BLOCK_Q, q_len), BLOCK_N)):
        acc, l_i, m_i = _new_keys_tile(q, acc, l_i, m_i, KNew, VNew, q_begin, tile * BLOCK_N, col_k, col_v,
                                       stride_kt, stride_vt, q_rel, q_len, offs_d, mask_d, qk_scale,
                                       BLOCK_N, True, USE_TMA, EVEN_D, FP32_DOT)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=io_mask)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_layout_ok(t: torch.Tensor, block_d: int) -> bool:
    """True when t [tokens, kv_heads, head_dim] can be read as a 2-D TMA descriptor [tokens, kv_heads * head_dim]:
    head_dim a power of 2 (the block), heads packed in a row, 16-byte aligned base and row stride."""
    tokens, kv_heads, head_dim = t.shape
    return (head_dim == block_d and t.stride(2) == 1 and (kv_heads == 1 or t.stride(1) == head_dim)
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
            and head_dim * t.element_size() >= 16)


def _new_kv_args(k: torch.Tensor, v: torch.Tensor, use_tma: bool, block_n: int) -> tuple:
    """The kernel's KNew/VNew: the tensors, or 2-D TMA descriptors [tokens, kv_heads * head_dim] with
    [block_n, head_dim] blocks (one block = block_n tokens of one KV head)."""
    if not use_tma:
        return k, v
    descs = []
    for t in (k, v):
        tokens, kv_heads, head_dim = t.shape
        flat = t.as_strided((tokens, kv_heads * head_dim), (t.stride(0), 1))
        descs.append(TensorDescriptor(flat, [tokens, kv_heads * head_dim], [t.stride(0), 1], [block_n, head_dim]))
    return tuple(descs)


def paged_prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                   v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                   block_tables: torch.Tensor, scale: float, *, block_m: int = 64,
                                   block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                                   pack_gqa: bool | None = None, use_tma: bool | None = None,
                                   short_q: int | None = None,
                                   short_block_m: int = 64, short_block_n: int | None = None,
                                   short_num_warps: int = 4, short_num_stages: int = 2,
                                   num_live: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `paged_prefill_attention_ref`.

    q [num_tokens, num_heads, head_dim]; k/v [num_tokens, num_kv_heads, head_dim] this step's keys/values
    (views with any token/head strides, e.g. slices of a fused qkv output, are fine); positions below
    seq_len - q_len come from the paged cache. Knobs (launch of sequences with q_len > short_q):
    block_m query rows x block_n keys per tile, num_warps, num_stages; pack_gqa packs block_m // group
    queries x the group's heads per tile (one program per KV head, each K/V tile loaded once per group)
    instead of block_m queries of one head (None: pack when the group is a power of 2, so no row is padding).
    Defaults: the fastest of a sweep on H200 (Triton 3.6, bf16, head_dim 128, GQA 4): block_m 64, 4 warps,
    packed, block_n 64 and 3 stages -- two programs per SM (113 KB of shared memory each); for rows of
    more than 256 bytes (padded head_dim x element size: fp32, head_dim 256) block_n 32 and 2 stages, so
    that Q plus the K/V stages still fit.
    use_tma: read the new k/v through TMA descriptors (None: on Hopper+ / the interpreter when the layout
    allows it -- head_dim a power of 2, 16-byte aligned strides -- else pointer loads).
    short_q: sequences with q_len <= short_q run in a second, GQA-packed launch (one program per sequence
    and KV head, short_block_m rows = queries x padded group, short_block_n keys); 0: a single launch for
    everything; None: 0 when the long launch is packed (its tiles already have that layout, and an empty
    second launch cost 1.4% at 4 x 2048 on H200), else as many queries as one short tile holds.
    num_live: an int32 device scalar: only sequences [0, num_live) have queries, those after have none (a
    CUDA graph's padding sequences); the long launch's programs past their tiles exit before any search.
    """
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, "paged_prefill_attention")
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.device != q.device:
        raise ValueError(f"paged_prefill_attention: cu_seqlens_q must be int32 [num_seqs+1={num_seqs + 1}] on "
                         f"{q.device}, got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)} on {cu_seqlens_q.device}")
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    kv_shape = (total, num_kv_heads, head_dim)
    if k.shape != kv_shape or v.shape != kv_shape or k.dtype != q.dtype or v.dtype != q.dtype \
            or k.device != q.device or v.device != q.device:
        raise ValueError(f"paged_prefill_attention: k/v must be {q.dtype} {list(kv_shape)} on {q.device} like q, got "
                         f"{k.dtype} {tuple(k.shape)} / {v.dtype} {tuple(v.shape)} on {k.device}/{v.device}")
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_bytes = block_d * q.element_size()
    block_n = (64 if row_bytes <= 256 else 32) if block_n is None else block_n
    num_stages = (3 if row_bytes <= 256 else 2) if num_stages is None else num_stages
    short_block_n = (64 if row_bytes <= 512 else 32) if short_block_n is None else short_block_n
    if pack_gqa is None:
        pack_gqa = group == g_pad
    g_rows = g_pad if pack_gqa else 1
    block_q = block_m // g_rows
    short_block_q = short_block_m // g_pad
    if block_q < 1 or block_m < 16 or short_block_q < 1 or short_block_m < 16:
        raise ValueError(f"paged_prefill_attention: block_m={block_m} / short_block_m={short_block_m} must be >= 16 "
                         f"and >= the padded group {g_pad} where packed")
    if short_q is None:
        short_q = 0 if pack_gqa else short_block_q
    if not 0 <= short_q <= short_block_q:
        raise ValueError(f"paged_prefill_attention: short_q={short_q} must be in [0, short_block_m // padded group "
                         f"= {short_block_q}]")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty_like(q)
    if total == 0 or num_seqs == 0:
        return out
    tma_ok = TensorDescriptor is not None and _tma_layout_ok(k, block_d) and _tma_layout_ok(v, block_d)
    if use_tma is None:
        use_tma = tma_ok and (interpreting() or _has_tma(q.device))
    elif use_tma and not tma_ok:
        raise ValueError("paged_prefill_attention: use_tma=True needs head_dim a power of 2 >= 16 bytes, k/v heads "
                         "packed in a row and 16-byte aligned base and token stride")
    fp32_dot = q.dtype == torch.float32 or interpreting()
    if num_live is not None and (num_live.numel() != 1 or num_live.dtype != torch.int32 or num_live.device != q.device):
        raise ValueError(f"paged_prefill_attention: num_live must be one int32 on {q.device}, got {num_live.dtype} "
                         f"{tuple(num_live.shape)} on {num_live.device}")
    args = (k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
            seq_lens if num_live is None else num_live, scale * LOG2E, num_seqs, short_q,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1))
    # Launches that certainly have no work (known from shapes alone) are skipped.
    run_long = total > short_q
    run_short = short_q > 0 and not (num_seqs == 1 and total > short_q)
    meta = dict(GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_D=block_d, USE_TMA=use_tma,
                FP32_DOT=fp32_dot, LIVE=num_live is not None)
    if run_long:
        grid = (total // block_q + num_seqs, num_kv_heads if pack_gqa else num_heads)
        _prefill_kernel[grid](q, *_new_kv_args(k, v, use_tma, block_n), *args, G_ROWS=g_rows, BLOCK_Q=block_q,
                              BLOCK_N=block_n, SHORT=False, num_warps=num_warps, num_stages=num_stages, **meta)
    if run_short:
        _prefill_kernel[(num_seqs, num_kv_heads)](
            q, *_new_kv_args(k, v, use_tma, short_block_n), *args, G_ROWS=g_pad, BLOCK_Q=short_block_q,
            BLOCK_N=short_block_n, SHORT=True, num_warps=short_num_warps, num_stages=short_num_stages, **meta)
    return out


def warm_up_prefill_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
    """Compile, before serving, every kernel variant a step can need: 1, 2 or 16 sequences (Triton's int
    classes: == 1, other, divisible by 16) x rows above / at most the short-row bound. Rows of 1 query are
    short and rows of 65 long for any GQA group (the default bound is 64 // padded group). Reads block 0 of
    the given cache and writes nothing to it; a first use in the middle of serving would otherwise stall
    that step for about 0.5 s per variant."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    dev, dtype = k_cache.device, k_cache.dtype
    for num_seqs in (1, 2, 16):
        for q_len in (1, 65):
            total = num_seqs * q_len
            q = torch.zeros(total, num_heads, head_dim, dtype=dtype, device=dev)
            kv = torch.zeros(total, num_kv_heads, head_dim, dtype=dtype, device=dev)
            cu = torch.arange(0, total + 1, q_len, dtype=torch.int32, device=dev)
            seq_lens = torch.full((num_seqs,), q_len + 16, dtype=torch.int32, device=dev)
            tables = torch.zeros(num_seqs, -(-(q_len + 16) // k_cache.shape[1]), dtype=torch.int32, device=dev)
            paged_prefill_attention_triton(q, kv, kv, k_cache, v_cache, cu, seq_lens, tables, 1.0)
