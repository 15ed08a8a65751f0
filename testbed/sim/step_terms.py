"""A profiled step's time as measured terms per component, and how per-component scales recombine them.

The components are what two machines of one kind differ in:
  host       the engine's schedule + update, the runner's input preparation, launch and readback
  gemm       the linear layers and the LM head of a step with a prefill chunk
  attention  the attention of a step with a prefill chunk
  decode     the device part of a decode-only step (the decode table: weights and KV cache read per step)

A step has one of four shapes (`kind`), in seconds (scales h, g, a, d):
  decode, sync    h * (engine + runner host + grammar) + d * (device + uneven contexts)
  decode, async   max(d * device cycle, h * (runner host + engine))
  mixed, sync     h * (engine + prep + grammar + readback + gap) + max(h * launch, g * (linear + lm head) + a * attention)
  mixed, async    max(g * (linear + lm head) + a * attention + h * gap, h * (engine + prep + launch + readback))
`combine` evaluates them; `design` gives, for the branch of each max that holds at given scales, the step as a
linear function of the scales (what `rescale.fit_scales` fits). With every scale 1 the sums are grouped as the
profiled model has always grouped them, so an unscaled profile predicts bit-identical times.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

COMPONENTS = ("host", "gemm", "attention", "decode")
DECODE_SYNC, DECODE_ASYNC, MIXED_SYNC, MIXED_ASYNC = range(4)


@dataclass(frozen=True)
class Scales:
    """Per-component multipliers of a profile's measured terms (1: the profile's own machine)."""

    host: float = 1.0
    gemm: float = 1.0
    attention: float = 1.0
    decode: float = 1.0

    @classmethod
    def from_dict(cls, d: dict | None) -> "Scales":
        d = d or {}
        unknown = set(d) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown scale components {sorted(unknown)}; expected {', '.join(COMPONENTS)}")
        bad = {k: v for k, v in d.items() if not isinstance(v, (int, float)) or not v > 0}
        if bad:
            raise ValueError(f"scales must be positive numbers, got {bad}")
        return cls(**{k: float(v) for k, v in d.items()})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def combine(kind: int, t: tuple, s: Scales) -> float:
    """The step's time from its terms `t` (see the module docstring for each kind's tuple)."""
    h = s.host
    if kind == DECODE_SYNC:
        eng, wall, runner_host, tail, grammar = t
        dec = h * wall if h == s.decode else h * runner_host + s.decode * (wall - runner_host)
        return h * eng + dec + s.decode * tail + h * grammar
    if kind == DECODE_ASYNC:
        eng, cycle, runner_host = t
        return max(s.decode * cycle, h * (runner_host + eng))
    eng, prep, grammar, launch, lin, attn, samp, out, gap = t
    device = s.gemm * lin + s.attention * attn + s.gemm * samp
    if kind == MIXED_ASYNC:
        return max(device + h * gap, h * eng + h * prep + h * launch + h * out)
    return h * eng + h * prep + h * grammar + max(h * launch, device) + h * out + h * gap


def design(kind: int, t: tuple, s: Scales) -> dict[str, float]:
    """Seconds per unit of each component's scale, on the branch of every max that holds at scales `s`:
    sum(row[c] * scale[c]) is the step's time near `s`."""
    if kind == DECODE_SYNC:
        eng, wall, runner_host, tail, grammar = t
        return {"host": eng + runner_host + grammar, "decode": wall - runner_host + tail}
    if kind == DECODE_ASYNC:
        eng, cycle, runner_host = t
        return {"decode": cycle} if s.decode * cycle >= s.host * (runner_host + eng) else {"host": runner_host + eng}
    eng, prep, grammar, launch, lin, attn, samp, out, gap = t
    device = {"gemm": lin + samp, "attention": attn}
    device_s = s.gemm * (lin + samp) + s.attention * attn
    if kind == MIXED_ASYNC:
        if device_s + s.host * gap >= s.host * (eng + prep + launch + out):
            return {**device, "host": gap}
        return {"host": eng + prep + launch + out}
    host = eng + prep + grammar + out + gap
    if s.host * launch > device_s:
        return {"host": host + launch}
    return {**device, "host": host}
