# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 5. Tensor parallelism: the simulator's TP cost model against the measured runs, then Llama-3.1-70B
#
# With tensor parallelism each rank holds 1/TP of every layer's weights and KV heads, and every decoder layer
# all-reduces its activations twice (after attention and after the MLP). The simulator's roofline
# (`testbed/sim/cost_model.py`) prices one step on one rank (weights, KV and FLOPs divided by TP) and adds
# `2 x layers` all-reduces of `tokens x hidden` bf16 values, each costing
# `latency + 2 (TP - 1) / TP x bytes / bandwidth`. Latency and bandwidth are the GPU preset's
# (`testbed/specs/hardware.py`), fitted to the engine's own all-reduce between two H200s: over symmetric memory,
# inside the CUDA graphs every rank replays (one-shot up to 512 KiB, two-shot above).
#
# **Part 1** checks that model against the measured TP runs committed in the results
# (`benchmarks/tp.py` at 08cb01d, raw output in `benchmarks/results/tp/2026-11-26_08cb01d_h200x2/`: Llama-3.1-8B
# shape with dummy weights on 2 H200s over NVLink; the all-reduce microbenchmark; TP=1 and TP=2 engines with CUDA
# graphs on every rank, sync and async scheduling, and TP=2 eager: the median decode step at batch 1, 64 and 256
# and the output throughput of 256 requests). Each sync measurement is simulated with the same workload and
# engine settings.
#
# **Part 2** asks what TP=2, 4 and 8 would give for Llama-3.1-70B on H200 and H100 nodes: which sizes fit,
# how much KV cache each leaves, the decode step, and goodput and per-GPU throughput under SLOs on the Azure
# conversation trace. No profile ships for a 70B model, so this is the roofline (recalibrated from the
# shipped profiles) with the measured all-reduce fit, which part 1 says how far to trust.

# %% tags=["parameters"]
full = False  # True: the whole Azure conversation hour ($TESTBED_TRACES_DIR) at more rates
output_dir = "runs/experiments/05_tensor_parallelism"
measured = "benchmarks/results/tp/2026-11-26_08cb01d_h200x2"  # benchmarks/tp.py's raw output (tp.json, allreduce.json)
seed = 0  # Poisson arrivals of part 2
jobs = 2  # worker processes
model = "Llama-3.1-70B"
gpus = ["H200", "H100-SXM"]
tp_sizes = [1, 2, 4, 8]
slo_ttft_s = 2.5  # chat SLOs for a model of this size: the first token within 2.5 s,
slo_tpot_s = 0.15  # then a token every 150 ms at most (about reading speed)

# %%
import json
import random
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import Markdown, display

from testbed import experiment, sweep
from testbed.specs.presets import get_model_spec
from testbed.runs.rundir import read_run
from testbed.sim.cost_model import CALIBRATED, num_gpu_blocks, rank_shape
from testbed.specs.hardware import get_gpu_spec
from testbed.workload.trace import TraceRequest, write_jsonl

out, env = experiment.start(output_dir, seeds={"arrivals": seed})
env

# %% [markdown]
# ## Part 1a. The all-reduce fit against its measurements
#
# The benchmark all-reduced `tokens x hidden` bf16 tensors between the two H200s: NCCL outside a graph, and the
# engine's symmetric-memory all-reduces replayed 20 at a time inside a CUDA graph (each checked against the sum).
# The simulator's H200 preset carries the straight-line fit through the engine's path (one-shot up to 512 KiB,
# two-shot above). Error = (fit - measured engine path) / measured.

# %%
bench = json.loads((Path(measured) / "tp.json").read_text())
allreduce = json.loads((Path(measured) / "allreduce.json").read_text())["allreduce"]
gpu8 = get_gpu_spec(bench["gpu"])
spec8 = get_model_spec(bench["model"])
ONE_SHOT_MAX_BYTES = 512 << 10  # worker/tp_all_reduce.py: the engine's one-shot / two-shot crossover


def allreduce_s(nbytes: float, tp: int, gpu) -> float:
    """One all-reduce of `nbytes` over `tp` ranks as the roofline prices it."""
    return gpu.allreduce_latency_s + 2 * (tp - 1) / tp * nbytes / gpu.interconnect_bandwidth


