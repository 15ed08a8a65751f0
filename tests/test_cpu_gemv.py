"""The CPU bf16-weight matrix-vector kernel (kernels/cpu_gemv.py) and the linear layers that use it.

Against float64 matmuls of the same values: shapes with and without vector tails, several rows, row strides,
thread counts (the same bits at 1 and 2 threads); the layers' bf16 copy only where it is exact; the build in
a fresh cache folder, and the fallback when no compiler works.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.kernels import cpu_gemv
from testbed.worker.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, cpu_weight_layout, tp_override


def bf16_valued(*shape: int, seed: int) -> torch.Tensor:
    """Random float32 values that are bf16 numbers, as in a bf16 checkpoint loaded in float32."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """y within float32 summation error of the float64 xW^T (+ b): K eps |x| |W|^T, plus the rounding of the
    bias add."""
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    bound = x.shape[1] * 2 ** -23 * (x.double().abs() @ w.double().abs().t()) + 2 ** -22 * exact.abs() + 1e-30
    assert bool(((y.double() - exact).abs() <= bound).all()), float(((y.double() - exact).abs() / bound).max())


def test_kernel_builds_here():
    assert cpu_gemv.available(), "the machine that runs the suite has a C compiler: the kernel must build"


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 70), k=st.integers(1, 100), seed=st.integers(0, 2 ** 16),
       pad=st.integers(0, 3))
def test_kernel_matches_exact_product(m, n, k, seed, pad):
    w = bf16_valued(n, k, seed=seed)
    x = bf16_valued(m, k + pad, seed=seed + 1)[:, :k] * 3.7  # row stride k + pad; not bf16 values
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.gemv_bf16(x, w.bfloat16())
        torch.set_num_threads(2)
        two = cpu_gemv.gemv_bf16(x, w.bfloat16())
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (m, n) and one.dtype == torch.float32
    assert torch.equal(one, two), "each output is one thread's sum: the thread count must not change it"
    alone = torch.cat([cpu_gemv.gemv_bf16(x[i:i + 1], w.bfloat16()) for i in range(m)])
    assert torch.equal(one, alone), "a row's outputs must not depend on the rows computed beside it"
    assert_close_to_exact(one, x, w)


def test_kernel_refuses_wrong_operands():
    w = bf16_valued(8, 32, seed=0).bfloat16()
    with pytest.raises(ValueError, match=r"must be \[M, K\] float32"):
        cpu_gemv.gemv_bf16(torch.zeros(2, 16), w)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemv.gemv_bf16(torch.zeros(2, 32), w.float())


def test_shadow_only_for_exact_bf16_values():
    exact = bf16_valued(16, 32, seed=1)
    shadow = cpu_gemv.bf16_shadow(exact)
    assert shadow is not None and shadow.dtype == torch.bfloat16 and torch.equal(shadow.float(), exact)
    column_major = exact.t().contiguous().t()  # the CPU layout of matmul weights (cpu_weight_layout)
    assert torch.equal(cpu_gemv.bf16_shadow(column_major), shadow) and cpu_gemv.bf16_shadow(exact[:, ::3]) is not None
    inexact = exact.clone()
    inexact[7, 5] += 1e-4
    assert cpu_gemv.bf16_shadow(inexact) is None and cpu_gemv.bf16_shadow(inexact.t().contiguous().t()) is None
    assert cpu_gemv.bf16_shadow(exact.double()) is None


def test_layers_read_the_copy_for_few_rows_only():
    """After cpu_weight_layout, column/row-parallel layers and the LM head (a TP shard of it too) compute
    decode-sized steps with the kernel and larger ones with torch's matmul, both near the exact product."""
    with tp_override(1, 2):
        layers = [ColumnParallelLinear(48, 40, bias=True), RowParallelLinear(64, 24), ParallelLMHead(101, 32)]
    for i, layer in enumerate(layers):
        layer.weight.data = bf16_valued(*layer.weight.shape, seed=10 + i)
        if getattr(layer, "bias", None) is not None:
            layer.bias.data = bf16_valued(*layer.bias.shape, seed=20 + i)
    inexact = ColumnParallelLinear(32, 16)
    inexact.weight.data = torch.randn(16, 32)
    for layer in layers + [inexact]:
        cpu_weight_layout(layer)
    assert all(layer.weight_bf16 is not None for layer in layers) and inexact.weight_bf16 is None
    for layer in layers:
        for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1):
            x = bf16_valued(rows, layer.weight.shape[1], seed=rows) * 1.3
            y = layer(x)
            bias = getattr(layer, "bias", None)
            weight = layer.weight.data[:y.shape[1]]  # the LM head's shard drops its padding row
            if rows > cpu_gemv.MAX_ROWS:
                assert torch.equal(y, F.linear(x, weight, bias))
            assert_close_to_exact(y, x, weight, bias)


def test_build_into_a_fresh_cache_and_fallback_without_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TESTBED_CACHE", str(tmp_path))
    lib = cpu_gemv._load()
    assert lib is not None and len(list((tmp_path / "kernels").glob("gemv_bf16_*.so"))) == 1
    monkeypatch.setenv("TESTBED_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_gemv.__name__):
        assert cpu_gemv._load() is None
    assert "torch's float32 matmul" in caplog.text
