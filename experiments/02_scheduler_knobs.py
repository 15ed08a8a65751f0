# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. Scheduler knobs: goodput under SLOs on a bursty workload
#
# How much SLO-meeting traffic (goodput: requests meeting both the TTFT and the TPOT SLO per second) does
# one replica sustain as the request rate grows, depending on the token budget per step
# (`--max-num-batched-tokens`), chunked prefill on or off, and the scheduling policy (`fcfs` or `priority`)?
#
# **The workload.** The question is posed on the Azure *code* trace, whose arrivals are bursty. That trace
# is not available here (neither in the repository nor in the public traces this project uses), so this
# notebook derives a bursty workload instead, and says so: the request lengths of the Azure *conversation*
# trace (`traces/azure_conv_10min.jsonl`, bundled; with `full=True` the whole hour from
# `azure_llm_2023_conv.csv` in `$TESTBED_TRACES_DIR`) with gamma-distributed inter-arrival times of shape
# `burstiness` < 1 (`--request-rate R --burstiness B`; B = 0.25 gives inter-arrival times with a coefficient
# of variation of 2, where Poisson has 1). Code completion has shorter outputs than conversation, so the
# absolute numbers are not the code trace's; the comparison between knobs is the point.
#
# **Priorities.** The trace has none. A seeded random `interactive_fraction` of the requests is marked
# interactive (priority 0, served first by the `priority` policy), the rest batch (priority 1); `fcfs`
# ignores the marks. The derived trace is written to the output folder.
#
# Simulated on the profile shipped for the model and GPU below, `max_model_len` 8192 (so chunked prefill
# can be turned off with a budget of 8192, as vLLM requires).

# %% tags=["parameters"]
full = False  # True: the whole Azure conversation hour ($TESTBED_TRACES_DIR), more rates and every knob combination
output_dir = "runs/experiments/02_scheduler_knobs"
seed = 0  # arrivals (gamma process) and the interactive marks
jobs = 2  # worker processes
model = "Llama-3.1-8B"
gpu = "H100-SXM"
burstiness = 0.25  # gamma shape of the arrivals (1 = Poisson, < 1 burstier)
slo_ttft_s = 1.0
slo_tpot_s = 0.05
interactive_fraction = 0.3  # share of requests with priority 0 (the rest 1)
attainment_target = 0.9  # capacity = highest rate at which this share of requests meets both SLOs

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from testbed import experiment, sweep
from testbed.runs.rundir import read_run
from testbed.workload.trace import load_trace, write_jsonl

out, env = experiment.start(output_dir, seeds={"arrivals_and_priorities": seed})
env

# %% [markdown]
# ## The derived workload

