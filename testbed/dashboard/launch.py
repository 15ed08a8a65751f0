"""Starting things from the dashboard: a simulation (with progress) and the Streamlit server itself."""
from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from testbed.engine.config import EngineConfig

APP = Path(__file__).with_name("app.py")
REPO_TRACES = Path(__file__).resolve().parents[2] / "traces"


@dataclass
class SimSettings:
    """What the launch form asks for; the fields mirror `testbed simulate` flags."""

    trace: str
    model: str = "Llama-3.1-8B"
    gpu: str = "H100-SXM"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    data_parallel_size: int = 1
    dp_policy: str = "least_loaded"
    policy: str = "fcfs"
    enable_prefix_caching: bool = False
    request_rate: float | None = None
    limit: int | None = None
    tensor_parallel_size: int = 1
    cost_model: str = "auto"
    burstiness: float = 1.0
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    num_gpu_blocks: int | None = None
    async_scheduling: bool = False

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            data_parallel_size=self.data_parallel_size, dp_policy=self.dp_policy, policy=self.policy,
                            enable_prefix_caching=self.enable_prefix_caching,
                            tensor_parallel_size=self.tensor_parallel_size, num_gpu_blocks=self.num_gpu_blocks,
                            async_scheduling=self.async_scheduling)


def inside(path: Path, folders: list) -> bool:
    """Whether `path` (links resolved) is one of `folders` or lies below one."""
    p = Path(path).expanduser().resolve()
    return any(p == (f := Path(folder).expanduser().resolve()) or f in p.parents for folder in folders)


def bundled_traces() -> list[Path]:
    """Trace files shipped under the repository's traces/ folder."""
    return sorted(p for p in REPO_TRACES.glob("*") if p.suffix in (".jsonl", ".csv")) if REPO_TRACES.is_dir() else []


def save_upload(name: str, data: bytes, folder: str | Path) -> Path:
    """Store an uploaded trace as <folder>/uploads/<name> (no manifest.json there, so it is never taken for a run)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name).lstrip(".") or "trace.jsonl"
    out = Path(folder) / "uploads" / safe
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def new_run_dir(folder: str | Path, settings: SimSettings) -> Path:
    """<folder>/<date>-sim-<trace>-<model>, the naming `testbed simulate` uses by default, made unique."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", x).strip("_") for x in (Path(settings.trace).stem, settings.model))
    out, n = Path(folder) / f"{stamp}-sim-{slug}", 1
    while out.exists():
        n += 1
        out = Path(folder) / f"{stamp}-sim-{slug}-{n}"
    return out


def simulate_run(settings: SimSettings, out_dir: Path, on_progress: Callable[[float, float], None]) -> Path:
    """Simulate into `out_dir` in-process, reporting (simulated seconds, horizon) as it goes; returns the
    run directory. Raises ValueError with the simulator's message on bad settings or traces."""
    from testbed.sim.run import run_simulation
    run_simulation(settings.trace, settings.engine_config(), model=settings.model, gpu=settings.gpu,
                   cost_model=settings.cost_model, request_rate=settings.request_rate, burstiness=settings.burstiness,
                   limit=settings.limit, slo_ttft=settings.slo_ttft, slo_tpot=settings.slo_tpot, output=out_dir,
                   progress=False, on_progress=on_progress)
    return out_dir


def dashboard_command(run_dirs: list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    """The `streamlit run` command line of the dashboard over `run_dirs` (absolute paths)."""
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--client.toolbarMode", "viewer",
            "--", "--runs", *[str(Path(d).expanduser().resolve()) for d in run_dirs]]


def main_dashboard(run_dirs: list[str], port: int, host: str = "127.0.0.1") -> int:
    """Serve the dashboard over the run folders until interrupted; returns Streamlit's exit status."""
    cmd = dashboard_command(run_dirs or ["runs"], port, host)
    print(f"testbed dashboard: http://{host}:{port}  (runs: {' '.join(cmd[cmd.index('--runs') + 1:])})",
          file=sys.stderr)
    proc = subprocess.Popen(cmd, env=_env())
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C (which reaches Streamlit too) or SIGTERM: never leave Streamlit behind
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        return 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _env() -> dict[str, str]:
    """The environment with this checkout first on PYTHONPATH, so child processes import this testbed."""
    paths = [str(APP.parents[2]), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
