"""How much of an eager step's forward is attention, when the profile's module timings cannot say.

The profiled model splits an eager step's device time into linear layers (by tokens) and attention (by each
chunk's new and cached tokens, and the decode rows' contexts), from the profile's `forward_s` (the step's
forward on the device) and `attention_s` (forward hooks on the attention modules). The hooks run the step
eagerly, so where the host takes longer to issue a module than the device to run it, they time the host: a
profile made with every step graphed can then hold a 16-token chunk whose "attention" is several times its
whole forward (no chunk that small and without context spends even half its forward in attention).

`implausible` says when that happened; `from_forward` then takes the attention from the forward itself:
  chunk of n tokens at context c:  a0(n) + forward(n, c) - forward(n, 0)
  b decode rows at context c:      r0(b) + forward(b, c) - forward(b, c_first)
the context-dependent part is exact (the linear layers do not depend on the context), and the part at the
first context is the module timing capped by what the forward's own growth with context gives for it
(attention cost per attended token pair, times the pairs there). Invariant: 0 <= attention <= forward at
every grid point, so linear = forward - attention is never negative.
"""
from __future__ import annotations

IMPLAUSIBLE_SHARE = 0.5  # the least share of a 16-token, context-free chunk's forward no attention reaches


def implausible(chunk: dict, rows: dict) -> bool:
    """Whether the module timings exceed what the device can spend on attention: the decode-rows table's chunk
    (tokens, context 0) timed at more than IMPLAUSIBLE_SHARE of its forward."""
    tokens, ctx = chunk["tokens"], chunk["context"]
    n = rows["chunk"] if rows["chunk"] in tokens else tokens[0]
    i = tokens.index(n)
    fwd, attn = chunk["forward_s"][i][0], chunk["attention_s"][i][0]
    return ctx[0] == 0 and fwd is not None and attn is not None and attn > IMPLAUSIBLE_SHARE * fwd


def _slope(fwd: list, xs: list, per: float) -> float:
    """Forward time per unit of `per * x` between the first and the last measured point of a grid row."""
    js = [j for j, v in enumerate(fwd) if v is not None]
    if len(js) < 2 or xs[js[-1]] == xs[js[0]]:
        return 0.0
    return max(0.0, (fwd[js[-1]] - fwd[js[0]]) / (per * (xs[js[-1]] - xs[js[0]])))


def _from_first(fwd: list, timed: list, base: float) -> list:
    """A grid row's attention: `base` at its first measured point, plus the forward's growth from there."""
    j0 = next(j for j, v in enumerate(fwd) if v is not None)
    first = min(base, fwd[j0], timed[j0] if timed[j0] is not None else base)
    return [None if v is None else first + max(0.0, v - fwd[j0]) for v in fwd]


def from_forward(chunk: dict, rows: dict) -> tuple[list, list]:
    """(chunk attention_s, decode-rows attention_s) grids taken from the forward (see the module docstring)."""
    ctx = chunk["context"]
    chunk_attn, first = [], {}
    for n, fwd, timed in zip(chunk["tokens"], chunk["forward_s"], chunk["attention_s"]):
        k = _slope(fwd, ctx, n)  # per attended pair: n new tokens each attend to the context
        row = _from_first(fwd, timed, k * n * (n + 1) / 2 + k * n * ctx[0])
        chunk_attn.append(row)
        first[n] = row[0] if row[0] is not None else 0.0
    rctx, c = rows["context"], rows["chunk"]
    rows_attn = []
    for b, fwd, timed in zip(rows["batch"], rows["forward_s"], rows["attention_s"]):
        k = _slope(fwd, rctx, b)  # per attended pair: b rows each attend to their context
        rows_attn.append(_from_first(fwd, timed, k * b * rctx[0] + first.get(c, 0.0)))
    return chunk_attn, rows_attn