# %%
source = experiment.trace_path(full, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv")
limit, rates = (None, list(range(1, 21))) if full else (1000, [2, 4, 6, 8, 10, 12, 14, 16])
requests = load_trace(source, limit=limit)
rng = np.random.default_rng(seed)
for r, interactive in zip(requests, rng.random(len(requests)) < interactive_fraction):
    r.priority = 0 if interactive else 1
workload = out / "workload.jsonl"
write_jsonl(requests, workload)
lengths = pd.DataFrame({"input": [r.input_tokens for r in requests], "output": [r.output_tokens for r in requests],
                        "interactive": [r.priority == 0 for r in requests]})
lengths.describe().round(1)

# %% [markdown]
# ## The sweep
#
# Every variant at every rate, the same arrivals for the same rate (same seed). Variants: the token budget
# with chunked prefill (fcfs); chunked prefill off, where the budget must hold a whole prompt (8192); and
# `priority` against `fcfs` on some of those.

# %%
MAX_MODEL_LEN = 8192
budgets = [512, 1024, 2048, 4096, 8192, 16384] if full else [512, 1024, 2048, 4096, 8192]
variants = [(b, True) for b in budgets] + [(b, False) for b in budgets if b >= MAX_MODEL_LEN]
policy_variants = variants if full else [(2048, True), (8192, True), (8192, False)]
configs = [{"name": f"mbt{b}-{'chunked' if c else 'nochunk'}-{pol}-r{rate:g}", "max_num_batched_tokens": b,
            "enable_chunked_prefill": c, "policy": pol, "request_rate": rate}
           for pol, vs in (("fcfs", variants), ("priority", policy_variants)) for b, c in vs for rate in rates]
common = dict(model=model, gpu=gpu, burstiness=burstiness, seed=seed, slo_ttft=slo_ttft_s, slo_tpot=slo_tpot_s,
              max_model_len=MAX_MODEL_LEN)
results = sweep([{**common, **c} for c in configs], workload, jobs=jobs, output=out / "runs")
results["variant"] = [f"{'chunked' if c else 'no chunking'}, budget {b}, {p}" for b, c, p in
                      zip(results["max_num_batched_tokens"], results["enable_chunked_prefill"], results["policy"])]
results["attainment"] = results["num_good_requests"] / results["num_requests"]
print(f"{len(results)} simulations; cost model: {results['cost_model'].iloc[0]}")
assert not results["warnings"].any(), results.loc[results["warnings"] != "", ["name", "warnings"]]

# %% [markdown]
# ## Goodput per priority class
#
# From each run's requests (`requests.parquet`), with the summary's definitions: TTFT = first token - arrival,
# TPOT = (finish - first token) / (output tokens - 1). The two classes add up to the summary's goodput.


# %%
def good_by_class(run_dir: str) -> pd.Series:
    r = read_run(run_dir).requests()
    done = r["finish_reason"].isin(["stop", "length"])
    ttft = r["first_token"] - r["arrival"]
    tpot = ((r["finish"] - r["first_token"]) / (r["output_tokens"] - 1)).where(r["output_tokens"] > 1, 0.0)
    good = done & (ttft <= slo_ttft_s) & (tpot <= slo_tpot_s)
    return good.groupby(r["priority"]).sum().reindex([0, 1], fill_value=0)


by_class = np.array([good_by_class(d).to_numpy() for d in results["run_dir"]])
assert (by_class.sum(axis=1) == results["num_good_requests"]).all(), "class counts must add up to the summary's"
results["goodput_interactive"] = by_class[:, 0] / results["makespan_s"]
results["goodput_batch"] = by_class[:, 1] / results["makespan_s"]
experiment.save_table(results[["variant", "request_rate", "goodput", "goodput_interactive", "goodput_batch",
                               "attainment", "request_throughput", "ttft_s.p99", "tpot_s.p99", "num_preemptions"]],
                      out / "sweep.csv")

# %% [markdown]
# ## Goodput against request rate
#
# Left to right: the token budget (chunked prefill, fcfs); chunked prefill on and off; `priority` against
# `fcfs` for all requests and for the interactive ones. The dotted line is the offered rate.

# %%
def plot(ax, rows: pd.DataFrame, column: str, title: str) -> None:
    for i, (variant, g) in enumerate(rows.groupby("variant", sort=False)):
        ax.plot(g["request_rate"], g[column], marker="o", ms=3, label=variant, color=f"C{i}")
    ax.plot(rates, rates if column == "goodput" else [r * interactive_fraction for r in rates], ":", color="grey",
            lw=1)
    ax.set(title=title, xlabel="request rate (req/s)", ylabel=f"{column.replace('_', ' ')} (req/s)", ylim=(0, None))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


fcfs = results[results["policy"] == "fcfs"]
pairs = results[[(b, c) in policy_variants for b, c in zip(results["max_num_batched_tokens"],
                                                            results["enable_chunked_prefill"])]]
fig, axes = plt.subplots(1, 4, figsize=(20, 4.6), layout="constrained")
plot(axes[0], fcfs[fcfs["enable_chunked_prefill"]], "goodput", "token budget (chunked prefill, fcfs)")
plot(axes[1], fcfs[fcfs["max_num_batched_tokens"].isin([2048, 8192])], "goodput", "chunked prefill on / off (fcfs)")
plot(axes[2], pairs, "goodput", "fcfs vs priority: all requests")
plot(axes[3], pairs, "goodput_interactive", "fcfs vs priority: interactive requests")
fig.suptitle(f"{model} on {gpu}, Azure conversation lengths, gamma arrivals (burstiness {burstiness}); "
             f"SLOs TTFT <= {slo_ttft_s:g} s, TPOT <= {slo_tpot_s * 1e3:g} ms", fontweight="bold")
experiment.save_figure(fig, out / "goodput.png")

# %% [markdown]
# ## Capacity under the SLOs
#
# Per variant, the highest swept rate at which at least `attainment_target` of the requests meet both SLOs,
# and the goodput, tails and preemptions there (NaN: no swept rate qualifies).


# %%
def capacity(g: pd.DataFrame) -> pd.Series:
    ok = g[g["attainment"] >= attainment_target]
    at = ok.loc[ok["request_rate"].idxmax()] if len(ok) else None
    cols = ["goodput", "goodput_interactive", "ttft_s.p99", "tpot_s.p99", "num_preemptions"]
    return pd.Series({"capacity (req/s)": np.nan if at is None else at["request_rate"],
                      **{f"{c} there": np.nan if at is None else at[c] for c in cols},
                      "best goodput (req/s)": g["goodput"].max()})


table = results.groupby("variant", sort=False)[results.columns].apply(capacity).reset_index()
experiment.save_table(table, out / "capacity.csv")
