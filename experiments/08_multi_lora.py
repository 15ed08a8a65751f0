# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 8. Multi-LoRA: goodput against the number of adapters and `--max-loras`
#
# One base model serves many fine-tuned LoRA adapters. Each step may run at most `--max-loras` of them (vLLM's
# rule: a request whose adapter would be one too many waits, later ones may pass it), each in a device slot;
# an adapter not in a slot is loaded into one first. How does goodput fall as the traffic spreads over more
# adapters, and how many slots buy it back?
#
# **Workload.** The bundled Azure conversation slice (lengths and arrivals, re-timed to Poisson at `rate`),
# every request given an adapter drawn from a Zipf popularity over `n` adapters (the popular few get most
# requests, the tail a trickle: the S-LoRA setting). One replica of `model` on `gpu`, simulated; the cost
# model adds LoRA's roofline terms to the shipped profile (`testbed/sim/lora_cost.py`: compute per LoRA token at
# `--max-lora-rank`, each adapter's slot read once per step, and every load). `full=True` uses the Azure
# conversation hour from `$TESTBED_TRACES_DIR`. **Real points.** `benchmarks/lora.py cpu-runs` replayed a
# Zipf-adapter trace on the bundled SmolLM2 on a CPU at several `--max-loras`
# (`benchmarks/results/lora/`); the simulator, fed their recorded step times, forms the same batches, so the
# same requests meet the SLOs (decision parity).

# %% tags=["parameters"]
full = False  # True: the Azure conversation hour from $TESTBED_TRACES_DIR
output_dir = "runs/experiments/08_multi_lora"
seed = 0  # Poisson arrivals and the adapters' draw
jobs = 2  # worker processes
model = "Llama-3.1-8B"
gpu = "H100-SXM"
rate = 6.0  # requests per second
limit = 600  # requests (None: all of them)
adapters = [1, 4, 16, 64]  # adapters the traffic spreads over
max_loras = [1, 2, 4, 8]  # device slots
zipf = 1.0  # popularity exponent: adapter k gets weight 1 / k**zipf
slo_ttft, slo_tpot = 2.0, 0.1  # seconds, for goodput
real_runs = "benchmarks/results/lora/2026-11-26_20a4ceb_cpu"

# %%
import json
import random
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from testbed import experiment, sweep
from testbed.workload.trace import load_trace, write_jsonl

out, env = experiment.start(output_dir, seeds={"arrivals_and_adapters": seed})
env

# %% [markdown]
# ## Traces: one per adapter count, the same requests and arrivals

