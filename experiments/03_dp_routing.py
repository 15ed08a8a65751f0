# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 3. Data-parallel routing at scale: prefix hits, tail latency and balance
#
# With prefix caching on every replica, which DP routing policy serves the Mooncake trace best as the
# number of replicas grows from 4 to 64: `round_robin`, `least_loaded` (vLLM's score), `kv_aware` (lowest
# projected KV use) or `prefix_affinity` (the replica most likely to hold the prompt's longest prefix)?
# Simulator only (`testbed simulate --data-parallel-size N --dp-policy P --enable-prefix-caching`), which routes
# as the real DP stack does: the coordinator decides on the replica stats it has been sent (one publication
# after every step that changed a replica's queues, one hop late), and a request reaches its replica
# `dp_routing_delay` after it arrived (the measured default).
#
# **Load.** Weak scaling: every replica gets the same offered load, `load` times the saturation rate of
# one replica, which is measured first (one replica, every request at once). N replicas get N times that
# rate; arrivals are re-drawn as a Poisson process (seeded), prompts and their shared prefixes are the
# trace's. **Trace.** `traces/mooncake_synthetic_tail500.jsonl`, the last 500 requests of Mooncake's
# synthetic trace (bundled; its first requests share almost no prefixes, its last ones do); `full=True`
# uses all 3,993 from `mooncake_synthetic.jsonl` in `$TESTBED_TRACES_DIR`. With 500 requests, 64 replicas get
# about 8 each, so the large-N end of the default run is a short transient; the full trace gives 62 each.
#
# **Metrics.** Prefix-cache hit rate (prompt tokens served from the cache / prompt tokens), TTFT p99, and
# load imbalance: the busiest replica's busy time (sum of its step durations, from `steps.parquet`) over
# the mean busy time of all N replicas (1 = perfectly even). The hit-rate bound is what one replica with an
# unlimited cache would reach: computed from the trace's `hash_ids` alone.

# %% tags=["parameters"]
full = False  # True: the whole Mooncake trace from $TESTBED_TRACES_DIR (3,993 requests)
output_dir = "runs/experiments/03_dp_routing"
seed = 0  # Poisson arrivals
jobs = 2  # worker processes
model = "Llama-3.1-8B"
gpu = "H100-SXM"
replicas = [4, 8, 16, 32, 64]
policies = ["round_robin", "least_loaded", "kv_aware", "prefix_affinity"]
load = 0.7  # offered load per replica, as a fraction of one replica's saturation rate
measured_dp = "benchmarks/results/dp/2026-11-26_08cb01d_h200x2_llama-3.2-1b"  # benchmarks/dp.py's real DP runs

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from testbed import experiment, sweep
from testbed.specs.presets import get_model_spec
from testbed.runs.rundir import read_run
from testbed.workload.prefix_reuse import prefix_reuse
from testbed.workload.trace import load_trace

out, env = experiment.start(output_dir, seeds={"arrivals": seed})
env

# %% [markdown]
# ## The trace and its prefix-reuse bound
#
# A prompt block can be served from the cache only if an earlier request had the same prefix up to and
# including that block. Counting such blocks over the trace, in arrival order, bounds the hit rate of any
# cache (`testbed.workload.prefix_reuse`, from `hash_ids` alone). Requests longer than the model's context are
# rejected by every configuration, so they are left out here as they are from the hit rate.

# %%
trace = experiment.trace_path(full, "traces/mooncake_synthetic_tail500.jsonl", "mooncake_synthetic.jsonl")
max_model_len = get_model_spec(model).max_position_embeddings
requests = load_trace(trace)
served = [r for r in requests if r.input_tokens + r.output_tokens <= max_model_len]
reuse = prefix_reuse(served)
bound, total = reuse.hit_rate, reuse.prompt_tokens
print(f"{len(requests)} requests, {len(requests) - len(served)} longer than {model}'s {max_model_len} tokens; the "
      f"others have {total} prompt tokens (mean {total / len(served):.0f}); hit-rate bound with one unlimited cache: "
      f"{bound:.2%}")