ar = pd.DataFrame(allreduce["rows"])
ar["nccl_us"] = ar["nccl_eager_us"]
ar["measured_us"] = np.where(ar["bytes"] <= ONE_SHOT_MAX_BYTES, ar["one_shot_graph_us"], ar["two_shot_graph_us"])
ar["simulator_us"] = [allreduce_s(b, bench["gpus"], gpu8) * 1e6 for b in ar["bytes"]]
ar["error_%"] = 100 * (ar["simulator_us"] - ar["measured_us"]) / ar["measured_us"]
print(f"{bench['gpus']} x {bench['gpu']}, NCCL {bench['nccl']}, torch {bench['torch']}, {bench['date']}; the "
      f"simulator's {gpu8.name} preset: {gpu8.allreduce_latency_s * 1e6:.2f} us + bytes / "
      f"{gpu8.interconnect_bandwidth / 1e9:.1f} GB/s")
experiment.save_table(ar[["tokens", "bytes", "nccl_us", "measured_us", "simulator_us", "error_%"]].round(2),
                      out / "allreduce.csv")

# %% [markdown]
# ## Part 1b. The measured engines against the simulator
#
# The same workloads, simulated on the measured GPU with the measured engine's settings (256 sequences,
# 8,192 batched tokens, max_model_len 4096, its KV-cache size):
#
# - **decode step**: `batch` requests of 512 prompt tokens and 64 output tokens arriving at once; the median
#   step with no prefill and the whole batch running (as `benchmarks/e2e.py`'s `decode_steps` selects them);
# - **throughput**: `benchmarks/e2e.py`'s 256 requests (input and output lengths uniform in [100, 1024],
#   seed 0) arriving at once; output tokens / makespan.
#
# Cost models: the roofline at the run's TP, and the profile shipped for the model and GPU (`auto`), which
# exists for TP=1 only.


# %%
def e2e_lengths(n: int, vocab: int, seed: int = 0, lo: int = 100, hi: int = 1024) -> tuple[list[int], list[int]]:
    """Input and output lengths of benchmarks/e2e.py's `workload(n, vocab, seed)`: the same draws from the same
    generator, the prompt token ids drawn and dropped."""
    rng = random.Random(seed)
    inputs = []
    for _ in range(n):
        inputs.append(rng.randint(lo, hi))
        for _ in range(inputs[-1]):
            rng.randrange(1000, vocab)
    return inputs, [rng.randint(lo, hi) for _ in range(n)]


def write_trace(name: str, lengths: list[tuple[int, int]]) -> Path:
    """Requests of the given (input, output) lengths, all arriving at t=0, as a JSONL trace in the output folder."""
    path = out / f"{name}.jsonl"
    write_jsonl([TraceRequest(f"{name}-{i}", 0.0, a, b) for i, (a, b) in enumerate(lengths)], path)
    return path


def decode_step_ms(run_dir: str, batch: int) -> float:
    """Median duration of the run's decode-only steps with `batch` requests running, in ms."""
    steps = read_run(run_dir).steps(columns=["duration", "num_reqs", "num_prefill_tokens"])
    sel = (steps["num_prefill_tokens"] == 0) & (steps["num_reqs"] == batch)
    return float(steps.loc[sel, "duration"].median() * 1e3)


BATCHES = (1, 64, 256)
cases = {k: c for k, c in bench["cases"].items() if "error" not in c}
inputs, outputs = e2e_lengths(256, spec8.vocab_size)
for case in cases.values():  # the regenerated workload is the one measured: same number of output tokens
    assert sum(outputs) == round(case["throughput_output_tok_s"] * case["throughput_seconds"]), case["case"]
workloads = {f"decode_b{b}": write_trace(f"decode_b{b}", [(512, 64)] * b) for b in BATCHES}
workloads["throughput"] = write_trace("throughput", list(zip(inputs, outputs)))
engine8 = dict(model=bench["model"], gpu=gpu8.name, max_num_seqs=256, max_num_batched_tokens=8192,
               max_model_len=4096)
kv_blocks = {c["tp"]: c["num_gpu_blocks"] for c in cases.values() if not c["eager"]}  # the graph engines' KV size
configs = [{**engine8, "name": f"tp{tp}-{cm}-{w}", "trace": str(path), "cost_model": cm, "tensor_parallel_size": tp,
            "num_gpu_blocks": blocks}
           for tp, blocks in sorted(kv_blocks.items())
           for cm in (("roofline", "auto") if tp == 1 else ("roofline",)) for w, path in workloads.items()]
