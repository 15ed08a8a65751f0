"""`testbed simulate | replay | serve | bench | profile | calibrate | compare | dashboard` — flags named as vLLM's."""
from __future__ import annotations

import argparse
import sys

from testbed.cli_args import ArgumentParser, add_engine_args, add_lora_modules_arg, add_model_args, add_trace_args, default_run_dir, engine_config, print_result
from testbed.engine.config import ConfigError


def cmd_simulate(args: argparse.Namespace) -> int:
    from testbed.sim.run import run_simulation
    cfg = engine_config(args)
    trace = args.trace or args.like
    if trace is None:
        raise ValueError("give a TRACE file, or --like RUN_DIR to simulate the requests a run served")
    if args.like is not None:
        from testbed.runs.rundir import read_run
        from testbed.sim.like import like_config
        run = read_run(args.like)
        cfg = like_config(run, take_from_run(args, run, cfg))
    out = args.output or default_run_dir("sim", trace, args.model)
    run_dir, summary = run_simulation(
        trace, cfg, model=args.model, gpu=args.gpu, cost_model=args.cost_model,
        request_rate=args.request_rate, burstiness=args.burstiness, limit=args.limit, trace_format=args.trace_format,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, output=out, progress=not args.no_progress)
    setup = None
    if run_dir is not None and args.format == "table":
        from testbed.runs.report import format_setup
        from testbed.runs.rundir import read_run
        run = read_run(run_dir)
        replicas = run.request_column("replica")
        setup = format_setup(run.manifest, [replicas.count(i) for i in range(cfg.data_parallel_size)])
    print_result(summary, run_dir, args.format, "Simulation Result", setup)
    return 0


def take_from_run(args: argparse.Namespace, run, cfg):
    """--like: the run's model, GPU and engine flags for every one not given on the command line (`args.given`),
    with one line on stderr saying what was taken."""
    import dataclasses

    from testbed.sim.like import run_setup
    model, gpu, engine = run_setup(run)
    given = getattr(args, "given", set())
    taken = []
    if model is not None and "model" not in given and model != args.model:
        args.model = model
        taken.append(f"--model {model}")
    if gpu is not None and "gpu" not in given and gpu != args.gpu:
        args.gpu = gpu
        taken.append(f"--gpu {gpu}")
    changes = {k: v for k, v in engine.items() if k not in given and k not in ("num_gpu_blocks", "num_cpu_blocks", "max_model_len")
               and getattr(cfg, k) != v}
    for k, v in changes.items():
        taken.append(f"--{k.replace('_', '-')} {v}")
    # what the run does not record (a `bench serve` run knows neither the server's GPU nor its engine flags)
    unknown = [(what, used) for what, value, flag, used in
               (("model", model, "model", f"--model {args.model}"), ("GPU", gpu, "gpu", f"--gpu {args.gpu}"),
                ("engine flags", engine or None, None, "the engine flags given here or their defaults"))
               if value is None and (flag is None or flag not in given)]
    notes = [f"{', '.join(taken)} (flags given here override)"] if taken else []
    if unknown:
        notes.append(f"the run records no {' and no '.join(w for w, _ in unknown)}: simulating with "
                     f"{' and '.join(u for _, u in unknown)} (give the run's own to match it)")
    if notes:
        print(f"testbed simulate: note: from {args.like}: {'; '.join(notes)}", file=sys.stderr)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of the subcommand `command` (`testbed COMMAND ...`; "bench serve" for a nested one)."""
    for word in command.split():
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return parser


def command_name(args: argparse.Namespace) -> str:
    """The subcommand that runs, as typed after `testbed` ("simulate", "bench serve")."""
    return " ".join(filter(None, (args.command, getattr(args, "bench_command", None))))


def given_dests(parser: argparse.ArgumentParser, argv: list[str], command: str) -> set[str]:
    """The destinations of the flags given on the command line for `command` (abbreviations too): the
    subcommand's parser run again over a namespace that already holds every destination, so argparse
    fills in no default and only what was given replaces the placeholder."""
    sub = subcommand_parser(parser, command)
    unset = object()
    ns = argparse.Namespace(**{a.dest: unset for a in sub._actions if a.dest != argparse.SUPPRESS})
    rest = argv[argv.index(command) + 1:] if command in argv else argv
    sub.parse_known_args(rest, ns)
    return {k for k, v in vars(ns).items() if v is not unset}


def cmd_replay(args: argparse.Namespace) -> int:
    from testbed.entrypoints.replay import run_replay
    cfg = engine_config(args)
    out = args.output or default_run_dir("real", args.trace, args.model or "SmolLM2-135M-Instruct")
    run_dir, summary = run_replay(
        args.trace, cfg, model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        request_rate=args.request_rate, burstiness=args.burstiness, limit=args.limit, trace_format=args.trace_format,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, output=out, lora_modules=args.lora_modules)
    print_result(summary, run_dir, args.format, "Replay Result (real)")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Sweep synthetic steps through the real executor and write the measured profile(s): one model to a file,
    or several (comma-separated) into a folder, one profile each, skipping those that do not fit the GPU."""
    from testbed.profiling.profile_file import output_path, output_target, write_profile
    from testbed.profiling.sweep import build_profile
    from testbed.sim.profiled import ProfiledCostModel
    models = [m.strip() for m in (args.model or "").split(",")] if args.model else [None]
    if args.quick and args.smoke:
        raise ValueError("--quick rescales a profile from a few anchor steps, --smoke makes a tiny full sweep: give one")
    if args.dp_replica_host and not args.quick and args.cost_model != "auto":
        return add_dp_replica_host(args)
    if args.cost_model != "auto" and not args.quick:
        raise ValueError(f"--cost-model {args.cost_model}: only --quick (the profile it rescales) and "
                         "--dp-replica-host (the profile it adds the term to) take a profile")
    out, many = output_target(args.output, len(models))
    written = []
    for model in models:
        try:
            if args.quick:
                from testbed.sim.quick_rescale import quick_rescale
                prof, path = quick_rescale(args, engine_config(args), model, out, many)
            else:
                prof = build_profile(model, engine_config(args), args.load_format, args.dtype, args.device,
                                     args.enforce_eager, args.smoke, progress=not args.no_progress, reps=args.reps)
                path = output_path(out, many, prof["model"]["name"], prof["gpu"], prof["tensor_parallel_size"])
        except (RuntimeError, ValueError) as e:
            if not many:
                raise
            print(f"testbed profile: skipping {model}: {e}", file=sys.stderr)
            continue
        write_profile(path, prof)
        if args.dp_replica_host:  # the replicas' loops emulate the steps of the profile just written
            from testbed.sim.dp_host_measure import profile_section
            prof["dp_replica_host"] = profile_section(prof, str(path), engine_config(args))
            write_profile(path, prof)
        if not args.quick:
            errors = ProfiledCostModel(prof, name=str(path)).validate()
            print(f"profiled {prof['model']['name']} on {prof['device_name']} (tp={prof['tensor_parallel_size']}) "
                  f"in {prof['sweep_wall_s']:.0f} s; composition error on {errors.get('sync_steps', 0)} held-out "
                  "mixed steps: " + ", ".join(f"{k} {v:.1%}" for k, v in errors.items() if not k.endswith("_steps")))
        print(f"wrote {path} (use: testbed simulate TRACE --cost-model {path})")
        written.append(path)
    return 0 if written else 2


