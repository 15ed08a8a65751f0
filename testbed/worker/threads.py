"""How many torch intra-op threads a CPU engine process runs.

An engine process that the testbed starts (the engine core of `testbed serve`, a data-parallel replica) takes
the cores it may run on (its CPU affinity), split among the CPU engine processes sharing them, and at most
OMP_NUM_THREADS when that is set. The offline `LLM` runs in the caller's process and keeps the caller's
setting (torch's default: one thread per core). More threads than cores make OpenMP's barriers wait on
descheduled threads, which costs far more than the lost parallelism of tiny decode matmuls.
"""
from __future__ import annotations

import os
import sys


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cpu_threads(processes: int = 1) -> int:
    """Threads for each of `processes` CPU engine processes sharing this host's usable cores."""
    n = max(1, usable_cores() // max(1, processes))
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return min(n, int(omp)) if omp.isdigit() and int(omp) > 0 else n


def set_engine_threads(processes: int = 1) -> int:
    """Set torch's intra-op threads of this engine process to `cpu_threads(processes)` and return the number;
    0 (nothing set) when the process's executor runs without torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    n = cpu_threads(processes)
    torch.set_num_threads(n)
    return n