sims8 = sweep(configs, jobs=jobs, output=out / "llama-3.1-8b")
assert not sims8["warnings"].any(), sims8.loc[sims8["warnings"] != "", ["name", "warnings"]]


def simulated(tp: int, cm: str) -> dict:
    rows = sims8.set_index("name")
    return {**{f"decode b{b} (ms)": decode_step_ms(rows.loc[f"tp{tp}-{cm}-decode_b{b}", "run_dir"], b) for b in BATCHES},
            "output tok/s": float(rows.loc[f"tp{tp}-{cm}-throughput", "output_throughput"])}


def engine_name(c: dict) -> str:
    mode = "eager" if c["eager"] else "CUDA graphs" + (", async" if c.get("async_scheduling") else "")
    return f"TP={c['tp']} {mode}"


compare = [{"engine": engine_name(c), "source": "measured", "tp": c["tp"],
            **{f"decode b{b} (ms)": c[f"decode_ms_b{b}"] for b in BATCHES},
            "output tok/s": c["throughput_output_tok_s"]} for c in cases.values()]
compare += [{"engine": f"TP={tp} simulated", "source": label, "tp": tp, **simulated(tp, cm)}
            for tp, cm, label in ((1, "roofline", "roofline"), (1, "auto", "profile"), (2, "roofline", "roofline"))]
compare = pd.DataFrame(compare)
experiment.save_table(compare.round(2), out / "measured_vs_simulated.csv")

# %% [markdown]
# ### What TP=2 changes in a step, measured and simulated
#
# TP=2 minus TP=1 per decode step: measured between the two sync CUDA-graph engines, simulated by the roofline;
# and the all-reduce fit alone, `2 x layers` all-reduces of `batch x hidden` values.

# %%
m = compare.set_index(["engine", "source"])
delta = pd.DataFrame([{
    "batch": b,
    "measured TP=2 - TP=1, graphs (ms)": m.loc[("TP=2 CUDA graphs", "measured"), f"decode b{b} (ms)"]
    - m.loc[("TP=1 CUDA graphs", "measured"), f"decode b{b} (ms)"],
    "simulated TP=2 - TP=1, roofline (ms)": m.loc[("TP=2 simulated", "roofline"), f"decode b{b} (ms)"]
    - m.loc[("TP=1 simulated", "roofline"), f"decode b{b} (ms)"],
    "all-reduces per step, fit (ms)": 2 * spec8.num_hidden_layers * allreduce_s(b * spec8.hidden_size * 2, 2, gpu8) * 1e3,
} for b in BATCHES])
experiment.save_table(delta.round(3), out / "tp2_step_delta.csv")
worst_fit = ar["error_%"].abs().max()
display(Markdown(
    f"- The all-reduce fit is within **{worst_fit:.0f}%** of the engine's measured all-reduce at every size (1 to "
    f"8,192 tokens); NCCL outside a graph took {ar['nccl_us'].iloc[0]:.0f} us for one token where the engine's "
    f"takes {ar['measured_us'].iloc[0]:.1f} us.\n"
    f"- On a decode step the fit's all-reduces are " + ", ".join(
        f"{v:.2f} ms (batch {b})" for b, v in zip(BATCHES, delta["all-reduces per step, fit (ms)"])) + "; the "
    "measured TP=2 step differs from TP=1 by " + ", ".join(
        f"{v:+.2f} ms" for v in delta["measured TP=2 - TP=1, graphs (ms)"]) + " and the roofline's by " + ", ".join(
        f"{v:+.2f} ms" for v in delta["simulated TP=2 - TP=1, roofline (ms)"]) + ".\n"
    "- The measured steps include the engine's host work per step (scheduling, input preparation, sampling), "
    "which TP does not halve; async scheduling hides part of it (the async rows)."))

