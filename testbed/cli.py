"""`testbed simulate | replay | serve | bench | profile | dashboard` — flags named as vLLM's."""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from testbed.engine.config import DP_POLICIES, SCHEDULING_POLICIES, ConfigError, EngineConfig


def add_engine_args(p: argparse.ArgumentParser, model_default: str) -> None:
    """Engine flags shared by every command that builds an EngineCore (vLLM's names and defaults)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=model_default,
                   help="model name or path (default: %(default)s; none = the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--dp-policy", choices=DP_POLICIES, default="least_loaded", help="DP routing policy")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per replica (default: from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--policy", "--scheduling-policy", dest="policy", choices=SCHEDULING_POLICIES, default="fcfs")
    g.add_argument("--max-num-waiting", type=int, default=None, help="reject new requests beyond this many waiting")
    g.add_argument("--async-scheduling", action="store_true",
                   help="keep one step in flight: schedule the next step while the device runs this one")
    g.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.policy,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        dp_policy=args.dp_policy, max_num_waiting=args.max_num_waiting, async_scheduling=args.async_scheduling,
        seed=args.seed)


def add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file: project JSONL, Azure CSV, Mooncake JSONL or a length-only CSV")
    p.add_argument("--trace-format", default="auto", choices=("auto", "jsonl", "azure", "mooncake", "lengths"))
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


def print_result(summary: dict, run_dir: Path | None, fmt: str, title: str) -> None:
    from testbed.report import format_summary
    if fmt == "json":
        print(json.dumps({"run_dir": str(run_dir) if run_dir else None, **summary}, sort_keys=True))
    else:
        print(format_summary(summary, title))
        if run_dir is not None:
            print(f"Run directory: {run_dir}")


def cmd_simulate(args: argparse.Namespace) -> int:
    from testbed.sim.run import run_simulation
    cfg = engine_config(args)
    out = args.output or default_run_dir("sim", args.trace, args.model)
    run_dir, summary = run_simulation(
        args.trace, cfg, model=args.model, gpu=args.gpu, cost_model=args.cost_model,
        request_rate=args.request_rate, burstiness=args.burstiness, limit=args.limit, trace_format=args.trace_format,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, output=out, progress=not args.no_progress)
    print_result(summary, run_dir, args.format, "Simulation Result")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from testbed.replay import run_replay
    cfg = engine_config(args)
    out = args.output or default_run_dir("real", args.trace, args.model or "SmolLM2-135M-Instruct")
    run_dir, summary = run_replay(
        args.trace, cfg, model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        request_rate=args.request_rate, burstiness=args.burstiness, limit=args.limit, trace_format=args.trace_format,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, output=out)
    print_result(summary, run_dir, args.format, "Replay Result (real)")
    return 0


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "gguf", "dummy"),
                   help="dummy = random weights of a named shape (SmolLM2-135M, Qwen3-0.6B, Llama-3.2-1B, Llama-3.1-8B)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def cmd_profile(args: argparse.Namespace) -> int:
    """Sweep synthetic steps through the real executor and write the measured profile."""
    from testbed.sim.profiled import ProfiledCostModel
    from testbed.worker.profiler import build_profile
    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"--output {out}: is a directory; give the profile JSON file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    prof = build_profile(args.model, engine_config(args), args.load_format, args.dtype, args.device,
                         args.enforce_eager, args.quick, progress=not args.no_progress)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(prof, indent=1) + "\n")
    tmp.replace(out)
    cm = ProfiledCostModel(prof, name=str(out))
    errors = cm.validate()
    print(f"profiled {prof['model']['name']} on {prof['device_name']} (tp={prof['tensor_parallel_size']}) in "
          f"{prof['sweep_wall_s']:.0f} s; composition error on {errors.get('sync_steps', 0)} held-out mixed steps: "
          + ", ".join(f"{k} {v:.1%}" for k, v in errors.items() if not k.endswith("_steps")))
    print(f"wrote {out} (use: testbed simulate TRACE --cost-model {out})")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from testbed.dashboard.launch import main_dashboard
    return main_dashboard(args.runs, args.port, args.host)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="replay a trace through the engine in simulated time")
    add_trace_args(p)
    add_engine_args(p, "Llama-3.1-8B")
    p.add_argument("--gpu", default="H100-SXM", help="GPU preset: H100-SXM, H200, A100-80GB, L4")
    p.add_argument("--cost-model", default="auto",
                   help="'auto' (the profile shipped for --model/--gpu/TP, else the roofline with a warning), "
                        "'roofline', a profile JSON from `testbed profile`, or 'recorded:RUN_DIR' to replay a real "
                        "run's steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("replay", help="replay a trace's arrivals through the real engine in-process")
    add_trace_args(p)
    add_engine_args(p, None)
    add_model_args(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("profile", help="measure the step time of the real engine on this GPU: a profile for simulate")
    add_engine_args(p, None)
    add_model_args(p)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (profile an eager engine)")
    p.add_argument("--output", "-o", required=True, help="profile JSON to write")
    p.add_argument("--quick", action="store_true", help="a few points of each sweep (a smoke test, not a profile)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("dashboard", help="Streamlit dashboard over run directories (on 127.0.0.1)")
    p.add_argument("runs", nargs="*", default=["runs"], help="folders holding run directories (default: runs)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--host", default="127.0.0.1")
    p.set_defaults(func=cmd_dashboard)

    from testbed.server.bench import add_bench_parser
    from testbed.server.serve import add_serve_parser
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"testbed {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
