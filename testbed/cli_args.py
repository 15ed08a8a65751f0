"""Flags and output shared by the CLI's commands (`testbed simulate | replay | serve | bench`).

Below both the CLI and the modules that register its `serve` and `bench` subcommands, so neither
imports the other.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

from testbed.engine.config import (DEFAULT_DP_ROUTING_DELAY, DP_POLICIES, PREEMPTION_MODES, SCHEDULING_POLICIES,
                                   EngineConfig)
from testbed.specs.presets import MODEL_PRESETS


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help as vLLM's: every flag shows its default, unless its help already says it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class RawDescriptionDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """DefaultsHelpFormatter that keeps a description's own line breaks (`serve` and `bench serve` show examples)."""


class ArgumentParser(argparse.ArgumentParser):
    """The CLI's parser: DefaultsHelpFormatter unless told otherwise, and a bad command line (an ambiguous or
    missing flag, a value of the wrong type) is one line naming the command, not the usage block (subcommands
    inherit the class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        listed = "commands" if any(isinstance(a, argparse._SubParsersAction) for a in self._actions) else "flags"
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists the {listed}\n")


def add_engine_args(p: argparse.ArgumentParser, model_default: str) -> None:
    """Engine flags shared by every command that builds an EngineCore (vLLM's names and defaults)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=model_default,
                   help=f"a model preset ({', '.join(MODEL_PRESETS)}); default: {model_default}" if model_default else
                        "model folder, .gguf file, hub id in the local cache, or a preset with --load-format dummy "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs each replica's model is split over")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages each replica's layers are split into (each on --tensor-parallel-size GPUs; "
                        "up to this many batches in flight)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas behind the DP coordinator")
    g.add_argument("--dp-policy", choices=DP_POLICIES, default="least_loaded", help="DP routing policy")
    g.add_argument("--dp-stats-interval", type=float, default=0.0, metavar="SECONDS",
                   help="least time between two stats reports of a DP replica to the coordinator "
                        "(default 0: after every step that changed its queues)")
    g.add_argument("--dp-routing-delay", type=float, default=DEFAULT_DP_ROUTING_DELAY, metavar="SECONDS",
                   help="simulator: arrival -> admission at a DP replica through the coordinator "
                        "(default: %(default)s, measured; real runs record theirs in routes.parquet)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens in one step (the chunked-prefill budget)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per replica (default: from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory for weights, activations and KV cache")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                   help="what a preempted request's KV blocks become: freed and recomputed later, or swapped to a CPU "
                        "pool of --swap-space GiB and back (recompute when that pool is full)")
    g.add_argument("--swap-space", type=float, default=4.0, metavar="GIB",
                   help="CPU swap pool per GPU (per tensor-parallel rank) with --preemption-mode swap")
    g.add_argument("--num-cpu-blocks", type=int, default=None, help="CPU swap pool in blocks (default: from --swap-space)")
    g.add_argument("--enable-prefix-caching", action="store_true", help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help="schedule every prompt whole (default: in chunks under --max-num-batched-tokens)")
    g.add_argument("--policy", "--scheduling-policy", dest="policy", choices=SCHEDULING_POLICIES, default="fcfs", help="waiting-queue order")
    g.add_argument("--max-num-waiting", type=int, default=None, help="reject new requests beyond this many waiting")
    g.add_argument("--async-scheduling", action="store_true",
                   help="keep one step in flight: schedule the next step while the device runs this one")
    g.add_argument("--seed", type=int, default=0, help="seed of sampling, synthetic prompts and arrivals")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (requests name one; vLLM's flag)")
    g.add_argument("--max-loras", type=int, default=1, help="most LoRA adapters in one step (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank served (the slots' size)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept in host memory, least recently used dropped first (default: --max-loras)")
    g.add_argument("--structured-outputs-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="a request's JSON schema, regex or grammar must be checked and compiled within this time, "
                        "or it is rejected (a 400); both run off the step loop and the event loop, holding up no "
                        "other request (default: %(default)s)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="token counts of the steps captured as CUDA graphs on a GPU (decode batches up to "
                        "--max-num-seqs, mixed/prefill steps up to --max-num-batched-tokens; default: 1 2 4 8, "
                        "every 16 to --max-num-seqs; every 32 to 512, then steps of 1/8 of the power of two below)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.policy,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        dp_policy=args.dp_policy, dp_stats_interval=args.dp_stats_interval, dp_routing_delay=args.dp_routing_delay,
        max_num_waiting=args.max_num_waiting, async_scheduling=args.async_scheduling,
        seed=args.seed, cuda_graph_sizes=args.cuda_graph_sizes, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space, num_cpu_blocks=args.num_cpu_blocks,
        structured_outputs_timeout=args.structured_outputs_timeout)


def add_lora_modules_arg(g) -> None:
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) by name, with --enable-lora: the models a server serves beside "
                        "the base model, the folders of the adapters a replayed trace names")


def add_trace_args(p: argparse.ArgumentParser, trace_required: bool = True) -> None:
    p.add_argument("trace", **({} if trace_required else {"nargs": "?", "default": None}),
                   help="trace file: project JSONL, Azure CSV, Mooncake JSONL or a length-only CSV; or a run "
                        "directory (the requests it recorded)")
    p.add_argument("--trace-format", default="auto", choices=("auto", "jsonl", "azure", "mooncake", "lengths"), help="trace file format (auto: from its first line)")
    p.add_argument("--request-rate", type=float, default=None, help="re-time arrivals at R req/s (gamma process)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds, for goodput")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds, for goodput")
    p.add_argument("--output", "-o", default=None, help="run directory (default: runs/<date>-<mode>-<trace>-<model>)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="summary on stdout")


def default_run_dir(mode: str, trace: str, model: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", x).strip("_") for x in (Path(trace).stem, Path(model).name))
    return Path("runs") / f"{stamp}-{mode}-{slug}"


def print_result(summary: dict, run_dir: Path | None, fmt: str, title: str, setup: str | None = None) -> None:
    from testbed.runs.report import format_summary
    if fmt == "json":
        print(json.dumps({"run_dir": str(run_dir) if run_dir else None, **summary}, sort_keys=True))
    else:
        print(format_summary(summary, title, setup))
        if run_dir is not None:
            print(f"Run directory: {run_dir}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "gguf", "dummy"),
                   help="dummy = random weights of a named shape (SmolLM2-135M, Qwen3-0.6B, Llama-3.2-1B, Llama-3.1-8B)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
