"""Triton paged prefill/extend attention (chunked prefill, prefix-cache hits, mixed q_len == 1 rows).

One program = (query tile, KV head). A tile packs BLOCK_Q consecutive queries x the KV head's group of
query heads (padded to a power of 2) into BLOCK_M = BLOCK_Q * G_PAD rows, so each K/V tile is loaded once
per group. Tiles are assigned without a host sync: sequence i owns program ids
[cu_q[i] // BLOCK_Q + i, cu_q[i+1] // BLOCK_Q + i + 1), found by a binary search; surplus ids exit.
Keys every row may see are processed without a mask; only the diagonal tiles are masked.
"""

import torch
import triton
import triton.language as tl

from testbed.kernels.decode_attention import LOG2E, attend_tile, check_paged_args, interpreting


@triton.jit
def _prefill_kernel(Q, K, V, Out, CuSeqlensQ, SeqLens, BlockTables, qk_scale, num_seqs,
                    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Largest seq with cu_q[seq] // BLOCK_Q + seq <= pid (strictly increasing in seq; seq 0 starts at 0).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(CuSeqlensQ + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_begin = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    ctx = seq_len - q_len  # absolute position of the sequence's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qi = q_start + offs_m // G_PAD
    g = offs_m % G_PAD
    mask_d = offs_d < HEAD_DIM
    row_mask = (qi < q_len) & (g < GROUP)
    io_mask = row_mask[:, None] & mask_d[None, :]
    tok = (q_begin + qi).to(tl.int64)
    heads = kv_head * GROUP + g
    q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_pos = tl.minimum(ctx + qi, seq_len - 1)  # padding rows act as the last query: never reads past seq_len

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    off_k = kv_head * stride_kh
    off_v = kv_head * stride_vh
    full_tiles = (ctx + q_start + 1) // BLOCK_N  # keys < ctx + q_start + 1 are visible to every row
    for tile in range(0, full_tiles):
        acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, K, V, bt_row, tile * BLOCK_N, q_pos, off_k, off_v,
                                    stride_kb, stride_kp, stride_vb, stride_vp, offs_d, mask_d, qk_scale,
                                    PAGE, BLOCK_N, False, HEAD_DIM == BLOCK_D, FP32_DOT)
    end_tiles = tl.cdiv(tl.minimum(ctx + q_start + BLOCK_Q, seq_len), BLOCK_N)
    for tile in range(full_tiles, end_tiles):
        acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, K, V, bt_row, tile * BLOCK_N, q_pos, off_k, off_v,
                                    stride_kb, stride_kp, stride_vb, stride_vp, offs_d, mask_d, qk_scale,
                                    PAGE, BLOCK_N, True, HEAD_DIM == BLOCK_D, FP32_DOT)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=io_mask)


def paged_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                   scale: float, *, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                                   num_stages: int = 2) -> torch.Tensor:
    """Triton version of `paged_prefill_attention_ref`.

    A tile is block_m rows (queries x group heads) by block_n keys; the defaults were the fastest of a
    sweep on H100 and H200 (bf16, head_dim 128, GQA 4).
    """
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, "paged_prefill_attention")
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.device != q.device:
        raise ValueError(f"paged_prefill_attention: cu_seqlens_q must be int32 [num_seqs+1={num_seqs + 1}] on "
                         f"{q.device}, got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)} on {cu_seqlens_q.device}")
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = block_m // g_pad
    if block_q < 1 or block_m < 16:
        raise ValueError(f"paged_prefill_attention: block_m={block_m} must be >= 16 and >= the padded group {g_pad}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if total == 0 or num_seqs == 0:
        return out
    _prefill_kernel[(total // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        FP32_DOT=q.dtype == torch.float32 or interpreting(), num_warps=num_warps, num_stages=num_stages)
    return out
