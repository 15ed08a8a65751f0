"""The GPU's clocks, power, temperature and utilisation logged beside a benchmark's runs (nvidia-smi as CSV)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def log_gpu_clocks(path: Path, every_ms: int) -> subprocess.Popen | None:
    """Start nvidia-smi writing a CSV row per GPU every `every_ms` to `path`; the process to terminate() when the
    runs are done, or None where there is no nvidia-smi (a CPU machine)."""
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                             "utilization.gpu", "--format=csv", "-lms", str(every_ms)], stdout=open(path, "w"))
