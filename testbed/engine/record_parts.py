"""The step and ITL tables of a Recorder: rows appended one at a time, and fast-forwarded stretches as columns.

A stepped engine appends a tuple per step and a float per ITL sample. A fast-forwarded stretch of decodes
(engine/fast_forward.py) adds a `Stretch` instead: its step ends in one list, from which its rows and its ITL
samples follow (every row of a decode step after the first gets the step's duration as its ITL sample), so a
stretch costs a list append per step instead of a tuple and `batch` floats. Both tables read as the lists they
stand for (iteration, len, indexing, ==), value for value, and give numpy arrays without building those lists:
`StepRows.array()` and `Samples.array()` compute each float with the same operation stepping does (end - start).
"""
from __future__ import annotations

from itertools import chain, repeat
from typing import Iterable, Iterator

import numpy as np


class Stretch:
    """Consecutive decode steps of one batch on one replica: step k starts at `ends[k]` (the first at `start`,
    when given) and ends at `ends[k + 1]`; it holds `batch` rows and sum_context_tokens `ctx + batch * k`, and
    leaves `used[k]` KV blocks in use. Every other STEP_COLUMNS value is the same for all its steps."""

    __slots__ = ("replica", "batch", "ctx", "used", "total_blocks", "waiting", "ends", "start")

    def __init__(self, replica: int, batch: int, ctx: int, total_blocks: int, waiting: int, ends: list[float],
                 used: list[int], start: float | None = None) -> None:
        self.replica, self.batch, self.ctx, self.total_blocks, self.waiting = replica, batch, ctx, total_blocks, waiting
        self.ends, self.used, self.start = ends, used, start

    def __len__(self) -> int:
        return len(self.ends) - 1

    def starts(self) -> list[float]:
        s = self.ends[:-1]
        if self.start is not None:
            s[0] = self.start
        return s

    def rows(self) -> Iterator[tuple]:
        b, ctx = self.batch, self.ctx
        for k, (start, end, used) in enumerate(zip(self.starts(), self.ends[1:], self.used)):
            c = ctx + b * k
            yield (self.replica, start, end - start, b, 0, b, c, c, used, self.total_blocks, self.waiting, b,
                   0, 0, 0, 0, 0, 0)

    def durations(self, first: int) -> list[float]:
        """The durations of its steps from step `first` on (the ITL sample of each of their rows)."""
        e = self.ends
        return [b - a for a, b in zip(e[first:-1], e[first + 1:])]


class _Parts:
    """An append-only table kept as parts: the rows appended one at a time since the last stretch (a list whose
    bound `append` and `extend` this object exposes, so appending costs what a list's does) and stretches."""

    __slots__ = ("_parts", "_tail", "append", "extend")

    def __init__(self, rows: Iterable = ()) -> None:
        self._parts: list = []
        self._open(list(rows))

    def _open(self, tail: list) -> None:
        self._tail = tail
        self.append, self.extend = tail.append, tail.extend

    def _add(self, part) -> None:
        if self._tail:
            self._parts.append(self._tail)
            self._open([])
        self._parts.append(part)

    def _all(self) -> list:
        return [*self._parts, self._tail] if self._tail else list(self._parts)

    def clear(self) -> None:
        self._parts = []
        self._open([])

    def merge(self, other: "_Parts") -> None:
        """Append `other`'s rows after these (its parts are shared, not copied: it must not change after)."""
        for p in other._all():
            self._add(p)

    def __len__(self) -> int:
        return sum(map(self._len, self._parts)) + len(self._tail)

    def __iter__(self) -> Iterator:
        return chain.from_iterable(map(self._iter, self._all()))

    def __getitem__(self, i):
        return list(self)[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, (_Parts, list)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"

    def __getstate__(self):
        return list(self)

    def __setstate__(self, rows) -> None:
        self._parts = []
        self._open(list(rows))

    @staticmethod
    def _len(part) -> int:
        return len(part)

    @staticmethod
    def _iter(part) -> Iterator:
        return iter(part)


class StepRows(_Parts):
    """The step table (STEP_COLUMNS rows, and the recorder's extra columns): tuples and stretches."""

    __slots__ = ()

    def add_stretch(self, stretch: Stretch) -> None:
        if len(stretch):
            self._add(stretch)

    @staticmethod
    def _iter(part) -> Iterator:
        return part.rows() if isinstance(part, Stretch) else iter(part)

    def array(self, width: int) -> np.ndarray:
        """Every row as a (rows, width) float64 array: the rows appended one by one as they were, the stretches'
        columns computed for all of them at once (a run has tens of thousands)."""
        parts = self._all()
        stretch = np.array([isinstance(p, Stretch) for p in parts], dtype=bool)
        out = np.zeros((len(self), width))
        where = np.repeat(stretch, [len(p) for p in parts])
        rows = [p for p in parts if not isinstance(p, Stretch)]
        if rows:
            n = sum(map(len, rows))
            out[~where] = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.float64,
                                      count=n * width).reshape(n, width)
        stretches = [p for p in parts if isinstance(p, Stretch)]
        if stretches:
            out[where] = _stretch_rows(stretches, width)
        return out


