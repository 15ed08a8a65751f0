# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. Sim vs real: where can the simulator be trusted?
#
# The real runs committed under `benchmarks/results/fidelity/<date>_<commit>_<gpu>_<model>/<case>/` are
# `testbed replay` runs on H200 and H100 GPUs (the Azure conversation trace at light load, 80% and 130% of
# saturation, all at once and with async scheduling; Mooncake with prefix caching; prompts above 16k tokens;
# Llama-3.2-1B and Llama-3.1-8B). Each one is simulated here with three cost models:
#
# - **roofline**: the analytical model (bytes over bandwidth, FLOPs over matmul rate), constants
#   recalibrated from the shipped profiles; what an unprofiled model or GPU gets;
# - **profile**: `--cost-model auto`, the step-time profile shipped for the run's model and GPU;
# - **recorded**: `recorded:RUN_DIR`, the real run's own step timeline. The simulator runs the same
#   `EngineCore`, so it forms the real batches; what remains is the error of the simulator itself.
#   Runs made with `--async-scheduling` cannot be replayed this way and have no recorded column.
#
# Every simulation serves exactly the real run's workload: the trace file, request rate, burstiness, limit
# and seed from its manifest (so the same arrival times), on the run's KV-cache size and max_model_len
# (`like`, as `testbed simulate --like RUN_DIR`). Errors are (sim - real) / real, read from the two runs'
# summaries by `testbed compare`'s table. The numbers below are today's, whatever they are.

# %% tags=["parameters"]
full = False  # True: latency CDFs of every run (default: four that span the regimes); tables cover every run
output_dir = "runs/experiments/01_sim_vs_real"
results = "benchmarks/results/fidelity"  # the committed real run directories
jobs = 2  # worker processes for the simulations
targets = {"throughput": 0.02, "mean/p50": 0.05, "p99": 0.10}  # the project's fidelity targets (|error|)

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import Markdown, display

from testbed import experiment, sweep
from testbed.runs.compare import compare_table, diff_column, load_runs
from testbed.runs import plots, series
from testbed.runs.rundir import find_runs, read_run
from testbed.sim.sweeps import ENGINE_KEYS

out, env = experiment.start(output_dir, seeds={"simulation": 0})
env

# %% [markdown]
# ## The real runs
#
# Each run directory's manifest says how it was made; the simulations copy that.

# %%
COST_MODELS = {"roofline": "roofline", "profile": "auto", "recorded": "recorded:{run}"}


def label(run_dir: Path) -> str:
    """gpu_model_case, from <date>_<commit>_<gpu>_<model>/<case>."""
    return f"{run_dir.parent.name.split('_', 2)[2]}_{run_dir.name}"


IDLE_GAP_S = 2e-3  # a step whose successor started later than this after it ended was followed by idle time
real = {label(p): p for p in find_runs(results)}
rows = []
for name, path in real.items():
    run = read_run(path)
    m, s, steps = run.manifest, run.summary, run.steps(columns=["start", "duration"])
    gap = steps["start"].shift(-1) - (steps["start"] + steps["duration"])
    rows.append({"run": name, "gpu": m["hardware"]["name"], "model": m["model"]["name"], "git_sha": m["git_sha"][:7],
                 "requests": s["num_finished"], "request_rate": m["trace"]["request_rate"],
                 "prefix_caching": m["config"]["enable_prefix_caching"],
                 "async_scheduling": m["config"]["async_scheduling"], "real_req_s": s["request_throughput"],
                 "steps": len(steps), "steps_before_idle": int((gap > IDLE_GAP_S).sum()),
                 "idle_s": float(gap[gap > IDLE_GAP_S].sum()), "busy_s": float(steps["duration"].sum())})
experiment.save_table(pd.DataFrame(rows), out / "real_runs.csv")

# %% [markdown]
# ## Simulate every run with every cost model
#
# One sweep: each configuration names the trace, rate, limit and seed of one real run, its engine flags, and
# `like` for its KV-cache size and max_model_len.

# %%
configs = []
for name, path in real.items():
    m = read_run(path).manifest
    tr = m["trace"]
    engine = {k: v for k, v in m["config"].items() if k in ENGINE_KEYS and k not in ("num_gpu_blocks", "max_model_len")}
    for cm, spec in COST_MODELS.items():
        if cm == "recorded" and m["config"]["async_scheduling"]:
            continue
        configs.append({"name": f"{name}--{cm}", "trace": tr["path"], "like": str(path), "model": m["model"]["name"],
                        "gpu": m["hardware"]["name"], "cost_model": spec.format(run=path),
                        "request_rate": tr["request_rate"], "burstiness": tr["burstiness"], "limit": tr["limit"],
                        "trace_format": tr["format"], **engine})
