"""The step and ITL tables of a Recorder: rows appended one at a time, and fast-forwarded stretches as columns.

A stepped engine appends a tuple per step and a float per ITL sample. A fast-forwarded stretch of decodes
(engine/fast_forward.py) appends instead each step's end to the step table's `times` list and the KV blocks it
left in use to its `used` list, and adds a `Stretch` that says where its steps are in them; its rows and its ITL
samples follow (every row of a decode step after the fast-forward's first gets the step's duration as its ITL
sample). So a stretch costs two list appends per step instead of an 18-value tuple and `batch` floats. Both
tables read as the lists they stand for (iteration, len, indexing, ==), value for value, and give numpy arrays
without building those lists (`StepRows.columns`, `Samples.array`), every duration computed as stepping does
(end - start).
"""
from __future__ import annotations

from itertools import chain, compress, repeat
from operator import attrgetter, not_
from typing import Iterable, Iterator

import numpy as np


class Stretch:
    """`n` consecutive decode steps of one batch on one replica: step k ends at `times[lo + k + 1]` and starts at
    `times[lo + k]` (the first at `start`, when given), holds `batch` rows and sum_context_tokens `ctx + batch * k`,
    and leaves `used[ulo + k]` KV blocks in use. Every other STEP_COLUMNS value is the same for all its steps."""

    __slots__ = ("replica", "batch", "ctx", "total_blocks", "waiting", "times", "lo", "used", "ulo", "n", "start")

    def __init__(self, replica: int, batch: int, ctx: int, total_blocks: int, waiting: int, times: list[float],
                 lo: int, used: list[int], ulo: int, n: int, start: float | None = None) -> None:
        self.replica, self.batch, self.ctx, self.total_blocks, self.waiting = replica, batch, ctx, total_blocks, waiting
        self.times, self.lo, self.used, self.ulo, self.n, self.start = times, lo, used, ulo, n, start

    def __len__(self) -> int:
        return self.n

    def rows(self) -> Iterator[tuple]:
        b, ctx, lo, n = self.batch, self.ctx, self.lo, self.n
        starts = self.times[lo:lo + n]
        if self.start is not None:
            starts[0] = self.start
        used = self.used[self.ulo:self.ulo + n]
        for k, (start, end) in enumerate(zip(starts, self.times[lo + 1:lo + n + 1])):
            c = ctx + b * k
            yield (self.replica, start, end - start, b, 0, b, c, c, used[k], self.total_blocks, self.waiting, b,
                   0, 0, 0, 0, 0, 0)

    def durations(self, first: int) -> list[float]:
        """The durations of its steps from step `first` on (the ITL sample of each of their rows)."""
        t = self.times[self.lo + first:self.lo + self.n + 1]
        return [b - a for a, b in zip(t, t[1:])]


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
        return sum(map(len, self._parts)) + len(self._tail)

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
    def _iter(part) -> Iterator:
        return iter(part)


