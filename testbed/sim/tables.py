"""Interpolation tables for the profiled cost model: a few list lookups per call, no numpy in the hot path.

Table1D is piecewise linear over sorted x (linear extrapolation past both ends, floored at 0).
Table2D holds a measured grid (rows = batch sizes, columns = context lengths) with holes where a point
was not measured (its KV did not fit the cache); holes are filled by linear extrapolation along the
row, rows are made dense for every integer batch size up to the last one (each on its first lookup, so loading a
profile stays cheap), and a lookup is one bisect plus one interpolation along the columns.
"""
from __future__ import annotations

import bisect
import math
from typing import Sequence


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interval(xs: Sequence[float], x: float) -> int:
    """The i (1 <= i < len(xs)) whose [xs[i-1], xs[i]] interpolates or extrapolates at x: bisect_left, clamped."""
    i = bisect.bisect_left(xs, x)
    return 1 if i < 1 else (len(xs) - 1 if i >= len(xs) else i)


def _at(xs: Sequence[float], ys: Sequence[float], i: int, x: float) -> float:
    """ys at x, linear along interval i of xs, floored at 0."""
    x0 = xs[i - 1]
    v = ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (xs[i] - x0)
    return v if v > 0.0 else 0.0


def _fill_row(xs: Sequence[float], ys: Sequence[float | None]) -> list[float]:
    """Holes at either end extrapolated linearly from the two nearest measured points (one point: constant);
    holes inside interpolated. ValueError if nothing was measured."""
    known = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if not known:
        raise ValueError("a profile table row has no measured point")
    if len(known) == 1:
        return [known[0][1]] * len(xs)
    kx = [x for x, _ in known]
    out = []
    for x, y in zip(xs, ys):
        if y is not None:
            out.append(y)
            continue
        i = _interval(kx, x)
        (x0, y0), (x1, y1) = known[i - 1], known[i]
        out.append(max(0.0, _lerp(x, x0, x1, y0, y1)))
    return out


class Table1D:
    def __init__(self, xs: Sequence[float], ys: Sequence[float | None]) -> None:
        pts = sorted((x, y) for x, y in zip(xs, ys) if y is not None)
        if not pts:
            raise ValueError("a profile table has no measured point")
        self.xs = [x for x, _ in pts]
        self.ys = [y for _, y in pts]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        return _at(xs, ys, _interval(xs, x), x)


class Table2D:
    def __init__(self, rows: Sequence[int], cols: Sequence[float], values: Sequence[Sequence[float | None]]) -> None:
        if len(values) != len(rows) or any(len(v) != len(cols) for v in values):
            raise ValueError(f"profile table shape {len(values)} x {[len(v) for v in values]} does not match "
                             f"{len(rows)} rows x {len(cols)} columns")
        if list(rows) != sorted(set(rows)) or list(cols) != sorted(set(cols)) or rows[0] < 1:
            raise ValueError("profile table axes must be strictly increasing (rows from 1)")
        self.cols = list(cols)
        self.rows = list(rows)
        self.filled = [_fill_row(cols, v) for v in values]
        # one row per integer batch size up to the last measured one, each made on its first lookup
        self.dense: list[list[float] | None] = [None] * (rows[-1] + 1)
        # past the last row: extrapolate with the slope between the last two measured rows
        filled = self.filled
        self.slope = ([(b - a) / (rows[-1] - rows[-2]) for a, b in zip(filled[-2], filled[-1])]
                      if len(rows) > 1 else [0.0] * len(cols))

    def _dense_row(self, r: int) -> list[float]:
        """Row r (0 <= r <= last row): the first measured row at and below it, else interpolated between the
        measured rows around it."""
        rows, filled = self.rows, self.filled
        if len(rows) == 1 or r <= rows[0]:
            row = filled[0]
        else:
            i = _interval(rows, r)
            r0, r1 = rows[i - 1], rows[i]
            row = [_lerp(r, r0, r1, a, b) for a, b in zip(filled[i - 1], filled[i])]
        self.dense[r] = row
        return row

    def row(self, r: int) -> list[float]:
        """The values at batch size r, one per column: a dense row, or extrapolated past the last one."""
        last = len(self.dense) - 1
        if r <= last:
            return self.dense[r] or self._dense_row(r)
        base = self.dense[last] or self._dense_row(last)
        return [v + s * (r - last) for v, s in zip(base, self.slope)]

    def __call__(self, r: int, c: float) -> float:
        cols = self.cols
        last = len(self.dense) - 1
        if r <= last:
            row = self.dense[r] or self._dense_row(r)
        else:
            row = self.row(r)
        if len(cols) == 1:
            return row[0]
        return _at(cols, row, _interval(cols, c), c)


class RowPieces:
    """The linear pieces of one Table2D row, for a caller that evaluates many lookups of it in a loop of its own (a
    stretch of decodes, whose mean context grows a token a step, stays on one piece for many steps)."""

    __slots__ = ("cols", "row")

    def __init__(self, table: Table2D, r: int) -> None:
        if len(table.cols) < 2:
            raise ValueError("a table of one column has no linear pieces")
        self.cols, self.row = table.cols, table.row(r)

    def piece(self, c: float) -> tuple[float, float, float, float, float, float]:
        """(lo, hi, y0, dy, x0, dx): for every x with lo < x <= hi, `table(r, x)` is `y0 + dy * (x - x0) / dx`
        floored at 0, the same float (the interval bisect_left picks, with the end intervals open outwards)."""
        cols, row = self.cols, self.row
        j = _interval(cols, c)
        lo = -math.inf if j == 1 else cols[j - 1]
        hi = math.inf if j == len(cols) - 1 else cols[j]
        return lo, hi, row[j - 1], row[j] - row[j - 1], cols[j - 1], cols[j] - cols[j - 1]


class LastLookup:
    """A table that keeps its last lookup: a stretch of decode steps asks a table for the same batch size (and
    the same context skew) step after step. Same values as the table, by construction."""

    __slots__ = ("table", "key", "value")

    def __init__(self, table: Table1D | Table2D) -> None:
        self.table, self.key, self.value = table, None, 0.0

    def __call__(self, *key: float) -> float:
        if key != self.key:
            self.key, self.value = key, self.table(*key)
        return self.value