sims = sweep(configs, jobs=jobs, output=out / "sim")
sims[["name", "num_finished", "num_rejected", "request_throughput", "ttft_s.p50", "tpot_s.p50", "warnings"]]

# %% [markdown]
# ## Errors against the real runs
#
# `testbed compare` of each real run with its simulations; one row per run and cost model, (sim - real) / real
# in percent per metric. The real and simulated values are in the run directories (`testbed compare REAL SIM`).

# %%
METRICS = [f"{m} {q} (ms)" for m in ("TTFT", "TPOT", "E2E") for q in ("mean", "p50", "p99")] + \
          ["output throughput (tok/s)", "mean batch size (requests/step)"]
CMS = list(COST_MODELS)
errors = []
for name, path in real.items():
    sim_dirs = [out / "sim" / f"{name}--{cm}" for cm in CMS if (out / "sim" / f"{name}--{cm}").is_dir()]
    runs = load_runs([str(path), *map(str, sim_dirs)])
    table = compare_table(runs, runs[0]).set_index("metric")
    for r in runs[1:]:
        errors.append({"run": name, "cost_model": Path(r.path).name.split("--")[1],
                       **{m: float(table.loc[m, diff_column(r, runs[0])]) for m in METRICS}})
errors = pd.DataFrame(errors)
experiment.save_table(errors.round(2), out / "errors.csv")

# %% [markdown]
# ## Latency CDFs
#
# Real runs dashed, simulations solid. The recorded timeline should lie on the real curve; the distance
# of the profile and the roofline from it is the error of their step-time predictions. Where the real run
# idled between requests (`steps_before_idle` above: light load, long prompts), the recorded timeline
# stretches the step before each idle spell to the next step's start, so its tokens come late there.

# %%
shown = list(real) if full else [n for n in ("h200_llama-3.2-1b_azure-light", "h200_llama-3.2-1b_azure-over",
                                             "h200_llama-3.2-1b_mooncake-80", "h200_llama-3.1-8b_azure-80") if n in real]
for name in shown:
    paths = [(name, "real", real[name])] + [(cm, "sim", out / "sim" / f"{name}--{cm}") for cm in CMS
                                           if (out / "sim" / f"{name}--{cm}").is_dir()]
    fig = plots.latency_cdfs([(plots.Series(lab, mode, i), series.latency_samples(str(p)))
                              for i, (lab, mode, p) in enumerate(paths)])
    fig.suptitle(f"Latency CDFs: {name}", fontsize=12, fontweight="bold")
    experiment.save_figure(fig, out / f"cdf_{name}.png")

# %% [markdown]
# ## Where the simulator can be trusted
#
# Per run and cost model: the worst |error| in each group of metrics (output throughput; TTFT, TPOT and E2E
# means and medians; their p99s) and whether it is inside the project's fidelity target.

# %%
GROUPS = {"throughput": ["output throughput (tok/s)"], "mean/p50": [m for m in METRICS if " mean " in m or " p50 " in m],
          "p99": [m for m in METRICS if " p99 " in m]}
trust = errors[["run", "cost_model"]].copy()
for g, cols in GROUPS.items():
    trust[f"worst |error| {g} (%)"] = errors[cols].abs().max(axis=1).round(2)
    trust[f"{g} within {targets[g]:.0%}"] = trust[f"worst |error| {g} (%)"] <= 100 * targets[g]
profile = trust[trust["cost_model"] == "profile"]
display(Markdown("With the shipped profile:\n" + "\n".join(
    f"- **{g}** within {targets[g]:.0%} in {int(profile[f'{g} within {targets[g]:.0%}'].sum())} of {len(profile)} runs"
    + (": " + ", ".join(profile.loc[profile[f"{g} within {targets[g]:.0%}"], "run"]) if profile[f"{g} within {targets[g]:.0%}"].any() else "")
    for g in GROUPS)))

# %%
fig, axes = plt.subplots(1, len(CMS), figsize=(5.2 * len(CMS), 0.42 * len(real) + 2.2), sharey=True,
                         layout="constrained")
for ax, cm in zip(axes, CMS):
    grid = errors[errors["cost_model"] == cm].set_index("run").reindex(list(real))[METRICS].to_numpy(float)
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-50, vmax=50, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{v:+.0f}", ha="center", va="center", fontsize=6.5)
    ax.set_xticks(range(len(METRICS)), [m.split(" (")[0] for m in METRICS], rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(real)), list(real), fontsize=8)
    ax.set_title(f"{cm}: (sim - real) / real, %")
fig.colorbar(im, ax=axes, shrink=0.6, label="error (%), colours clipped at ±50")
experiment.save_figure(fig, out / "errors_heatmap.png")

# %%
experiment.save_table(trust, out / "trust.csv")
