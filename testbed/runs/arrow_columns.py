"""Arrow arrays built from Python lists through numpy buffers.

`pyarrow.array` imports pandas on its first call (to ask whether its input is a pandas object), which
costs a quarter of a second of start-up for a command that writes a run directory and never needs
pandas. `column` builds the same array (None as null, NaN kept as a value) from raw buffers instead;
it takes the types run directories use: int32, int64, float64 and string.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

_NUMERIC = {pa.int32(): np.int32, pa.int64(): np.int64, pa.float64(): np.float64}


def _validity(values: Sequence) -> tuple[pa.Buffer | None, int]:
    """The validity bitmap (None when nothing is null) and the null count."""
    nulls = [v is None for v in values]
    count = sum(nulls)
    if not count:
        return None, 0
    bits = np.packbits(~np.asarray(nulls, dtype=bool), bitorder="little")
    return pa.py_buffer(bits.tobytes()), count


def column(values: Sequence, type: pa.DataType) -> pa.Array:
    """`values` (a list or a 1-D numpy array; None = null) as an Arrow array of `type`; TypeError for a
    type not listed in the module docstring."""
    n = len(values)
    if type == pa.string():
        validity, nulls = _validity(values)
        data = [b"" if v is None else str(v).encode() for v in values]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum([len(b) for b in data], out=offsets[1:])
        return pa.Array.from_buffers(type, n, [validity, pa.py_buffer(offsets.tobytes()),
                                               pa.py_buffer(b"".join(data))], null_count=nulls)
    dtype = _NUMERIC.get(type)
    if dtype is None:
        raise TypeError(f"arrow_columns.column: no builder for {type} (int32, int64, float64, string)")
    if isinstance(values, np.ndarray):
        validity, nulls, filled = None, 0, values
    else:
        validity, nulls = _validity(values)
        filled = values if not nulls else [0 if v is None else v for v in values]
    arr = np.ascontiguousarray(filled, dtype=dtype)
    return pa.Array.from_buffers(type, n, [validity, pa.py_buffer(arr)], null_count=nulls)
