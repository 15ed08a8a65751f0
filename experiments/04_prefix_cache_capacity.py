# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 4. Prefix-cache capacity: hit rate against KV blocks, up to the bound
#
# How much of the Mooncake trace's prompts does one replica serve from its prefix cache, as a function of
# the number of KV blocks it has? The ceiling is a property of the trace: the share of prompt tokens that
# repeat an earlier request's prefix, computed from `hash_ids` alone (`testbed.workload.prefix_reuse`). With a
# cache that never has to evict, the simulator must reach exactly that ceiling, apart from requests that
# arrive while the request they share a prefix with is still being prefilled: at a low enough rate there
# are none.
#
# One replica with prefix caching, Poisson arrivals at `load` times its measured saturation rate, the
# number of KV blocks swept from a few thousand to "unlimited" (every request's blocks at once, so nothing
# is evicted: a what-if no GPU has). **Trace.** The bundled last 500 requests of Mooncake's synthetic trace;
# `full=True` uses all 3,993 from `mooncake_synthetic.jsonl` in `$TESTBED_TRACES_DIR`.

# %% tags=["parameters"]
full = False  # True: the whole Mooncake trace from $TESTBED_TRACES_DIR (3,993 requests)
output_dir = "runs/experiments/04_prefix_cache_capacity"
seed = 0  # Poisson arrivals
jobs = 2  # worker processes
model = "Llama-3.1-8B"
gpu = "H100-SXM"
load = 0.5  # offered load, as a fraction of the replica's saturation rate
idle_load = 0.02  # a rate low enough that no two requests are in flight together (the bound's setting)

# %%
import matplotlib.pyplot as plt

from testbed import experiment, sweep
from testbed.specs.presets import get_model_spec
from testbed.workload.prefix_reuse import prefix_reuse
from testbed.workload.trace import load_trace

out, env = experiment.start(output_dir, seeds={"arrivals": seed})
env

# %% [markdown]
# ## The bound from `hash_ids`

# %%
trace = experiment.trace_path(full, "traces/mooncake_synthetic_tail500.jsonl", "mooncake_synthetic.jsonl")
max_model_len = get_model_spec(model).max_position_embeddings
requests = load_trace(trace)
served = [r for r in requests if r.input_tokens + r.output_tokens <= max_model_len]  # the others are rejected
reuse = prefix_reuse(served)
need = [-(-(r.input_tokens + r.output_tokens) // 16) for r in served]  # KV blocks of 16 tokens per request
unlimited = sum(need)  # every request's blocks at once: nothing is ever evicted
print(f"{len(served)} of {len(requests)} requests fit {model}; {reuse.prompt_tokens} prompt tokens, "
      f"{reuse.reusable_tokens} of them reusable: bound {reuse.hit_rate:.2%}; the longest request needs "
      f"{max(need)} blocks, an unlimited cache {unlimited}")

# %% [markdown]
# ## Saturation rate, then the sweep over cache sizes
#
# The saturation rate is measured with every request at once on the unlimited cache; the sizes swept are the
# powers of two from the first that holds the longest request (a smaller cache would reject it) up to the
# unlimited one.

# %%
common = dict(model=model, gpu=gpu, enable_prefix_caching=True, seed=seed)
burst = sweep([{**common, "name": "saturation", "request_rate": float("inf"), "num_gpu_blocks": unlimited}], trace,
              output=out / "runs")
saturation = float(burst.loc[0, "request_throughput"])
blocks = [2 ** k for k in range(max(need).bit_length(), unlimited.bit_length())] + [unlimited]
configs = [{**common, "name": f"blocks{b}", "num_gpu_blocks": b, "request_rate": round(load * saturation, 6)}
           for b in blocks]
configs.append({**common, "name": "unlimited-idle", "num_gpu_blocks": unlimited,
                "request_rate": round(idle_load * saturation, 6)})
results = sweep(configs, trace, jobs=jobs, output=out / "runs")
results["unlimited"] = results["num_gpu_blocks"] == unlimited
print(f"saturation {saturation:.3f} req/s; cost model: {results['cost_model'].iloc[0]}")
assert (results["num_rejected"] == len(requests) - len(served)).all(), "only the requests too long for the model"

# %% [markdown]
# ## Hit rate against cache size

# %%
sized = results[results["name"] != "unlimited-idle"]
fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
ax.plot(sized["num_gpu_blocks"], 100 * sized["prefix_cache_hit_rate"], marker="o", label=f"simulated, {load:.0%} load")
idle = results[results["name"] == "unlimited-idle"].iloc[0]
ax.plot([idle["num_gpu_blocks"]], [100 * idle["prefix_cache_hit_rate"]], marker="*", ms=12, ls="",
        label=f"simulated, unlimited cache, {idle_load:.0%} load")
ax.axhline(100 * reuse.hit_rate, color="grey", ls=":", label="bound from hash_ids")
ax.set_xscale("log", base=2)
ax.set(xlabel="KV blocks (16 tokens each)", ylabel="prefix-cache hit rate (%)", ylim=(0, 100),
       title=f"{model} on {gpu}, Mooncake ({len(served)} requests), one replica")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8, loc="lower right")
experiment.save_figure(fig, out / "hit_rate.png")

# %%
table = results[["name", "num_gpu_blocks", "request_rate", "prefix_cache_hit_rate", "kv_util_max", "ttft_s.p50",
                 "ttft_s.p99", "num_preemptions"]].assign(bound=reuse.hit_rate)
table["hit rate - bound"] = table["prefix_cache_hit_rate"] - table["bound"]
experiment.save_table(table, out / "hit_rate.csv")
