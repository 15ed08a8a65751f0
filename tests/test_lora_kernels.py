"""The Triton multi-LoRA kernels (TRITON_INTERPRET=1 on CPU, natively on a GPU) against the torch path, which
defines their semantics: random slot mixes with base rows, 1-3 output slices, ranks below max_lora_rank."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernel module (jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from testbed.kernels.lora import lora_apply_ref, lora_plan  # noqa: E402
from testbed.kernels.lora_triton import lora_expand, lora_shrink  # noqa: E402

os.environ.pop("TRITON_INTERPRET")  # other modules keep the torch paths on CPU


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 7), slots=st.integers(1, 3), slices=st.sampled_from([[24], [16, 16], [16, 8, 8]]),
       rank=st.sampled_from([1, 8]), k=st.sampled_from([16, 136]), seed=st.integers(0, 99))
def test_triton_kernels_match_the_torch_path(tokens, slots, slices, rank, k, seed):
    g = torch.Generator().manual_seed(seed)
    out = sum(slices)
    x = torch.randn(tokens, k, generator=g)
    a = torch.randn(slots, len(slices) * rank, k, generator=g)
    b = torch.randn(slots, out, rank, generator=g)
    idx = torch.randint(-1, slots, (tokens,), generator=g)
    y0 = torch.randn(tokens, out, generator=g)
    want = lora_apply_ref(y0.clone(), x, a, b, lora_plan(idx), slices)
    got = y0.clone()
    lora_expand(got, lora_shrink(x, a, idx), b, idx, slices)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[idx < 0], y0[idx < 0])  # base rows untouched


@pytest.mark.parametrize("tokens,k,slices,rank", [(37, 600, [48, 40, 40], 8), (20, 64, [80], 16)])
def test_triton_kernels_match_over_token_blocks_k_splits_and_column_blocks(tokens, k, slices, rank):
    """Larger than the kernels' tiles: many tokens (a block of one slot, then a mix), K over several 128-wide
    iterations (600, not a multiple), and output slices that meet inside the expand's 64-column blocks."""
    g = torch.Generator().manual_seed(tokens)
    out, slots = sum(slices), 3
    x = torch.randn(tokens, k, generator=g)
    a = torch.randn(slots, len(slices) * rank, k, generator=g)
    b = torch.randn(slots, out, rank, generator=g)
    idx = torch.randint(-1, slots, (tokens,), generator=g)
    idx[:16] = 1  # one block of a single slot, the rest mixed
    y0 = torch.randn(tokens, out, generator=g)
    want = lora_apply_ref(y0.clone(), x, a, b, lora_plan(idx), slices)
    got = y0.clone()
    lora_expand(got, lora_shrink(x, a, idx), b, idx, slices)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert torch.equal(got[idx < 0], y0[idx < 0])