class StepRows(_Parts):
    """The step table (STEP_COLUMNS rows, and the recorder's extra columns): tuples and stretches. `times` and
    `used` are what this table's stretches index (engine/fast_forward.py appends to them)."""

    __slots__ = ("times", "used", "_flattened")

    def __init__(self, rows: Iterable = ()) -> None:
        super().__init__(rows)
        self.times: list[float] = []
        self.used: list[int] = []
        self._flattened: tuple | None = None

    def __setstate__(self, rows) -> None:
        super().__setstate__(rows)
        self.times, self.used, self._flattened = [], [], None

    def clear(self) -> None:
        super().clear()
        self.times, self.used, self._flattened = [], [], None

    def flattened(self) -> tuple[list[Stretch], np.ndarray, np.ndarray, np.ndarray]:
        """(stretches, and their _flat: times, used, fields) of this table, made once while no part is added (the
        step columns and the ITL samples both read it; stretches are only ever added as parts)."""
        if self._flattened is None or self._flattened[0] != len(self._parts):
            stretches = list(compress(self._parts, map(isinstance, self._parts, repeat(Stretch))))
            self._flattened = (len(self._parts), stretches, *_flat(stretches))
        return self._flattened[1:]

    def flat_of(self, stretches: list[Stretch]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """_flat(stretches) for stretches of this table, from its own flattening (None if one is not in it)."""
        mine, times, used, fields = self.flattened()
        row = dict(zip(map(id, mine), range(len(mine))))
        rows = list(map(row.get, map(id, stretches)))
        if None in rows:
            return None
        return times, used, fields[rows]

    def add_stretch(self, stretch: Stretch) -> None:
        if stretch.n:
            self._add(stretch)

    @staticmethod
    def _iter(part) -> Iterator:
        return part.rows() if isinstance(part, Stretch) else iter(part)

    def columns(self, width: int, floats: tuple[int, ...]) -> list[np.ndarray]:
        """Every row's values, one array per column (width: STEP_COLUMNS and the recorder's extra columns): float64
        for the columns in `floats`, int64 for the others (converted from float64, as numbers taken from floats).
        The rows appended one by one as they were, the stretches' columns computed for all of them at once (a run
        has tens of thousands); each column is written once (a run's columns are tens of megabytes)."""
        parts = self._all()
        kinds = list(map(isinstance, parts, repeat(Stretch)))
        is_stretch = np.array(kinds, dtype=bool)
        rows = list(compress(parts, map(not_, kinds)))
        stretches, *flat = self.flattened()
        lens = np.empty(len(parts), dtype=np.int64)
        lens[~is_stretch] = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        if stretches:
            lens[is_stretch] = flat[2][:, 2]  # their n
        where = np.repeat(is_stretch, lens)
        cols = [np.zeros(len(where), dtype=np.float64 if k in floats else np.int64) for k in range(width)]
        if rows:
            n = len(where) - int(lens[is_stretch].sum())
            arr = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.float64,
                              count=n * width).reshape(n, width)
            at = slice(None) if n == len(where) else np.flatnonzero(~where)
            for k, (col, values) in enumerate(zip(cols, arr.T)):
                if k in floats or values.any():
                    col[at] = values if k in floats else values.astype(np.int64)
        if stretches:
            at = slice(None) if not rows else np.flatnonzero(where)
            for k, values in _stretch_columns(stretches, flat).items():
                cols[k][at] = values
        return cols


class _Repeated:
    """ITL samples of a stretch: each step's duration from step `first` on, once per row of the batch."""

    __slots__ = ("stretch", "first")

    def __init__(self, stretch: Stretch, first: int) -> None:
        self.stretch, self.first = stretch, first

    def __len__(self) -> int:
        return (self.stretch.n - self.first) * self.stretch.batch

    def __iter__(self) -> Iterator[float]:
        b = self.stretch.batch
        return chain.from_iterable(repeat(d, b) for d in self.stretch.durations(self.first))


class Samples(_Parts):
    """A table of floats (ITL samples): floats appended one by one, and a stretch's samples as its durations."""

    __slots__ = ()

    def add_stretch(self, stretch: Stretch, first: int) -> None:
        """The samples of `stretch`'s steps from step `first` on: each step's duration, `batch` times."""
        if stretch.n > first:
            self._add(_Repeated(stretch, first))

    def array(self, steps: StepRows | None = None) -> np.ndarray:
        """Every sample, in order, as a float64 array (the stretches' durations computed for all of them at once):
        each distinct value once, in order, then repeated as often as it occurs (one pass over the output).
        `steps`: the step table whose stretches these samples' are (its flattening is shared, not made again)."""
        parts = self._all()
        kinds = list(map(isinstance, parts, repeat(_Repeated)))
        reps = list(compress(parts, kinds))
        if not reps:
            return np.fromiter(chain.from_iterable(parts), dtype=np.float64, count=len(self))
        is_rep = np.array(kinds, dtype=bool)
        stretches = list(map(_STRETCH, reps))
        times, _, f = (steps is not None and steps.flat_of(stretches)) or _flat(stretches)
        first = np.fromiter(map(_FIRST, reps), dtype=np.int64, count=len(reps))
        m = f[:, 2] - first  # each stretch's durations
        floats = list(compress(parts, map(not_, kinds)))
        sizes = np.empty(len(parts), dtype=np.int64)
        sizes[~is_rep] = np.fromiter(map(len, floats), dtype=np.int64, count=len(floats))
        sizes[is_rep] = m
        where = np.repeat(is_rep, sizes)  # which values are durations
        values, counts = np.empty(len(where)), np.ones(len(where), dtype=np.int64)
        if floats:
            values[~where] = np.fromiter(chain.from_iterable(floats), dtype=np.float64,
                                         count=len(where) - int(m.sum()))
        at = _steps(f[:, 0] + first, m)
        values[where] = times[at + 1] - times[at]
        counts[where] = np.repeat(f[:, 3], m)
        return np.repeat(values, counts)


