"""`testbed simulate --like RUN_DIR`: simulate the workload a recorded run served, on the cache it had.

The run's requests become the trace (`load_trace` reads a run directory as the trace of the requests it
recorded); its KV-cache size and max_model_len fill the engine settings the flags left unset, so the
simulator schedules into the same memory as the run (a real `bench serve`, `replay`, or another simulation).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from testbed.engine.config import EngineConfig
from testbed.rundir import RunDirError, read_run


def run_cache(run_dir: str | Path) -> tuple[int, int | None]:
    """(KV blocks per replica, max_model_len or None) a run served with: from its manifest (`testbed simulate`
    and `replay` record both; `bench serve` records the server's max_model_len), else the blocks from its
    step records (a `bench serve` run with --server-log-steps)."""
    run = read_run(run_dir)
    m = run.manifest
    server_model = (m.get("server") or {}).get("model") or {}
    max_len = m.get("max_model_len") or server_model.get("max_model_len")
    blocks = m.get("num_gpu_blocks")
    if blocks is None:
        total = run.steps(columns=["kv_blocks_total"])["kv_blocks_total"]
        blocks = int(total.max()) if len(total) else None
    if blocks is None:
        raise RunDirError(f"{run_dir}: the run records no KV-cache size (no num_gpu_blocks in manifest.json and no "
                          "step records; a `bench serve` run needs --server-log-steps); pass --num-gpu-blocks")
    return int(blocks), (int(max_len) if max_len else None)


def like_config(run_dir: str | Path, config: EngineConfig) -> EngineConfig:
    """`config` with num_gpu_blocks and max_model_len taken from the run where they are unset (None)."""
    blocks, max_len = run_cache(run_dir)
    return dataclasses.replace(config, num_gpu_blocks=config.num_gpu_blocks or blocks,
                               max_model_len=config.max_model_len or max_len)
