"""Data-parallel deployment rules without processes: GPU placement as vLLM's (replica r takes devices
r*TP .. r*TP+TP-1 in CUDA_VISIBLE_DEVICES order, wrapping around when replicas share GPUs), CPU
thread split, and the --data-parallel-* flag checks of `testbed serve`."""
from __future__ import annotations

import pytest

from testbed.cli import main
from testbed.runtime.dp_launch import replica_devices, replica_env, shares_devices
from testbed.worker.threads import cpu_threads, usable_cores


def test_replicas_take_consecutive_device_slices_in_visible_order():
    devs = ["4", "5", "6", "7"]
    assert [replica_devices(r, 2, devs) for r in range(2)] == [["4", "5"], ["6", "7"]]
    assert [replica_devices(r, 1, devs) for r in range(4)] == [["4"], ["5"], ["6"], ["7"]]
    assert replica_env(1, 2, 2, devs) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert not shares_devices(2, 2, devs) and not shares_devices(4, 1, devs)


def test_more_replicas_than_gpus_share_them_and_size_their_cache_from_their_share():
    assert [replica_devices(r, 1, ["0"]) for r in range(2)] == [["0"], ["0"]]
    assert replica_env(1, 1, 2, ["0"]) == {"CUDA_VISIBLE_DEVICES": "0", "TESTBED_SHARED_GPU": "1"}
    assert [replica_devices(r, 2, ["0", "1"]) for r in range(2)] == [["0", "1"], ["0", "1"]]
    assert shares_devices(2, 1, ["0"]) and replica_env(0, 1, 2, None) == {}
    with pytest.raises(ValueError, match="needs 4 GPUs per replica"):
        replica_devices(0, 4, ["0", "1"])


def test_cpu_replicas_split_the_cores_within_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = usable_cores()
    assert cpu_threads(1) == n and cpu_threads(n + 5) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads(1) == 1


@pytest.mark.parametrize("args, needle", [
    (["--headless"], "need --data-parallel-size > 1"),
    (["-dp", "2", "--headless"], "a headless node needs it"),
    (["-dp", "2", "--headless", "--data-parallel-size-local", "1"], "--data-parallel-start-rank 0"),
    (["-dp", "3", "--headless", "-dpl", "2", "-dpr", "2"], "must be in 1..1"),
    (["-dp", "2", "--data-parallel-size-local", "3"], "give 1..2 replicas"),
    (["-dp", "2", "--data-parallel-start-rank", "1"], "only a --headless node starts elsewhere"),
    (["-dp", "2", "--data-parallel-backend", "ray", "-dpl", "1"], "drop --headless, --data-parallel-size-local"),
    (["--data-parallel-backend", "ray"], "need --data-parallel-size > 1"),
    (["-dp", "2", "--dp-stats-interval", "-1"], "--dp-stats-interval: must be a number of seconds >= 0"),
    (["-dp", "2", "--data-parallel-heartbeat-timeout", "2.5"], "at least 3 (3 heartbeat intervals"),
    (["-dp", "2", "--data-parallel-heartbeat-timeout", "inf"], "give a finite number of seconds"),
    (["-dp", "2", "--data-parallel-heartbeat-interval", "0.5", "--data-parallel-heartbeat-timeout", "1.4"],
     "at least 1.5 (3 heartbeat intervals: a live replica sends one every 0.5 s"),
    (["-dp", "2", "--data-parallel-heartbeat-interval", "0"], "--data-parallel-heartbeat-interval 0: give a positive"),
])
def test_bad_data_parallel_flags_fail_before_anything_starts(capsys, args, needle):
    assert main(["serve", "--load-format", "dummy", *args]) == 2
    assert needle in capsys.readouterr().err
