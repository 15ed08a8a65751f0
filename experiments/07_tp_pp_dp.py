# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 7. Tensor, pipeline or data parallelism: Llama-3.1-70B on 8 H100s
#
# Eight GPUs can hold Llama-3.1-70B as one TP=8 group, as pipeline stages of smaller TP groups (PP=2 x TP=4,
# PP=4 x TP=2, PP=8), or as several replicas (DP=2 x TP=4, DP=2 x PP=2 x TP=2). Which serves the most requests
# within chat SLOs? Every layout is simulated on the Azure conversation trace's request lengths with Poisson
# arrivals over a range of rates, with the roofline (no profile ships for a 70B model):
#
# - TP divides each layer's weights, KV heads and FLOPs by TP and adds two all-reduces per layer per step
#   (`testbed/sim/cost_model.py`, the all-reduce measured between two GPUs and extrapolated by the ring formula);
# - PP cuts the layers into stages by vLLM's rule (`testbed/specs/partition.py`); each stage is a resource a batch
#   crosses after the previous one, plus the activations' transfer, and up to PP batches are in flight, with a
#   request in at most one of them (`testbed/sim/pipeline.py`, the batch queue of `testbed/engine/stepper.py`);
# - DP runs independent replicas behind the least-loaded router (`testbed/engine/coordinator.py`).
#
# Each layout's KV cache is what its ranks have left after their weights (a PP stage holds its own layers, so
# PP leaves more KV per GPU than TP at the same GPU count). No 70B point was measured. What was measured is the
# same question at a size two GPUs hold: `benchmarks/pp.py` ran PP=2 against TP=2 against DP=2 for the Llama-3.1-8B
# shape on 2 H100s (2026-11-26, `benchmarks/results/pp/`), and part 2 shows those serving runs beside their
# simulations (TP=2 led there: a lower TPOT at the same rate).

