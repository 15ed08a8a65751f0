"""`testbed serve [MODEL]`: start the engine-core process, then the API server (uvicorn) in this one.

Startup: resolve the model (no MODEL = the bundled SmolLM2), spawn the engine core while the
tokenizer loads, bind only once the executor is ready. SIGTERM / SIGINT: stop accepting, let
in-flight requests finish within --shutdown-timeout, then end the rest with an OpenAI error (503
`server_shutting_down`; a stream gets an error event and [DONE]), stop the engine core, exit 0.
A second SIGINT forces the exit.

With --data-parallel-size N > 1 the engine core becomes a DP coordinator process and N replica
processes (dp_client.py); `--headless` runs only replicas, for the node that holds the API server.

Engine death: the in-flight requests of a dead engine core (or DP replica) end with an error (503
`engine_dead`). While another replica serves, the server keeps serving and /health reports the dead
ones (degraded). When the engine is gone as a whole (the one engine core, every replica, or the DP
coordinator), the server exits with code 1, unless --keep-alive-on-engine-death keeps it answering
503 (as vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
from pathlib import Path

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default
HEARTBEATS_PER_TIMEOUT = 3  # --data-parallel-heartbeat-timeout is at least this many heartbeat intervals
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
SHUTDOWN_GRACE_S = 5.0  # after --shutdown-timeout: for the error responses to go out before uvicorn cancels


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` (vLLM's flags) on the CLI's subparsers."""
    from testbed.cli_args import RawDescriptionDefaultsHelpFormatter, add_engine_args, add_lora_modules_arg
    p = subparsers.add_parser("serve", help="OpenAI-compatible server: API server + engine-core process",
                              description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model folder, .gguf file or preset name (with --load-format dummy); default: bundled SmolLM2")
    add_engine_args(p, None)
    g = p.add_argument_group("server")
    g.add_argument("--served-model-name", default=None, help="name in the API (default: the model's folder name)")
    add_lora_modules_arg(g)
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or hub id (default: the model's; with --emulate of a preset, the bundled "
                        "SmolLM2 tokenizer)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer (as with dummy weights of a preset): prompts are token ids only, outputs "
                        "carry no text and each streamed token is an event of its own")
    g.add_argument("--revision", default=None, help="with a hub id: the revision in the local Hugging Face cache")
    g.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache a hub id is read from (default: $HF_HUB_CACHE, $HF_HOME/hub, "
                        "~/.cache/huggingface/hub); nothing is downloaded")
    g.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run code shipped with it")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="weights: from the model folder or file, or dummy (random weights of the named shape)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when there is one)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("TESTBED_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TESTBED_API_KEY, else vLLM's $VLLM_API_KEY; "
                        "unset = open). The environment keeps the key out of the process list, where a flag shows")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413 (default: %(default)s)")
    g.add_argument("--log-steps", default=None, metavar="DIR",
                   help="append the engine's step and request records to DIR/steps.jsonl, DIR/requests.jsonl")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM; then they end with an error "
                        "(default: %(default)s)")
    g.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="keep the API server up (answering 503) when the engine core dies, instead of exiting 1 "
                        "(with data parallelism: when every replica or the coordinator died; while one "
                        "replica serves, the server always stays up)")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how /v1/embeddings pools the final hidden states (vLLM\'s flag): {"pooling_type": "LAST" '
                        'or "MEAN", "normalize": true or false} (default: LAST, normalised)')
    g.add_argument("--metrics-prefix", choices=("vllm", "testbed"), default="vllm",
                   help="prefix of the /metrics families: vllm (vLLM's names, for its dashboards, autoscalers and "
                        "routers) or testbed (default: %(default)s)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"), help="uvicorn's log level")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    d = p.add_argument_group("data parallel (vLLM's flags)")
    d.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="replicas on this node (default: all of them)")
    d.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="rank of this node's first replica (a headless node's)")
    d.add_argument("--data-parallel-address", "-dpa", default="127.0.0.1",
                   help="address of the API server's node, where the DP coordinator listens (default: %(default)s)")
    d.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                   help=f"the coordinator's port for replicas (default: {DEFAULT_RPC_PORT} with replicas on other "
                        "nodes, else any free port)")
    d.add_argument("--data-parallel-backend", "-dpb", choices=("mp", "ray"), default="mp",
                   help="mp: replica processes on each node; ray: replicas as actors on a running Ray cluster")
    d.add_argument("--headless", action="store_true",
                   help="run only this node's replicas (no API server); they connect to --data-parallel-address. "
                        "Every node needs the same TESTBED_RPC_SECRET in its environment (frames between the "
                        "engine processes are authenticated with it)")
    d.add_argument("--data-parallel-heartbeat-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a replica that sends the coordinator no message for this long is declared dead; a live "
                        "one sends a heartbeat every --data-parallel-heartbeat-interval (default: %(default)s, at "
                        f"least {HEARTBEATS_PER_TIMEOUT} intervals)")
    d.add_argument("--data-parallel-heartbeat-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often a live replica sends the coordinator a heartbeat, however busy it is (the "
                        "coordinator tells every replica, other nodes' too; default: %(default)s)")
    g.add_argument("--executor-factory", default=None, metavar="MODULE:FUNCTION",
                   help="build the engine core's executor with this function instead of the model runner "
                        "(research hook; --emulate is this with testbed.sim.emulator:create)")
    e = p.add_argument_group("emulation (no GPU: each step takes the predicted time of one)")
    e.add_argument("--emulate", action="store_true",
                   help="serve with an executor that runs no model: steps take the cost model's time for --gpu "
                        "and emit synthetic tokens (each request echoes its prompt)")
    e.add_argument("--gpu", default="H100-SXM", help="GPU preset whose timing --emulate reproduces")
    e.add_argument("--cost-model", default="auto",
                   help="with --emulate: 'auto' (the shipped profile for the model and --gpu, else the roofline), "
                        "'roofline', 'zero' (no waiting) or a profile JSON")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from testbed.server import run_event_loop
    if args.headless:
        return run_headless_node(args)
    return run_event_loop(run_server(args))


