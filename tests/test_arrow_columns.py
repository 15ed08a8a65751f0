"""arrow_columns.column builds the array pyarrow.array would (types, nulls, values), without importing pandas."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from testbed.runs.arrow_columns import column

CASES = [
    ([1, 2, 3], pa.int64()), ([1, None, 3], pa.int64()), ([], pa.int64()), ([], pa.string()), ([1, 2], pa.int32()),
    ([1.5, None, math.nan, 2], pa.float64()), (["a", None, "héllo", ""], pa.string()), ([None] * 9, pa.string()),
    (["x"] * 17 + [None], pa.string()), (np.array([1.0, 2.0]), pa.float64()), (np.array([3, 4]), pa.int64()),
    ([None] * 10 + [1.0], pa.float64()), (("a", "b"), pa.string()), ((1, None), pa.float64()),
]


@pytest.mark.parametrize("values,type", CASES)
def test_column_equals_pyarrow_array(values, type):
    got, want = column(values, type), pa.array(list(values), type=type)
    got.validate(full=True)
    assert got.type == want.type and got.null_count == want.null_count
    assert repr(got.to_pylist()) == repr(want.to_pylist())  # NaN compared by its text: a value, not a null


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(TypeError, match="no builder for bool"):
        column([True], pa.bool_())


def test_writing_a_run_does_not_import_pandas(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_tokens": 100, "output_tokens": 10}\n')
    code = ("import sys; from testbed.cli import main; "
            f"rc = main(['simulate', {str(trace)!r}, '-o', {str(tmp_path / 'run')!r}, '--no-progress']); "
            "assert rc == 0; assert 'pandas' not in sys.modules, 'pandas was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