# %% [markdown]
# ## Part 2. Llama-3.1-70B at TP=2, 4 and 8
#
# Per GPU and TP size: whether the weights fit (90% of memory, weights, an activation reserve and at least one
# KV block per rank), the KV cache left, and the decode step at batch 1 and 64 with the share the all-reduces
# take. Then the Azure conversation trace's request lengths with Poisson arrivals at a range of rates, one
# replica per TP group: goodput under the SLOs (TTFT and TPOT), TPOT and output throughput per GPU.
#
# The all-reduce fit was measured between 2 GPUs; for 4 and 8 the ring formula extrapolates it, assuming every
# rank keeps the same NVLink bandwidth to its neighbour (an NVSwitch node). The H100-SXM preset uses the H200's
# fit (the same NVLink generation). The roofline's constants were recalibrated from the shipped profiles, which
# were measured while every step with a prefill chunk ran eager: it prices such a step at least
# `eager_overhead_per_layer_s x layers` of host time (0.97 ms per layer), a floor under any step that prefills
# that today's engine, replaying such steps as CUDA graphs, no longer pays.

# %%
spec70 = get_model_spec(model)
fits = []
for gpu in gpus:
    g = get_gpu_spec(gpu)
    for tp in tp_sizes:
        row = {"gpu": g.name, "tp": tp, "weights_per_rank_gb": rank_shape(spec70, tp).weight_params * 2 / 1e9}
        try:
            blocks = num_gpu_blocks(spec70, g, 16, 0.9, tp)
            row.update(fits=True, kv_tokens=blocks * 16, why="")
        except ValueError as e:
            row.update(fits=False, kv_tokens=0, why=str(e).split(": ", 1)[1].split("; ")[0])
        fits.append(row)
fits = pd.DataFrame(fits)
experiment.save_table(fits.round(1), out / "fits.csv")
fitting = fits[fits["fits"]]
print(f"the eager floor of a step with a prefill chunk: {CALIBRATED.eager_overhead_per_layer_s * 1e3:.3f} ms x "
      f"{spec70.num_hidden_layers} layers = {CALIBRATED.eager_overhead_per_layer_s * spec70.num_hidden_layers * 1e3:.0f} ms")

# %%
trace = experiment.trace_path(full, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv")
limit, rates = (None, [1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32]) if full else (1000, [1, 2, 4, 8, 12, 16, 32])
common70 = dict(model=model, cost_model="roofline", seed=seed, slo_ttft=slo_ttft_s, slo_tpot=slo_tpot_s)
configs = [{**common70, "name": f"{r.gpu}-tp{r.tp}-decode_b{b}", "gpu": r.gpu, "tensor_parallel_size": r.tp,
            "trace": str(workloads[f"decode_b{b}"])} for r in fitting.itertuples() for b in BATCHES]
configs += [{**common70, "name": f"{r.gpu}-tp{r.tp}-rate{rate}", "gpu": r.gpu, "tensor_parallel_size": r.tp,
             "request_rate": rate, "limit": limit} for r in fitting.itertuples() for rate in rates]
sims70 = sweep(configs, trace, jobs=jobs, output=out / "llama-3.1-70b")
assert not sims70["warnings"].any(), sims70.loc[sims70["warnings"] != "", ["name", "warnings"]]
served = sims70[sims70["request_rate"].notna()].copy()
served["setup"] = [f"{g} TP={tp}" for g, tp in zip(served["gpu"], served["tensor_parallel_size"])]
served["output tok/s per GPU"] = served["output_throughput"] / served["tensor_parallel_size"]
served["goodput per GPU"] = served["goodput"] / served["tensor_parallel_size"]
experiment.save_table(served[["setup", "request_rate", "goodput", "goodput per GPU", "output tok/s per GPU",
                              "ttft_s.p50", "ttft_s.p99", "tpot_s.p50", "tpot_s.p99", "kv_util_max",
                              "num_preemptions"]], out / "llama-3.1-70b_rates.csv")

# %% [markdown]
# ## Figure
#
# (a) The all-reduce: measured between two H200s, the fit, and what the ring formula extrapolates for 4 and 8
# ranks. (b) The Llama-3.1-8B decode step, measured and simulated. (c) Llama-3.1-70B: goodput against the
# offered rate. (d) Llama-3.1-70B: TPOT against output throughput per GPU, one point per rate.

# %%
fig, axes = plt.subplots(2, 2, figsize=(15, 10), layout="constrained")
axes = axes.ravel()
ax = axes[0]
sizes = np.geomspace(ar["bytes"].min(), ar["bytes"].max() * 4, 60)
ax.plot(ar["bytes"], ar["measured_us"], "o", color="k", label=f"measured, the engine's, 2 x {gpu8.name}")
ax.plot(ar["bytes"], ar["nccl_us"], "s", color="grey", mfc="none", label="measured, NCCL outside a graph")
for i, tp in enumerate((2, 4, 8)):
    ax.plot(sizes, [allreduce_s(b, tp, gpu8) * 1e6 for b in sizes], ls="-" if tp == 2 else "--", color=f"C{i}",
            label=f"simulator, TP={tp}" + ("" if tp == 2 else " (extrapolated)"))
ax.set(xscale="log", yscale="log", xlabel="bytes all-reduced", ylabel="time (us)", title="(a) one all-reduce")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)

