"""Matplotlib figures of one or more runs; sim runs draw solid lines / dots, real runs dashed lines / crosses.

Every function takes [(Series, data)] pairs (data from testbed.runs.series) and returns a
Figure with a title, axis labels with units and a legend naming each run and its mode. Colours come from
`series_of`, the one source of run colours: a run's rank among the runs drawn (real runs first, then by
label), so a run keeps its colour across all figures, and `testbed compare --png` and the dashboard draw
the same runs in the same colours whatever order they were given in.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from testbed.runs.series import cdf  # noqa: E402


@dataclass(frozen=True)
class Series:
    """How one run is drawn: its legend label, mode (sim / real) and colour index."""

    label: str
    mode: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.label} ({self.mode})"

    @property
    def color(self) -> str:
        """Its matplotlib colour (the default cycle's entry `index`)."""
        return f"C{self.index % 10}"

    def line(self) -> dict:
        """Real runs wide, dashed and translucent on top, simulations thin and solid beneath: a simulation that
        lies on a real curve (a recorded timeline) still shows through the dashes."""
        if self.mode == "real":
            return {"color": self.color, "linestyle": (0, (5, 3)), "linewidth": 2.6, "alpha": 0.75,
                    "label": self.name, "zorder": 3}
        return {"color": self.color, "linestyle": "-", "linewidth": 1.1, "label": self.name, "zorder": 2}


def series_of(runs: list[tuple[str, str]]) -> list[Series]:
    """One Series per (label, mode), in the order given, each coloured by its run's rank among `runs` (real runs
    first, then by label), not by its position: the same runs get the same colours in every figure."""
    order = sorted(range(len(runs)), key=lambda i: (runs[i][1] != "real", runs[i][0]))
    rank = {i: k for k, i in enumerate(order)}
    return [Series(label, mode, rank[i]) for i, (label, mode) in enumerate(runs)]


def to_png(fig: Figure, dpi: int = 100) -> bytes:
    """PNG bytes of a figure (closed afterwards, so a long-running dashboard does not pile up figures). The
    metadata is fixed (no software string; PNGs carry no date), so the bytes depend only on the figure."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _finish(fig: Figure, title: str) -> Figure:
    fig.suptitle(title, fontsize=12, fontweight="bold")
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False,
                   markerscale=2)
    return fig


def latency_cdfs(runs: list[tuple[Series, dict[str, np.ndarray]]]) -> Figure:
    """CDFs of TTFT (ms), TPOT (ms) and E2E (s); log x axis where a metric spans over two decades."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), layout="constrained")
    for ax, (key, title, unit, scale) in zip(axes, (("ttft", "TTFT", "ms", 1e3), ("tpot", "TPOT", "ms", 1e3),
                                                    ("e2e", "E2E latency", "s", 1.0))):
        lo, hi = np.inf, 0.0
        for s, samples in runs:
            xs, ys = cdf(samples[key] * scale)
            if xs.size:
                ax.plot(xs, ys, drawstyle="steps-post", **s.line())
                pos = xs[xs > 0]
                lo, hi = (min(lo, pos[0]), max(hi, pos[-1])) if pos.size else (lo, hi)
        if hi > 0 and hi / lo > 100:
            ax.set_xscale("log")
        ax.set(title=title, xlabel=f"{title.split()[0]} ({unit})", ylabel="fraction of requests", ylim=(0, 1.02))
    return _finish(fig, "Latency CDFs")


def _timeline(runs: list[tuple[Series, pd.DataFrame]], panels: list[tuple[str, str, float]], title: str,
              height: float = 3.6) -> Figure:
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, height * len(panels)), sharex=True, squeeze=False,
                             layout="constrained")
    for ax, (col, ylabel, scale) in zip(axes[:, 0], panels):
        for s, df in runs:
            ax.plot(df["t"], df[col] * scale, **s.line())
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    axes[-1, 0].set_xlabel("time since first arrival (s)")
    return _finish(fig, title)


def throughput(runs: list[tuple[Series, pd.DataFrame]]) -> Figure:
    return _timeline(runs, [("output_tok_s", "output tokens/s", 1.0)], "Output throughput over time")


def kv_utilisation(runs: list[tuple[Series, pd.DataFrame]]) -> Figure:
    return _timeline(runs, [("kv_util", "KV blocks used (%)", 100.0)], "KV-cache utilisation over time")


def queues(runs: list[tuple[Series, pd.DataFrame]]) -> Figure:
    return _timeline(runs, [("running", "running requests", 1.0), ("waiting", "waiting requests", 1.0),
                            ("batch_size", "batch size (requests/step)", 1.0)],
                     "Running / waiting requests (all replicas) and batch size (mean per replica)", height=2.6)


def replica_load(runs: list[tuple[Series, pd.DataFrame]]) -> Figure:
    """One row per DP run: requests routed to each replica (req/s) and requests running on it."""
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 3.2 * len(runs)), squeeze=False, layout="constrained")
    for (left, right), (s, df) in zip(axes, runs):
        for i, (rep, g) in enumerate(df.groupby("replica")):
            style = {"color": f"C{i % 10}", "linestyle": "--" if s.mode == "real" else "-", "linewidth": 1.2}
            left.plot(g["t"], g["routed_req_s"], label=f"replica {rep}", **style)
            right.plot(g["t"], g["running"], label=f"replica {rep}", **style)
        left.set(title=f"{s.name}: routed requests", ylabel="requests/s", xlabel="time since first arrival (s)")
        right.set(title=f"{s.name}: running requests", ylabel="requests", xlabel="time since first arrival (s)")
        left.legend(fontsize=7, ncol=4)
    fig.suptitle("Per-replica load (data parallel runs)", fontsize=12, fontweight="bold")
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
    return fig


def step_scatter(runs: list[tuple[Series, pd.DataFrame]]) -> Figure:
    """Step duration against tokens in the batch: the cost model's predictions beside real steps."""
    fig, ax = plt.subplots(figsize=(13, 4.5), layout="constrained")
    for s, df in runs:
        real = s.mode == "real"
        ax.scatter(df["batch_tokens"], df["duration_ms"], s=10 if real else 6, alpha=0.6 if real else 0.35,
                   marker="x" if real else "o", color=s.color, label=s.name, linewidths=0.8 if real else 0)
    ax.set(xlabel="tokens in batch (prefill + decode)", ylabel="step duration (ms)")
    if any(len(df) for _, df in runs):
        ax.set_xscale("symlog", linthresh=10)
    return _finish(fig, "Step duration vs batch tokens (sim: dots, real: crosses)")