class _Repeated:
    """ITL samples of a stretch: each step's duration from step `first` on, once per row of the batch."""

    __slots__ = ("stretch", "first")

    def __init__(self, stretch: Stretch, first: int) -> None:
        self.stretch, self.first = stretch, first

    def __len__(self) -> int:
        return (len(self.stretch) - self.first) * self.stretch.batch

    def __iter__(self) -> Iterator[float]:
        b = self.stretch.batch
        return chain.from_iterable(repeat(d, b) for d in self.stretch.durations(self.first))


class Samples(_Parts):
    """A table of floats (ITL samples): floats appended one by one, and a stretch's samples as its durations."""

    __slots__ = ()

    def add_stretch(self, stretch: Stretch, first: int) -> None:
        """The samples of `stretch`'s steps from step `first` on: each step's duration, `batch` times."""
        if len(stretch) > first:
            self._add(_Repeated(stretch, first))

    def array(self) -> np.ndarray:
        """Every sample, in order, as a float64 array (the stretches' durations computed for all of them at once)."""
        parts = self._all()
        repeated = np.array([isinstance(p, _Repeated) for p in parts], dtype=bool)
        out = np.empty(len(self))
        where = np.repeat(repeated, [len(p) for p in parts])
        floats = [p for p in parts if not isinstance(p, _Repeated)]
        if floats:
            out[~where] = np.fromiter(chain.from_iterable(floats), dtype=np.float64, count=len(out) - int(where.sum()))
        reps = [p for p in parts if isinstance(p, _Repeated)]
        if reps:
            ends, first = _ends([p.stretch.ends[p.first:] for p in reps])
            durations = (ends[1:] - ends[:-1])[~first[1:]]  # within a stretch only
            out[where] = np.repeat(durations, np.repeat([p.stretch.batch for p in reps],
                                                        [len(p.stretch) - p.first for p in reps]))
        return out


def _ends(lists: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """The lists' floats in one array, and where each list starts in it."""
    lens = [len(x) for x in lists]
    ends = np.fromiter(chain.from_iterable(lists), dtype=np.float64, count=sum(lens))
    first = np.zeros(len(ends), dtype=bool)
    first[np.cumsum(lens) - lens] = True
    return ends, first


def _stretch_rows(stretches: list[Stretch], width: int) -> np.ndarray:
    """The stretches' rows, in order, as a (steps, width) float64 array: each duration end - start, as stepping
    computes it."""
    ends, first = _ends([p.ends for p in stretches])
    last = np.roll(first, -1)  # each stretch's last end (the next one's first slot, rolled back)
    starts, stops = ends[~last], ends[~first]
    lens = np.array([len(p) for p in stretches])
    offset = np.cumsum(lens) - lens
    given = [i for i, p in enumerate(stretches) if p.start is not None]
    starts[offset[given]] = [stretches[i].start for i in given]
    n = len(starts)
    out = np.zeros((n, width))
    batch = np.repeat([p.batch for p in stretches], lens)
    out[:, 0] = np.repeat([p.replica for p in stretches], lens)
    out[:, 1] = starts
    out[:, 2] = stops - starts
    out[:, 3] = out[:, 5] = out[:, 11] = batch
    out[:, 6] = out[:, 7] = np.repeat([p.ctx for p in stretches], lens) + batch * (np.arange(n) - np.repeat(offset, lens))
    out[:, 8] = np.fromiter(chain.from_iterable(p.used for p in stretches), dtype=np.float64, count=n)
    out[:, 9] = np.repeat([p.total_blocks for p in stretches], lens)
    out[:, 10] = np.repeat([p.waiting for p in stretches], lens)
    return out
