"""Triton silu(gate) * up for the MLP: one program per (row, BLOCK columns), math in fp32, cast back.

Replaces a torch.compile'd (dynamic shapes) chunk + silu + mul, which divided by the symbolic row
width for every element: at 256 x 2 x 8192 bf16 on H200 it took 8.9 us against 3.0 us here.
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # 4 warps; 512 - 4096 columns per program measured within 10% at 256 and 512 rows


@triton.jit
def _silu_and_mul_kernel(X, Out, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate | up) -> silu(gate) * up [..., I] in x's dtype."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim of x must be even (gate | up), got shape {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    half = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], half, dtype=x.dtype, device=x.device)
    if out.numel():
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(half, BLOCK))](rows, out, half, rows.stride(0),
                                                                       out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], half)
