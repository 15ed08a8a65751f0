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

# %%
import matplotlib.pyplot as plt

from testbed import experiment, sweep
from testbed.specs.presets import get_model_spec
from testbed.rundir import read_run
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
