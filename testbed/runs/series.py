"""Per-run arrays for the plots, read with parquet column selection and downsampled for display.

Timelines are cut into at most `max_bins` time buckets (seconds since the run's first arrival).
A per-step quantity is treated as a piecewise-constant signal over [start, start + duration) and
0 while the replica idles; each bucket holds its exact time average (integrated with a cumulative
sum and np.interp), so long steps that span buckets and short ones that share a bucket both count
by the time they lasted. Output tokens are counted when they are emitted: decode tokens at the end
of their step, each request's first token at its first_token time.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.runs.rundir import read_run

DONE = ("stop", "length")
_STEP_COLS = ["replica", "start", "duration", "num_reqs", "num_decode_tokens", "kv_blocks_used", "kv_blocks_total",
              "num_waiting", "num_running"]


def latency_samples(path: str) -> dict[str, np.ndarray]:
    """TTFT, TPOT and E2E (seconds) of the finished requests, defined as in testbed.engine.metrics."""
    r = read_run(path).requests(columns=["arrival", "first_token", "finish", "output_tokens", "finish_reason"])
    r = r[r["finish_reason"].isin(DONE)]
    arrival, first, finish = (r[c].to_numpy(np.float64, na_value=np.nan) for c in ("arrival", "first_token", "finish"))
    out = r["output_tokens"].to_numpy(np.int64)
    multi = out > 1
    ttft = first - arrival
    return {"ttft": ttft[~np.isnan(ttft)], "tpot": (finish[multi] - first[multi]) / (out[multi] - 1),
            "e2e": finish - arrival}


def cdf(values: np.ndarray, max_points: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Empirical CDF (sorted values, fraction <= value), thinned to at most `max_points` points, last kept."""
    xs = np.sort(np.asarray(values, dtype=np.float64))
    ys = np.arange(1, xs.size + 1) / max(xs.size, 1)
    if xs.size > max_points:
        idx = np.unique(np.linspace(0, xs.size - 1, max_points).round().astype(np.int64))
        xs, ys = xs[idx], ys[idx]
    return xs, ys


def time_average(start: np.ndarray, end: np.ndarray, value: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean over each bucket [edges[i], edges[i+1]) of `value` held on [start, end) and 0 elsewhere."""
    if start.size == 0:
        return np.zeros(edges.size - 1)
    order = np.argsort(start, kind="stable")
    s, e, v = start[order], end[order], value[order].astype(np.float64)
    e = np.maximum(np.minimum(e, np.append(s[1:], np.inf)), s)   # clip overlaps so the knots stay sorted
    area = np.cumsum(v * (e - s))
    knots = np.empty(2 * s.size)
    cum = np.empty(2 * s.size)
    knots[0::2], knots[1::2] = s, e
    cum[0::2], cum[1::2] = np.concatenate(([0.0], area[:-1])), area
    integral = np.interp(edges, knots, cum, left=0.0, right=area[-1])
    return np.diff(integral) / np.diff(edges)


def _bins(steps: pd.DataFrame, req: pd.DataFrame, max_bins: int) -> tuple[float, np.ndarray]:
    """Origin (first arrival, else first step) and bucket edges covering the whole run."""
    t0 = req["arrival"].min() if len(req) else (steps["start"].min() if len(steps) else 0.0)
    ends = [x for x in ((steps["start"] + steps["duration"]).max() if len(steps) else None,
                        req["finish"].max() if len(req) else None) if x is not None and np.isfinite(x)]
    horizon = max(max(ends, default=t0) - t0, 1e-6)
    n = int(np.clip(len(steps) // 10, 10, max_bins))
    return float(t0), np.linspace(0.0, horizon, n + 1)


def _load(path: str, step_cols: list[str], req_cols: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    run = read_run(path)
    return run.steps(columns=step_cols), run.requests(columns=req_cols)


def timeline(path: str, max_bins: int = 1000) -> pd.DataFrame:
    """Per bucket: output tokens/s, KV utilisation (mean over replicas), running and waiting requests
    (summed over replicas) and batch size (requests per step, mean over replicas)."""
    steps, req = _load(path, _STEP_COLS, ["arrival", "first_token", "finish", "replica"])
    t0, edges = _bins(steps, req, max_bins)
    width = np.diff(edges)
    start = steps["start"].to_numpy(np.float64) - t0
    end = start + steps["duration"].to_numpy(np.float64)
    first = req["first_token"].to_numpy(np.float64, na_value=np.nan) - t0
    tokens = np.histogram(end, edges, weights=steps["num_decode_tokens"].to_numpy(np.float64))[0]
    tokens += np.histogram(first[~np.isnan(first)], edges)[0]
    total = steps["kv_blocks_total"].to_numpy(np.float64)
    kv = np.divide(steps["kv_blocks_used"].to_numpy(np.float64), total, out=np.zeros_like(total), where=total > 0)
    rep = steps["replica"].to_numpy()
    replicas = np.unique(rep)
    acc = {k: np.zeros(edges.size - 1) for k in ("kv", "running", "waiting", "batch")}
    for r in replicas:
        m = rep == r
        acc["kv"] += time_average(start[m], end[m], kv[m], edges)
        for key, col in (("running", "num_running"), ("waiting", "num_waiting"), ("batch", "num_reqs")):
            acc[key] += time_average(start[m], end[m], steps[col].to_numpy()[m], edges)
    k = max(len(replicas), 1)
    return pd.DataFrame({"t": (edges[:-1] + edges[1:]) / 2, "output_tok_s": tokens / width,
                         "kv_util": acc["kv"] / k, "running": acc["running"], "waiting": acc["waiting"],
                         "batch_size": acc["batch"] / k})


def replica_load(path: str, max_bins: int = 300) -> pd.DataFrame:
    """Long table (t, replica, routed_req_s, running): requests routed to and running on each DP replica."""
    steps, req = _load(path, ["replica", "start", "duration", "num_running"], ["arrival", "finish", "replica"])
    t0, edges = _bins(steps, req, max_bins)
    centers = (edges[:-1] + edges[1:]) / 2
    start = steps["start"].to_numpy(np.float64) - t0
    end = start + steps["duration"].to_numpy(np.float64)
    arrival = req["arrival"].to_numpy(np.float64) - t0
    frames = []
    for r in sorted(set(steps["replica"].unique()) | set(req["replica"].dropna().unique())):
        ms, mr = (steps["replica"] == r).to_numpy(), (req["replica"] == r).to_numpy()
        frames.append(pd.DataFrame({
            "t": centers, "replica": int(r), "routed_req_s": np.histogram(arrival[mr], edges)[0] / np.diff(edges),
            "running": time_average(start[ms], end[ms], steps["num_running"].to_numpy()[ms], edges)}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["t", "replica", "routed_req_s",
                                                                                     "running"])


def step_points(path: str, max_points: int = 4000, seed: int = 0) -> pd.DataFrame:
    """(batch_tokens, duration_ms) of up to `max_points` steps drawn uniformly (fixed seed) for the scatter."""
    s = read_run(path).steps(columns=["num_prefill_tokens", "num_decode_tokens", "duration"])
    if len(s) > max_points:
        s = s.iloc[np.sort(np.random.default_rng(seed).choice(len(s), max_points, replace=False))]
    return pd.DataFrame({"batch_tokens": (s["num_prefill_tokens"] + s["num_decode_tokens"]).to_numpy(),
                         "duration_ms": s["duration"].to_numpy(np.float64) * 1e3})