def add_dp_replica_host(args: argparse.Namespace) -> int:
    """`testbed profile --dp-replica-host --cost-model P.json -o OUT`: P with the DP replica host term measured on
    this host (sim/dp_host_measure.py), no sweep."""
    from testbed.sim.dp_host_measure import profile_section
    from testbed.profiling.profile_file import read_profile, write_profile
    from testbed.sim.profiled import ProfiledCostModel
    if args.smoke or (args.model and "," in args.model):
        raise ValueError("--dp-replica-host with --cost-model adds the term to that one profile: no --smoke, one model")
    prof = read_profile(args.cost_model)
    ProfiledCostModel(prof, name=args.cost_model)  # a usable profile, or its ProfileError
    section = profile_section(prof, args.cost_model, engine_config(args))
    out = write_profile(args.output, {**prof, "dp_replica_host": section})
    print(f"dp replica host on this host: {section['step_s'] * 1e3:.3f} ms a step + {section['row_s'] * 1e6:.2f} us a "
          f"row (replica gap less the single engine's at batch {section['batch']}, {section['wall_s']:.0f} s)")
    print(f"wrote {out} (use: testbed simulate TRACE -dp N --cost-model {out})")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from testbed.dashboard.launch import main_dashboard
    return main_dashboard(args.runs, args.port, args.host)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="replay a trace through the engine in simulated time")
    add_trace_args(p, trace_required=False)
    p.add_argument("--like", default=None, metavar="RUN_DIR",
                   help="simulate the workload of a recorded run: its requests (unless TRACE is given), its KV-cache "
                        "size, max_model_len, model, GPU and engine flags (each unless given here)")
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
    add_lora_modules_arg(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("profile", help="measure the step time of the real engine on this GPU: a profile for simulate")
    add_engine_args(p, None)
    add_model_args(p)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (profile an eager engine)")
    p.add_argument("--output", "-o", required=True,
                   help="profile JSON to write; a folder for several --model names (comma-separated), one file each")
    p.add_argument("--quick", action="store_true",
                   help="rescale a profile to this machine from a few anchor steps (about a minute) instead of a "
                        "full sweep: --cost-model names the profile (default: the one shipped for this model and GPU)")
    p.add_argument("--cost-model", default="auto",
                   help="with --quick: the profile to rescale, 'auto' (the shipped one for this model, GPU and TP) "
                        "or a profile file; with --dp-replica-host alone: the profile to add the term to")
    p.add_argument("--dp-replica-host", action="store_true",
                   help="also measure a data-parallel replica's host work per step beyond a single engine's (its "
                        "engine process loop against the in-process one, emulated steps, on this host); with "
                        "--cost-model FILE (no --quick): only that, added to FILE")
    p.add_argument("--smoke", action="store_true", help="a few points of each sweep (a smoke test, not a profile)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed runs per point, median taken (default 5; --quick times the engine's host work over "
                        "6x as many decode steps)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("dashboard", help="Streamlit dashboard over run directories (on 127.0.0.1)")
    p.add_argument("runs", nargs="*", default=["runs"], help="folders holding run directories (default: runs)")
    p.add_argument("--port", type=int, default=8501, help="port of the Streamlit server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (the dashboard has no password: keep it local)")
    p.set_defaults(func=cmd_dashboard)

    from testbed.bench.serve import add_bench_parser
    from testbed.runs.compare import add_compare_parser
    from testbed.server.serve import add_serve_parser
    from testbed.sim.rescale import add_calibrate_parser
    add_serve_parser(sub)
    add_calibrate_parser(sub)
    add_bench_parser(sub)
    add_compare_parser(sub)
    return parser


def unrecognized(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> str:
    """One line naming the flags `command` does not take, each with the closest flag it does take."""
    import difflib
    sub = subcommand_parser(parser, command)
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    parts = []
    for x in extras:
        flag = x.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8) if flag.startswith("-") else []
        parts.append(f"{x} (did you mean {close[0]}?)" if close else x)
    noun = "argument" if len(extras) == 1 else "arguments"
    return f"testbed {command}: error: unrecognized {noun} {', '.join(parts)}; `testbed {command} --help` lists the flags"


def main(argv: list[str] | None = None) -> int:
    """Run one command; every expected failure is one line `testbed CMD: error: ...` and exit code 2, a Ctrl-C
    exit code 130. As the process's entry (argv None, main thread), SIGINT is ignored once the command is over:
    a late one, during the interpreter's shutdown, would otherwise end a finished command by the signal.
    As the process's entry, the cyclic garbage collector is off while the parser is built (which imports the
    commands' modules, numpy and pyarrow among them): what that makes lives as long as the process, so the
    collector's 75 passes over it found nothing (about 6% of the imports' time). The command runs with the
    collector on, those objects frozen out of its passes."""
    import contextlib
    import signal
    import threading

    from testbed.sim.collector import collector_paused
    entry = argv is None and threading.current_thread() is threading.main_thread()
    try:
        with collector_paused() if entry else contextlib.nullcontext():
            parser = build_parser()
        return _main(parser, argv)
    except KeyboardInterrupt:  # between the command's own handler and here (its clean-up)
        return 130
    finally:
        if entry:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """The command line's command, parsed by `parser` (build_parser's)."""
    args, extras = parser.parse_known_args(argv)
    command = command_name(args)
    if extras:  # the subcommand's own one-line error, with the flag it most likely meant
        print(unrecognized(parser, command, extras), file=sys.stderr)
        return 2
    if args.command == "simulate":
        args.given = given_dests(parser, list(sys.argv[1:] if argv is None else argv), args.command)
    import os

    from testbed import COMMAND_ENV
    outer = os.environ.get(COMMAND_ENV)
    os.environ[COMMAND_ENV] = f"testbed {command}"  # warnings, here and in the processes it starts
    try:
        return args.func(args)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"testbed {command}: error: {e}", file=sys.stderr)
    except BrokenPipeError:  # stdout closed early (`| head`): no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a file that cannot be read or written: name it
        where = f"{e.filename}: " if e.filename else ""
        print(f"testbed {command}: error: {where}{e.strerror or e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"testbed {command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if outer is None:
            os.environ.pop(COMMAND_ENV, None)
        else:
            os.environ[COMMAND_ENV] = outer
    return 2


if __name__ == "__main__":
    sys.exit(main())