# %% tags=["parameters"]
full = False  # True: the whole Azure conversation hour ($TESTBED_TRACES_DIR) at more rates
output_dir = "runs/experiments/07_tp_pp_dp"
measured = "benchmarks/results/pp"  # benchmarks/pp.py's output folders (results.json), when there are any
seed = 0
jobs = 2
model = "Llama-3.1-70B"
gpu = "H100-SXM"
layouts = [(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (4, 1, 2)]  # (DP, PP, TP), 8 GPUs
slo_ttft_s = 2.5  # as notebook 5: the first token within 2.5 s,
slo_tpot_s = 0.15  # then a token every 150 ms at most

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display

from testbed import experiment, sweep
from testbed.sim.cost_model import num_gpu_blocks
from testbed.specs.hardware import get_gpu_spec
from testbed.specs.partition import pp_partition
from testbed.specs.presets import get_model_spec

out, env = experiment.start(output_dir, seeds={"arrivals": seed})
env

# %% [markdown]
# ## Part 1. Which layouts fit, and the KV cache each leaves
#
# Per layout: the layers per stage, the KV tokens of one replica (the fewest any of its stages has room for, as
# real mode sizes it), and the KV tokens over the 8 GPUs.

# %%
spec, g = get_model_spec(model), get_gpu_spec(gpu)
rows = []
for dp, pp, tp in layouts:
    name = f"DP{dp} x PP{pp} x TP{tp}"
    row = {"layout": name, "dp": dp, "pp": pp, "tp": tp, "stages": "/".join(map(str, pp_partition(spec.num_hidden_layers, pp)))}
    try:
        blocks = num_gpu_blocks(spec, g, 16, 0.9, tp, pipeline_parallel_size=pp)
        row.update(fits=True, kv_tokens_per_replica=blocks * 16, kv_tokens_total=blocks * 16 * dp, why="")
    except ValueError as e:
        row.update(fits=False, kv_tokens_per_replica=0, kv_tokens_total=0, why=str(e).split(": ", 1)[1].split("; ")[0])
    rows.append(row)
fits = pd.DataFrame(rows)
experiment.save_table(fits, out / "layouts.csv")
fitting = fits[fits["fits"]]

# %% [markdown]
# ## Part 2. Goodput under SLOs against the offered rate

# %%
trace = experiment.trace_path(full, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv")
limit, rates = (None, [1, 2, 4, 6, 8, 12, 16, 24, 32]) if full else (150, [1, 4, 8])
common = dict(model=model, gpu=gpu, cost_model="roofline", seed=seed, slo_ttft=slo_ttft_s, slo_tpot=slo_tpot_s,
              limit=limit)
configs = [{**common, "name": f"dp{r.dp}-pp{r.pp}-tp{r.tp}-rate{rate}", "data_parallel_size": r.dp,
            "pipeline_parallel_size": r.pp, "tensor_parallel_size": r.tp, "request_rate": rate}
           for r in fitting.itertuples() for rate in rates]
sims = sweep(configs, trace, jobs=jobs, output=out / "runs")
sims["layout"] = [f"DP{d} x PP{p} x TP{t}" for d, p, t in zip(sims["data_parallel_size"], sims["pipeline_parallel_size"],
                                                              sims["tensor_parallel_size"])]
sims["goodput per GPU"] = sims["goodput"] / 8
experiment.save_table(sims[["layout", "request_rate", "goodput", "goodput per GPU", "output_throughput", "ttft_s.p50",
                            "ttft_s.p99", "tpot_s.p50", "tpot_s.p99", "num_preemptions"]], out / "rates.csv")

measured_runs = sorted(Path(measured).glob("*/results.json")) if Path(measured).is_dir() else []
points = []
for path in measured_runs:  # benchmarks/pp.py: real and simulated serving, per layout
    res = json.loads(path.read_text())
    for layout, row in res.get("serving", {}).items():
        points.append({"source": str(path.parent), "layout": layout, "model": res["model"], "gpu": res["gpu"],
                       **{f"{k} {s}": v[s] for k, v in row.items() if isinstance(v, dict) for s in ("real", "sim")}})
if points:
    experiment.save_table(pd.DataFrame(points), out / "measured.csv")
else:
    display(Markdown(f"No measured point yet: `{measured}` holds no `benchmarks/pp.py` results, so every point "
                     "below is simulated."))

# %% [markdown]
# ## Figure
#
# (a) Goodput (requests meeting both SLOs per second) against the offered rate, per layout. (b) TPOT p50 against
# output throughput, one point per rate. All simulated (the roofline); none measured.

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
for i, (layout, grp) in enumerate(sims.groupby("layout", sort=False)):
    style = dict(marker="o", ms=3, color=f"C{i}", ls="-" if "PP1 " in layout else "--", label=f"{layout} (simulated)")
    axes[0].plot(grp["request_rate"], grp["goodput"], **style)
    axes[1].plot(grp["output_throughput"], 1e3 * grp["tpot_s.p50"], **style)
axes[0].plot(rates, rates, ":", color="grey", lw=1)
axes[0].set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", ylim=(0, None),
            title=f"(a) goodput, TTFT <= {slo_ttft_s:g} s and TPOT <= {slo_tpot_s * 1e3:g} ms")
axes[1].set(xlabel="output throughput (tok/s)", ylabel="TPOT p50 (ms)", title="(b) latency against throughput")
for ax in axes:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
fig.suptitle(f"{model} on 8 x {gpu}: tensor, pipeline and data parallelism (simulated, roofline)", fontweight="bold")
experiment.save_figure(fig, out / "tp_pp_dp.png")

# %% [markdown]
# ## The best goodput of each layout
#
# Over the swept rates: the best goodput, the rate it came at, and TTFT/TPOT p50 there.

# %%
best = sims.loc[sims.groupby("layout", sort=False)["goodput"].idxmax(),
                ["layout", "goodput", "request_rate", "ttft_s.p50", "tpot_s.p50", "output_throughput"]]
best = best.merge(fits[["layout", "stages", "kv_tokens_total"]], on="layout").sort_values("goodput", ascending=False)
experiment.save_table(best.round(4), out / "best.csv")