ax = axes[1]
x = np.arange(len(compare))
width = 0.8 / len(BATCHES)
for j, b in enumerate(BATCHES):
    ax.bar(x + (j - (len(BATCHES) - 1) / 2) * width, compare[f"decode b{b} (ms)"], width, label=f"batch {b}", color=f"C{j}",
           hatch=["" if s == "measured" else "//" for s in compare["source"]], edgecolor="white")
ax.set_xticks(x, [f"{e}\n({s})" for e, s in zip(compare["engine"], compare["source"])], fontsize=7, rotation=30,
              ha="right")
ax.set(ylabel="decode step (ms)", title=f"(b) {spec8.name} on {gpu8.name}: measured (plain), simulated (hatched)")
ax.grid(True, axis="y", alpha=0.3)
ax.legend(fontsize=8)

for i, (setup, g) in enumerate(served.groupby("setup", sort=False)):
    style = dict(marker="o", ms=3, color=f"C{i}", ls="-" if g["gpu"].iloc[0] == gpus[0] else "--", label=setup)
    axes[2].plot(g["request_rate"], g["goodput"], **style)
    axes[3].plot(g["output tok/s per GPU"], 1e3 * g["tpot_s.p50"], **style)
axes[2].plot(rates, rates, ":", color="grey", lw=1)
axes[2].set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", ylim=(0, None),
            title=f"(c) {model}: goodput, TTFT <= {slo_ttft_s:g} s, TPOT <= {slo_tpot_s * 1e3:g} ms")
axes[3].set(xlabel="output throughput per GPU (tok/s)", ylabel="TPOT p50 (ms)",
            title=f"(d) {model}: latency against throughput per GPU")
for ax in axes[2:]:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
fig.suptitle(f"Tensor parallelism: the all-reduce fit and the measured TP runs ({bench['date']}), and "
             f"{model} projected by the roofline", fontweight="bold")
experiment.save_figure(fig, out / "tensor_parallelism.png")

# %% [markdown]
# ## What TP=2, 4 and 8 would give for Llama-3.1-70B
#
# Per GPU and TP size: memory, the decode step and the all-reduces' share of it at batch 64, the best goodput
# over the swept rates (in total and per GPU) and the output throughput per GPU at the highest rate.


# %%
def projection(r) -> dict:
    row = {"gpu": r.gpu, "tp": r.tp, "fits": r.fits, "weights per rank (GB)": r.weights_per_rank_gb,
           "KV tokens": r.kv_tokens}
    if not r.fits:
        return {**row, "why not": r.why}
    name = f"{r.gpu}-tp{r.tp}"
    runs = sims70.set_index("name")
    step = {b: decode_step_ms(runs.loc[f"{name}-decode_b{b}", "run_dir"], b) for b in BATCHES}
    ar_ms = 2 * spec70.num_hidden_layers * allreduce_s(64 * spec70.hidden_size * 2, r.tp, get_gpu_spec(r.gpu)) * 1e3
    g = served[served["name"].str.startswith(f"{name}-rate")]
    best = g.loc[g["goodput"].idxmax()]
    return {**row, "decode b1 (ms)": step[1], "decode b64 (ms)": step[64],
            "all-reduce share b64 (%)": 100 * ar_ms / step[64] if r.tp > 1 else 0.0,
            "best goodput (req/s)": best["goodput"], "at rate": best["request_rate"],
            "best goodput per GPU": best["goodput per GPU"],
            f"output tok/s per GPU at {max(rates)} req/s": g["output tok/s per GPU"].iloc[-1]}


table = pd.DataFrame([projection(r) for r in fits.itertuples(index=False)])
table = table[[c for c in table.columns if c != "why not"] + ["why not"]]
experiment.save_table(table.round(3), out / "llama-3.1-70b_tp.csv")