def dp_topology(args: argparse.Namespace, dp: int):
    """The data-parallel layout the flags ask for (ConfigError naming the flag when it cannot be)."""
    from testbed.engine.config import ConfigError
    from testbed.runtime.dp_client import DPTopology
    from testbed.runtime.frames import deployment_secret
    local, start, port = args.data_parallel_size_local, args.data_parallel_start_rank, args.data_parallel_rpc_port
    beat, every = args.data_parallel_heartbeat_timeout, args.data_parallel_heartbeat_interval
    if not 0 < every < float("inf"):
        raise ConfigError(f"--data-parallel-heartbeat-interval {every:g}: give a positive, finite number of seconds")
    if not beat >= HEARTBEATS_PER_TIMEOUT * every or beat == float("inf"):
        raise ConfigError(f"--data-parallel-heartbeat-timeout {beat:g}: give a finite number of seconds, at least "
                          f"{HEARTBEATS_PER_TIMEOUT * every:g} ({HEARTBEATS_PER_TIMEOUT} heartbeat intervals: a live "
                          f"replica sends one every {every:g} s, --data-parallel-heartbeat-interval)")
    if dp == 1:
        if args.headless or args.data_parallel_backend != "mp" or local not in (None, 1) or start:
            raise ConfigError("--headless, --data-parallel-backend, --data-parallel-size-local and "
                              "--data-parallel-start-rank need --data-parallel-size > 1")
        return None
    if args.data_parallel_backend == "ray":
        if args.headless or local is not None or start:
            raise ConfigError("--data-parallel-backend ray places every replica on the Ray cluster: drop --headless, "
                              "--data-parallel-size-local and --data-parallel-start-rank")
        return DPTopology(dp, args.data_parallel_address, port or 0, "ray", beat, every)
    local = dp if local is None and not args.headless else local
    if local is None or not 1 <= local <= dp:
        raise ConfigError(f"--data-parallel-size-local: give 1..{dp} replicas for this node"
                          + (" (a headless node needs it)" if local is None else f", got {local}"))
    if args.headless and not 1 <= start <= dp - local:
        raise ConfigError(f"--data-parallel-start-rank {start}: a headless node's replicas are ranks 1..{dp - 1} "
                          f"(rank 0 is on the API server's node); with {local} here it must be in 1..{dp - local}")
    if not args.headless and start:
        raise ConfigError("--data-parallel-start-rank: the API server's node holds ranks 0.."
                          f"{local - 1}; only a --headless node starts elsewhere")
    if local < dp or args.headless:
        try:
            deployment_secret(required_for="--data-parallel-size-local < --data-parallel-size (replicas on other nodes)")
        except RuntimeError as e:
            raise ConfigError(str(e)) from None
    if port is None:
        port = DEFAULT_RPC_PORT if (local < dp or args.headless) else 0
    return DPTopology(local, args.data_parallel_address, port, "mp", beat, every)