# %% [markdown]
# ## One replica's saturation rate

# %%
common = dict(model=model, gpu=gpu, enable_prefix_caching=True, seed=seed)
burst = sweep([{**common, "name": "saturation", "request_rate": float("inf")}], trace, output=out / "runs")
saturation = float(burst.loc[0, "request_throughput"])
print(f"one replica, all {burst.loc[0, 'num_requests']} requests at once: {saturation:.3f} req/s "
      f"({burst.loc[0, 'num_rejected']} rejected: {burst.loc[0, 'warnings'] or 'none'})")

# %% [markdown]
# ## The sweep: every policy at every size

# %%
configs = [{**common, "name": f"{p}-dp{n}", "data_parallel_size": n, "dp_policy": p,
            "request_rate": round(load * saturation * n, 6)} for n in replicas for p in policies]
results = sweep(configs, trace, jobs=jobs, output=out / "runs")


def imbalance(run_dir: str, n: int) -> tuple[float, float]:
    """(max / mean busy time, max / mean requests) over the n replicas."""
    run = read_run(run_dir)
    busy = run.steps(columns=["replica", "duration"]).groupby("replica")["duration"].sum().reindex(range(n),
                                                                                                 fill_value=0.0)
    reqs = run.requests(columns=["replica"])["replica"].value_counts().reindex(range(n), fill_value=0)
    return float(busy.max() / busy.mean()), float(reqs.max() / reqs.mean())


results[["imbalance_busy", "imbalance_requests"]] = [imbalance(d, n) for d, n in
                                                     zip(results["run_dir"], results["data_parallel_size"])]
print(f"cost model: {results['cost_model'].iloc[0]}")
assert (results["num_rejected"] == len(requests) - len(served)).all(), "only the requests too long for the model"

# %% [markdown]
# ## Hit rate, tail latency and balance against the number of replicas

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), layout="constrained")
for i, (p, g) in enumerate(results.groupby("dp_policy", sort=False)):
    style = dict(marker="o", ms=4, color=f"C{i}", label=p)
    axes[0].plot(g["data_parallel_size"], 100 * g["prefix_cache_hit_rate"], **style)
    axes[1].plot(g["data_parallel_size"], g["ttft_s.p99"], **style)
    axes[2].plot(g["data_parallel_size"], g["imbalance_busy"], **style)
axes[0].axhline(100 * bound, color="grey", ls=":", label="bound (one unlimited cache)")
for ax, (title, ylabel) in zip(axes, [("prefix-cache hit rate", "hit rate (%)"), ("TTFT p99", "TTFT p99 (s)"),
                                      ("load imbalance", "busiest / mean replica busy time")]):
    ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel="replicas", ylabel=ylabel)
    ax.set_xticks(replicas, [str(n) for n in replicas])
    ax.minorticks_off()
    ax.set_ylim(bottom=0 if ax is not axes[2] else 1)
    ax.grid(True, alpha=0.3)
axes[0].legend(fontsize=8)
fig.suptitle(f"{model} on {gpu} per replica, Mooncake ({len(requests)} requests), prefix caching, "
             f"{load:.0%} of one replica's saturation per replica", fontweight="bold")
experiment.save_figure(fig, out / "dp_routing.png")

# %%
table = results[["dp_policy", "data_parallel_size", "request_rate", "prefix_cache_hit_rate", "ttft_s.p50",
                 "ttft_s.p99", "imbalance_busy", "imbalance_requests", "num_finished", "num_rejected"]]
experiment.save_table(table, out / "dp_routing.csv")

