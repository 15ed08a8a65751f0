# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 6. Recompute or swap: preemption under KV pressure, and the blocks beams share
#
# When a running request cannot get a KV block, the scheduler preempts the last-ranked one. With
# `--preemption-mode recompute` its blocks are freed and its tokens computed again later; with `swap` they are
# copied to a CPU pool (`--swap-space` GiB) over the host link and back before it runs again. Which is better,
# and at what KV pressure? And how much memory does a beam search save by sharing its prompt's and common
# prefix's blocks among its beams (copy on write) instead of running its beams as independent requests?
#
# **Setup.** One replica of `model` on `gpu` (the shipped profile; swaps are priced at the GPU preset's host
# link), Poisson arrivals at `rate`, the KV cache swept from a few hundred blocks to more than the trace ever
# holds; goodput under TTFT/TPOT SLOs and TTFT p99 for both modes. Then the same requests as beam searches of
# width `beam_width` against `beam_width` independent copies of each. Last, real runs of the bundled SmolLM2 on
# CPU (`benchmarks/swap.py`), both modes at three cache sizes, beside their simulation from their own step
# timelines (decision parity). **Trace.** The first `limit` requests of the bundled Azure conversation trace;
# `full=True` the whole hour from `$TESTBED_TRACES_DIR`.

# %% tags=["parameters"]
full = False  # True: the whole Azure conversation hour ($TESTBED_TRACES_DIR)
output_dir = "runs/experiments/06_swap_and_beams"
seed = 0  # Poisson arrivals
jobs = 2  # worker processes
model = "Llama-3.1-8B"
gpu = "H100-SXM"
rate = 6.0  # requests per second
slo_ttft = 2.0  # seconds
slo_tpot = 0.1  # seconds
beam_width = 4
real_runs = "benchmarks/results/swap/2026-11-26_3af8e90_cpu"  # benchmarks/swap.py's output

# %%
import dataclasses
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from testbed import experiment, sweep
from testbed.runs.rundir import read_run
from testbed.workload.trace import load_trace, write_jsonl

out, env = experiment.start(output_dir, seeds={"arrivals": seed})
env

# %% [markdown]
# ## Goodput and TTFT p99 against the KV cache, recompute and swap