def engine_proc_config(args: argparse.Namespace, cfg, model: str):
    from testbed.engine.config import ConfigError
    from testbed.runtime.engine_proc import EngineProcConfig
    factory = args.executor_factory
    if factory is not None and (factory.count(":") != 1 or not all(factory.split(":"))):
        raise ConfigError(f"--executor-factory {factory!r}: give MODULE:FUNCTION, e.g. "
                          "testbed.sim.emulator:create (the module must be importable)")
    executor_args = {}
    if args.emulate:
        if factory is not None:
            raise ConfigError("--emulate: give either --emulate or --executor-factory, not both")
        from testbed.sim.emulator import check_emulation, emulated_model
        check_emulation(emulated_model(model), args.gpu, args.cost_model)  # here: one line, not the engine's traceback
        factory, executor_args = "testbed.sim.emulator:create", {"gpu": args.gpu, "cost_model": args.cost_model}
    return EngineProcConfig(engine=cfg.to_dict(), model=model, load_format=args.load_format, dtype=args.dtype,
                            device=args.device, enforce_eager=args.enforce_eager, log_steps=args.log_steps,
                            executor_args=executor_args, **({"executor_factory": factory} if factory else {}))


def run_headless_node(args: argparse.Namespace) -> int:
    """`testbed serve --headless`: this node's replicas only, until the coordinator stops them."""
    from testbed.cli_args import engine_config
    from testbed.worker.hub import resolve_model
    cfg = engine_config(args)
    topo = dp_topology(args, cfg.data_parallel_size)  # ConfigError unless data-parallel
    from testbed.runtime.dp_launch import run_headless  # torch (the host's GPUs): once the flags are right
    model = resolve_model(args.model_tag or args.model, args.load_format, args.revision, args.download_dir)
    addr = f"tcp://{topo.address}:{topo.rpc_port}"
    return run_headless(args.data_parallel_start_rank, topo.size_local, addr, engine_proc_config(args, cfg, model),
                        cfg.tensor_parallel_size * cfg.pipeline_parallel_size, args.device, _log)


def json_flag(value: str | None, flag: str, example: str):
    """The JSON value of a flag (None when not given); ConfigError with an example when it is not JSON."""
    import json
    from testbed.engine.config import ConfigError
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as e:
        raise ConfigError(f"{flag}: not JSON ({e}); e.g. {example}") from None


def _log(msg: str) -> None:
    print(f"testbed serve: {msg}", file=sys.stderr, flush=True)


def _load_tokenizer(path: str, trust_remote_code: bool = False):
    from testbed.worker.loader import load_tokenizer
    try:
        return load_tokenizer(path, trust_remote_code)
    except FileNotFoundError as e:
        _log(f"warning: {e}; text prompts and chat are refused, token-id prompts work")
        return None