# %% [markdown]
# ## Measured: one replica per GPU, and the simulator beside it
#
# The real DP runs committed by `benchmarks/dp.py` (RESULTS, "Data parallelism"): Llama-3.2-1B shape with dummy
# weights and CUDA graphs, DP=1 on one H200 against DP=2 on two (`least_loaded`), the first 1,000 requests of the
# Azure conversation trace at 96, 192 and 384 req/s. Each is simulated on the same requests, flags and KV size
# (`like`) with the profile shipped for the 1B model on an H200, and replayed from its own step times (decision
# parity: every routing and batch must match). The shipped profile predates graphed mixed steps, so the middle
# column is what its stated expected error warns about; the runs are short (a few seconds of arrivals), so
# their throughput is bounded by their length, not by the engines' capacity.

# %%
measured_runs = Path(measured_dp) / "runs"
real_dirs = sorted((p for p in measured_runs.glob("real-*x1-rate*") if p.is_dir()),
                   key=lambda p: (p.name.split("-")[1], float(p.name.split("rate")[1])))
assert real_dirs, f"no real DP runs under {measured_runs}"
dp_configs = []
for d in real_dirs:
    cfg = read_run(d).manifest["config"]
    base = dict(model="Llama-3.2-1B", gpu="H200", like=str(d), data_parallel_size=cfg["data_parallel_size"],
                dp_policy=cfg["dp_policy"], seed=cfg["seed"])
    dp_configs += [{**base, "name": f"{d.name}-profile"}, {**base, "name": f"{d.name}-recorded",
                                                           "cost_model": f"recorded:{d}"}]
dp_sims = sweep(dp_configs, jobs=jobs, output=out / "measured").set_index("name")
rows = []
for d in real_dirs:
    real = read_run(d).summary
    for label, source in (("real", real), ("simulated", dp_sims.loc[f"{d.name}-profile"]),
                          ("replayed", dp_sims.loc[f"{d.name}-recorded"])):
        rows.append({"layout": d.name.split("-")[1], "rate": float(d.name.split("rate")[1]), "source": label,
                     "output tok/s": float(source["output_throughput"]),
                     "TTFT p50 (ms)": 1e3 * float(source["ttft_s"]["p50"] if label == "real" else source["ttft_s.p50"]),
                     "TPOT p50 (ms)": 1e3 * float(source["tpot_s"]["p50"] if label == "real" else source["tpot_s.p50"])})
measured_table = pd.DataFrame(rows)
replayed = measured_table[measured_table["source"] == "replayed"].reset_index(drop=True)
real_only = measured_table[measured_table["source"] == "real"].reset_index(drop=True)
print(pd.DataFrame({"layout": real_only["layout"], "rate": real_only["rate"], "real tok/s": real_only["output tok/s"],
                    "replayed tok/s": replayed["output tok/s"]}).to_string(index=False))

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
for i, (layout, g) in enumerate(measured_table.groupby("layout", sort=True)):
    for source, marker, ls in (("real", "o", "-"), ("simulated", "x", "--")):
        s = g[g["source"] == source]
        axes[0].plot(s["rate"], s["output tok/s"], marker=marker, ls=ls, color=f"C{i}",
                     label=f"{'DP=1, 1 GPU' if layout == '1x1' else 'DP=2, 2 GPUs'} {source}")
        axes[1].plot(s["rate"], s["TPOT p50 (ms)"], marker=marker, ls=ls, color=f"C{i}")
axes[0].set(title="output throughput", xlabel="offered rate (req/s)", ylabel="tok/s")
axes[1].set(title="TPOT p50", xlabel="offered rate (req/s)", ylabel="ms")
for ax in axes:
    ax.grid(True, alpha=0.3)
axes[0].legend(fontsize=8)
fig.suptitle("Llama-3.2-1B shape on H200s: measured DP against the simulator (shipped profile)", fontweight="bold")
experiment.save_figure(fig, out / "dp_measured.png")

# %%
experiment.save_table(measured_table.round(3), out / "dp_measured.csv")
