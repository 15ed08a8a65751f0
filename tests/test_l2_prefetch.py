"""The L2 prefetch beside the fused tensor-parallel all-reduce (kernels/l2_prefetch.py, worker/tp_all_reduce.py):
its setting from the environment, and the portable "load" way under the Triton interpreter, which must leave
every tensor the model reads as it was (the "bulk" way is a Hopper instruction; benchmarks/tp.py compares the
greedy outputs of TP=2 engines with and without it on GPUs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.worker.tp_all_reduce import PREFETCH_ENV, PREFETCH_MB_ENV, prefetch_setting


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    monkeypatch.delenv(PREFETCH_MB_ENV, raising=False)
    return monkeypatch


def test_bulk_by_default_on_hopper_and_none_before(env) -> None:
    assert prefetch_setting((9, 0)) == ("bulk", 24 << 20)
    assert prefetch_setting((10, 0)) == ("bulk", 24 << 20)
    assert prefetch_setting((8, 0))[0] == "off"
    assert prefetch_setting((9, 4), hip=True)[0] == "off"  # an MI300's numbers: no PTX there


def test_the_environment_chooses_the_way_and_size(env) -> None:
    env.setenv(PREFETCH_ENV, "load")
    env.setenv(PREFETCH_MB_ENV, "16")
    assert prefetch_setting((8, 0)) == ("load", 16 << 20)
    env.setenv(PREFETCH_ENV, "off")
    assert prefetch_setting((9, 0))[0] == "off"


@pytest.mark.parametrize("name,value", [(PREFETCH_ENV, "l2"), (PREFETCH_MB_ENV, "0"), (PREFETCH_MB_ENV, "-3"),
                                        (PREFETCH_MB_ENV, "lots")])
def test_bad_settings_are_refused_by_name(env, name: str, value: str) -> None:
    env.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        prefetch_setting((9, 0))


_LOAD_WAY = r"""
import torch
from testbed.kernels.l2_prefetch import l2_prefetch
torch.manual_seed(0)
w = torch.randn(300, 70)
before = w.clone()
scratch = torch.zeros(1024)
for nbytes in (0, 4, 1000, 300 * 70 * 4, 1 << 30):
    l2_prefetch(w, nbytes, "load", scratch)
assert torch.equal(w, before), "the weight changed"
assert not scratch.any(), "the scratch was written"
try:
    l2_prefetch(w.t(), 1 << 20, "load", scratch)
except ValueError as e:
    assert "contiguous" in str(e)
else:
    raise AssertionError("a strided weight was accepted")
try:
    l2_prefetch(w, 1 << 20, "tma", scratch)
except ValueError as e:
    assert "'tma'" in str(e)
else:
    raise AssertionError("an unknown way was accepted")
print("ok")
"""


def test_the_load_way_reads_and_changes_nothing_under_the_interpreter() -> None:
    proc = subprocess.run([sys.executable, "-c", _LOAD_WAY], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