def _server_class():
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its signal re-raise (it would turn a clean drain into exit code -15), calling
        `on_stop` once when it starts to stop."""

        on_stop = None

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and self.on_stop is not None:
                self.on_stop()

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


async def run_server(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from testbed.cli_args import engine_config
    from testbed.engine.config import ConfigError, PoolerConfig
    from testbed.runtime import freeze_startup_heap
    from testbed.server.api import build_app
    from testbed.runtime.client import EngineClient
    from testbed.text.detokenizer import TokenTexts
    from testbed.server.metrics import ServerMetrics
    from testbed.server.lora import LoRARegistry
    from testbed.workload.lora import parse_lora_modules
    from testbed.server.schemas import APIError
    from testbed.server.state import ServerState
    from testbed.worker.hub import resolve_model

    if args.skip_tokenizer_init and args.tokenizer is not None:
        raise ConfigError("--tokenizer: give either --tokenizer or --skip-tokenizer-init, not both")
    cfg = engine_config(args)
    pooler = PoolerConfig.of(json_flag(args.pooler_config, "--pooler-config", '{"pooling_type": "MEAN"}'))
    topology = dp_topology(args, cfg.data_parallel_size)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ConfigError(f"--model: given both as MODEL ({args.model_tag}) and --model ({args.model}); give one")
    model = resolve_model(args.model_tag or args.model, args.load_format, args.revision, args.download_dir)
    proc_cfg = engine_proc_config(args, cfg, model)
    served = args.served_model_name or os.path.basename(os.path.normpath(model))

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if topology is None:
        client = EngineClient(proc_cfg)
    else:
        from testbed.runtime.dp_client import DPEngineClient
        client = DPEngineClient(proc_cfg, topology)
    tokenizer_path = model if args.tokenizer is None else resolve_model(args.tokenizer, "auto", None,
                                                                        args.download_dir)
    if args.skip_tokenizer_init:
        tokenizer_path = None
    elif args.emulate and args.tokenizer is None and not Path(model).exists():
        # a preset has no tokenizer files: emulate with the bundled SmolLM2's, so text prompts and chat work
        # (its ids fit every preset's vocabulary)
        tokenizer_path = resolve_model(None, "auto")
        _log(f"emulating {model} with the bundled SmolLM2 tokenizer (--tokenizer PATH for another)")
    tokenizer_job = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, tokenizer_path, args.trust_remote_code)
                                          if tokenizer_path is not None else asyncio.sleep(0, None))
    start = asyncio.ensure_future(client.start())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait((start, stopper), return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # signalled while loading
        start.cancel()
        await client.shutdown()
        _log("stopped during startup")
        return 0
    stopper.cancel()
    ready = start.result()  # RuntimeError when the engine failed to start
    try:
        tokenizer = await tokenizer_job
    except BaseException:
        await client.shutdown()
        raise
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)

    if not math.isfinite(args.shutdown_timeout) or args.shutdown_timeout < 0:
        await client.shutdown()
        raise ConfigError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    cache = {"block_size": str(cfg.block_size), "cache_dtype": "auto", "enable_prefix_caching":
             str(cfg.enable_prefix_caching), "gpu_memory_utilization": str(cfg.gpu_memory_utilization)}
    metrics = ServerMetrics(served, cfg.data_parallel_size, ready.max_model_len, args.metrics_prefix,
                            client.engine_blocks, cache, cfg.max_loras if cfg.enable_lora else None)
    state = ServerState(client, tokenizer, served, model, metrics, ready.max_model_len, ready.vocab_size,
                        ready.num_gpu_blocks, ready.block_size, cfg.max_num_waiting, args.api_key,
                        TokenTexts(tokenizer), cfg.policy, pooler_config=pooler,
                        structured_outputs_timeout=cfg.structured_outputs_timeout,
                        emulated=f"{args.gpu}, cost model {args.cost_model}" if args.emulate else None)
    client.on_stats = state.on_stats
    state.loras = LoRARegistry(cfg.enable_lora, cfg.max_lora_rank)
    try:
        for name, path, base in parse_lora_modules(args.lora_modules):
            state.loras.add(name, path, base)
    except (ValueError, APIError) as e:
        await client.shutdown()
        raise ConfigError(f"--lora-modules: {e.message if isinstance(e, APIError) else e}") from None
    app = build_app(state, args.max_request_bytes)
    what = (f"engine core pid {ready.pid}" if topology is None else
            f"{cfg.data_parallel_size} data-parallel replicas ({cfg.dp_policy}), coordinator pid {ready.pid}")
    _log(f"{what}: {ready.num_gpu_blocks} KV blocks of {ready.block_size}, max_model_len "
         f"{ready.max_model_len}; serving {served!r} on http://{args.host}:{args.port}")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log, lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S)
    freeze_startup_heap()  # FastAPI, the tokenizer, ...: alive for the process's life
    server = _server_class()(config)
    timeout = args.shutdown_timeout
    server.on_stop = lambda: loop.call_later(
        timeout, client.fail_all, f"the server is shutting down and its --shutdown-timeout ({timeout:g} s) expired",
        "server_shutting_down")

    died: list[str] = []

    def on_death(reason: str) -> None:
        died.append(reason)
        if args.keep_alive_on_engine_death:
            _log(f"engine core died ({reason}); answering 503 (--keep-alive-on-engine-death)")
        else:
            _log(f"engine core died ({reason}); exiting (--keep-alive-on-engine-death keeps the server up)")
            server.handle_exit(signal.SIGTERM, None)

    client.on_death = on_death
    try:
        await server.serve()
    finally:
        await client.shutdown()
    _log("stopped")
    return 0 if server.started and not (died and not args.keep_alive_on_engine_death) else 1