# %%
source = experiment.trace_path(full, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv")
limit = None if full else 250
blocks = [256, 512, 768, 1024, 1536, 4096] + ([384, 2048, 8192, 16384] if full else [])
blocks.sort()
common = dict(model=model, gpu=gpu, request_rate=rate, limit=limit, slo_ttft=slo_ttft, slo_tpot=slo_tpot, seed=seed)
configs = [{**common, "name": f"{mode}_b{b}", "num_gpu_blocks": b, "preemption_mode": mode}
           for b in blocks for mode in ("recompute", "swap")]
results = sweep(configs, source, jobs=jobs, output=out / "runs")
print(f"cost model: {results['cost_model'].iloc[0]}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
for mode, style in (("recompute", "o-"), ("swap", "s--")):
    r = results[results["preemption_mode"] == mode]
    axes[0].plot(r["num_gpu_blocks"], r["goodput"], style, label=mode)
    axes[1].plot(r["num_gpu_blocks"], r["ttft_s.p99"], style, label=mode)
axes[0].set(xlabel="KV blocks (16 tokens each)", ylabel="goodput (req/s meeting both SLOs)",
            title=f"{model} on {gpu}, {rate:g} req/s")
axes[1].set(xlabel="KV blocks (16 tokens each)", ylabel="TTFT p99 (s)", yscale="log", title="TTFT p99")
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
experiment.save_figure(fig, out / "swap_vs_recompute.png")

# %%
table = results[["preemption_mode", "num_gpu_blocks", "goodput", "ttft_s.p99", "tpot_s.p99", "num_rejected",
                 "num_preemptions", "num_swap_preemptions", "num_blocks_swapped_out", "kv_util_mean"]]
experiment.save_table(table, out / "swap_vs_recompute.csv")

# %% [markdown]
# ## Memory a beam search saves by sharing blocks
#
# The same requests (a quarter of the rate, a cache large enough that nothing is preempted), once as beam
# searches of width `beam_width` (its beams share their prompt's blocks and their common prefix, and copy a
# shared block before writing into it) and once as `beam_width` independent requests each. The KV blocks in
# use, averaged over the run's time, are what the two hold.

# %%
reqs = load_trace(source, request_rate=rate / 4, seed=seed, limit=40 if not full else 600)
beams = [dataclasses.replace(r, beam_width=beam_width) for r in reqs]
copies = [dataclasses.replace(r, id=f"{r.id}-{k}") for r in reqs for k in range(beam_width)]
write_jsonl(beams, out / "beams.jsonl")
write_jsonl(copies, out / "copies.jsonl")
big = 32768
beam_runs = sweep([{"model": model, "gpu": gpu, "num_gpu_blocks": big, "seed": seed, "name": name,
                    "trace": str(out / f"{name}.jsonl")} for name in ("beams", "copies")], None, jobs=jobs,
                  output=out / "runs")
beam_runs["mean_blocks_in_use"] = beam_runs["kv_util_mean"] * big
beam_runs["max_blocks_in_use"] = beam_runs["kv_util_max"] * big
saved = 1 - beam_runs.loc[0, "mean_blocks_in_use"] / beam_runs.loc[1, "mean_blocks_in_use"]
print(f"beam searches of width {beam_width} hold {saved:.1%} fewer blocks on average than {beam_width} independent "
      f"requests each; {int(beam_runs.loc[0, 'num_blocks_copied'])} blocks were copied on write")

# %% [markdown]
# ## Real runs on CPU beside their simulation
#
# `benchmarks/swap.py` replayed a small trace (12 requests, 48-128 prompt tokens, 32 output tokens each) on the
# bundled SmolLM2-135M in fp32 on the 2-core development machine, with both modes at three cache sizes. Each run
# is simulated again from its own step timeline (`--cost-model recorded:RUN`): the simulator makes the same
# preemptions and moves the same blocks, so the curves of the simulator are the real engine's once its step
# times are right.

# %%
rows = []
real_configs = []
for run_dir in sorted(p for p in Path(real_runs).iterdir() if p.is_dir()):
    run = read_run(run_dir)
    cfg = run.manifest["config"]
    s = run.summary
    rows.append({"run": run_dir.name, "preemption_mode": cfg["preemption_mode"],
                 "num_gpu_blocks": run.manifest["num_gpu_blocks"], "goodput": s["goodput"],
                 "ttft_s.p99": s["ttft_s"]["p99"], "num_preemptions": s["num_preemptions"],
                 "num_swap_preemptions": s["num_swap_preemptions"], "num_blocks_swapped_out": s["num_blocks_swapped_out"]})
    real_configs.append({"name": f"replay_{run_dir.name}", "model": "SmolLM2-135M", "cost_model": f"recorded:{run_dir}",
                         "like": str(run_dir), "preemption_mode": cfg["preemption_mode"],
                         "max_num_seqs": cfg["max_num_seqs"], "max_num_batched_tokens": cfg["max_num_batched_tokens"],
                         "slo_ttft": 5.0, "slo_tpot": 0.5})
real = pd.DataFrame(rows).sort_values(["preemption_mode", "num_gpu_blocks"], ignore_index=True)
replays = sweep(real_configs, None, jobs=jobs, output=out / "runs")
replays["run"] = replays["name"].str.removeprefix("replay_")
real = real.merge(replays[["run", "num_preemptions", "num_blocks_swapped_out", "goodput"]], on="run",
                  suffixes=("", "_sim"))
assert (real["num_preemptions"] == real["num_preemptions_sim"]).all(), "decision parity"
assert (real["num_blocks_swapped_out"] == real["num_blocks_swapped_out_sim"]).all(), "decision parity"

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
for mode, style in (("recompute", "o-"), ("swap", "s--")):
    r = real[real["preemption_mode"] == mode]
    axes[0].plot(r["num_gpu_blocks"], r["goodput"], style, label=f"{mode}, real")
    axes[0].plot(r["num_gpu_blocks"], r["goodput_sim"], "x", color=axes[0].lines[-1].get_color(),
                 label=f"{mode}, simulated from its steps")
    axes[1].plot(r["num_gpu_blocks"], r["ttft_s.p99"], style, label=mode)
axes[0].set(xlabel="KV blocks (16 tokens each)", ylabel="goodput (req/s, TTFT 5 s, TPOT 0.5 s)",
            title="SmolLM2-135M on CPU (benchmarks/swap.py)")
axes[1].set(xlabel="KV blocks (16 tokens each)", ylabel="TTFT p99 (s)", title="TTFT p99, real")
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
experiment.save_figure(fig, out / "real_cpu.png")

# %%
summary = pd.concat([
    beam_runs[["name", "num_requests", "mean_blocks_in_use", "max_blocks_in_use", "num_blocks_copied"]]
    .rename(columns={"name": "case"}),
    real.rename(columns={"run": "case"})], ignore_index=True)
experiment.save_table(summary, out / "beams_and_real_runs.csv")