def _steps(lo: np.ndarray, n: np.ndarray) -> np.ndarray:
    """lo[i], lo[i] + 1, ..., lo[i] + n[i] - 1 for every i, in order."""
    offset = np.cumsum(n) - n
    return np.repeat(lo - offset, n) + np.arange(int(n.sum()))


_NAMES = ("lo", "ulo", "n", "batch", "ctx", "replica", "total_blocks", "waiting")
_FIELDS = attrgetter(*_NAMES)
_TIMES = attrgetter("times")
_STRETCH, _FIRST = attrgetter("stretch"), attrgetter("first")


def _flat(stretches: list[Stretch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, used, fields): the `times` and `used` lists the stretches index, each list once, in two arrays, and
    per stretch (a row) its _NAMES, with lo and ulo made offsets into those arrays."""
    fields = np.fromiter(chain.from_iterable(map(_FIELDS, stretches)), dtype=np.int64,
                         count=len(stretches) * len(_NAMES)).reshape(len(stretches), len(_NAMES))
    if not stretches:
        return np.empty(0), np.empty(0, dtype=np.int64), fields
    keys = list(map(id, map(_TIMES, stretches)))  # a replica's stretches share its step table's lists
    owner = dict(zip(reversed(keys), reversed(stretches)))  # each list's first stretch
    order = list(dict.fromkeys(keys))  # the lists in the order their first stretches come
    times = [np.fromiter(owner[k].times, dtype=np.float64, count=len(owner[k].times)) for k in order]
    used = [np.array(owner[k].used, dtype=np.int64) for k in order]
    if len(order) == 1:
        return times[0], used[0], fields
    which = np.fromiter(map(dict(zip(order, range(len(order)))).__getitem__, keys), dtype=np.int64, count=len(keys))
    fields[:, 0] += (np.cumsum([len(x) for x in times]) - [len(x) for x in times])[which]
    fields[:, 1] += (np.cumsum([len(x) for x in used]) - [len(x) for x in used])[which]
    return np.concatenate(times), np.concatenate(used), fields


def _stretch_columns(stretches: list[Stretch], flat: tuple | None = None) -> dict[int, np.ndarray]:
    """The stretches' rows, in order, by STEP_COLUMNS index (the columns not given are 0): each duration
    end - start, as stepping computes it. `flat`: their _flat, where made already."""
    times, used, f = flat or _flat(stretches)
    n = f[:, 2]
    steps = _steps(f[:, 0], n)
    starts, ends = times[steps], times[steps + 1]
    offset = np.cumsum(n) - n
    given = [i for i, s in enumerate(stretches) if s.start is not None]
    starts[offset[given]] = [stretches[i].start for i in given]
    batch, ctx, replica, total, waiting = (np.repeat(f[:, c], n) for c in range(3, 8))
    ctx += batch * (np.arange(len(steps)) - np.repeat(offset, n))
    return {0: replica, 1: starts, 2: ends - starts, 3: batch, 5: batch, 11: batch, 6: ctx, 7: ctx,
            8: used[_steps(f[:, 1], n)], 9: total, 10: waiting}