# %%
base_trace = experiment.trace_path(full, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv")
requests = load_trace(base_trace, request_rate=rate, seed=seed, limit=None if full else limit)
(out / "traces").mkdir(exist_ok=True)
traces = {}
for n in adapters:
    g = random.Random(seed)
    weights = [1 / (k + 1) ** zipf for k in range(n)]
    for r in requests:
        r.lora = f"adapter{g.choices(range(n), weights)[0]}"
    traces[n] = out / "traces" / f"zipf{zipf:g}_{n}_adapters.jsonl"
    write_jsonl(requests, traces[n])
for r in requests:
    r.lora = None
traces[0] = out / "traces" / "base.jsonl"
write_jsonl(requests, traces[0])
share = {n: pd.Series([json.loads(line)["lora"] for line in traces[n].read_text().splitlines()]).value_counts(
    normalize=True).iloc[0] for n in adapters}
print(f"{len(requests)} requests at {rate:g} req/s; the most popular adapter's share: "
      + ", ".join(f"{share[n]:.0%} of {n}" for n in adapters))

# %% [markdown]
# ## The sweep: adapters x slots, and the base model alone

# %%
common = dict(model=model, gpu=gpu, slo_ttft=slo_ttft, slo_tpot=slo_tpot, seed=seed)
configs = [{**common, "name": "base", "trace": str(traces[0])}]
for n in adapters:
    for m in max_loras:
        configs.append({**common, "name": f"{n}adapters_{m}slots", "trace": str(traces[n]), "enable_lora": True,
                        "max_loras": m, "max_cpu_loras": max(m, n), "max_lora_rank": 16})
results = sweep(configs, jobs=jobs, output=out / "runs")
results["adapters"] = [0] + [n for n in adapters for _ in max_loras]
print(f"cost model: {results['cost_model'].iloc[1]}")

# %%
base = results.iloc[0]
fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
for m in max_loras:
    rows = results[results["enable_lora"] & (results["max_loras"] == m)]
    ax.plot(rows["adapters"], rows["goodput"], marker="o", label=f"--max-loras {m}")
ax.axhline(base["goodput"], color="grey", ls=":", label="base model, no adapters")
ax.set_xscale("log", base=2)
ax.set(xlabel="adapters the traffic spreads over (Zipf popularity)", ylabel="goodput (requests/s meeting SLOs)",
       title=f"{model} on {gpu}, {len(requests)} requests at {rate:g} req/s, TTFT <= {slo_ttft:g} s, "
             f"TPOT <= {slo_tpot:g} s")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
experiment.save_figure(fig, out / "goodput.png")

# %%
table = results[["name", "adapters", "max_loras", "goodput", "request_throughput", "ttft_s.p50", "ttft_s.p99",
                 "tpot_s.p50", "tpot_s.p99"]]
experiment.save_table(table, out / "goodput.csv")

# %% [markdown]
# ## Real CPU points and their replays
#
# The committed real runs (SmolLM2 on a CPU, 4 adapters of rank 16, Zipf popularity) at each `--max-loras`,
# beside the simulator on their recorded step times: the same batches, so the same requests meet the SLOs.

# %%
real_dir = Path(real_runs)
runs = sorted(real_dir.glob("max_loras_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
real = []
replays = []
for run in runs:
    manifest = json.loads((run / "manifest.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    cfg = manifest["config"]
    real.append({"max_loras": cfg["max_loras"], "good requests": summary["num_good_requests"],
                 "goodput": summary["goodput"], "request_throughput": summary["request_throughput"]})
    replays.append({"name": f"replay_{run.name}", "trace": str(real_dir / "trace.jsonl"), "model": "SmolLM2-135M",
                    "cost_model": f"recorded:{run}", "enable_lora": True, "max_loras": cfg["max_loras"],
                    "max_cpu_loras": cfg["max_cpu_loras"], "max_lora_rank": cfg["max_lora_rank"],
                    "max_num_seqs": cfg["max_num_seqs"], "max_num_batched_tokens": cfg["max_num_batched_tokens"],
                    "max_model_len": cfg["max_model_len"], "num_gpu_blocks": manifest["num_gpu_blocks"],
                    "slo_ttft": summary["slo"]["ttft_s"], "slo_tpot": summary["slo"]["tpot_s"]})
real = pd.DataFrame(real)
sim = sweep(replays, jobs=jobs, output=out / "replays")
real["simulated good requests"] = sim["num_good_requests"].to_numpy()
real["simulated goodput (recorded steps)"] = sim["goodput"].to_numpy()
# decision parity: the same requests meet the SLOs; the goodputs differ only by where the real run's first step began
assert (real["good requests"] == real["simulated good requests"]).all()
assert ((real["goodput"] - real["simulated goodput (recorded steps)"]).abs() <= 1e-3 * real["goodput"]).all()

# %%
fig, ax = plt.subplots(figsize=(6, 3.8), layout="constrained")
ax.plot(real["max_loras"], real["goodput"], marker="o", label="real (CPU)")
ax.plot(real["max_loras"], real["simulated goodput (recorded steps)"], marker="x", ls="--",
        label="simulated on the recorded steps")
ax.set(xlabel="--max-loras", ylabel="goodput (requests/s)", title="SmolLM2-135M on a CPU, 4 adapters")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
experiment.save_figure(fig, out / "real_cpu.png")

# %%
experiment.save_table(real, out / "real_cpu.csv")
