"""The engine-process runtime, vLLM V1's process boundaries: the engine-core process and its client, the wire
protocol (msgspec on ZMQ, every frame authenticated: frames.py), and data parallelism's coordinator and replica
processes with their launchers (this node, `--headless` nodes, Ray). Used by the HTTP server (testbed/server/)
and the offline LLM alike; it imports neither.

client.py (EngineClient, per-request queues in the caller's event loop) ==ZMQ (protocol.py)==> engine_proc.py
(EngineCore + executor loop). Data parallelism: dp_client.py (in place of client.py) ==> dp_coordinator.py
(DPCoordinator routes each request) ==> dp_engine_proc.py (one process per replica), messages in
dp_protocol.py; replicas start through dp_launch.py (this node, `--headless` nodes) or dp_ray.py (Ray).
"""


def freeze_startup_heap() -> None:
    """Move everything alive now out of the garbage collector's reach, in a process that lives for one
    engine or one API server (as vLLM's engine core does): a full collection triggered by a burst of new
    requests then scans only what came later, instead of pausing a step or every stream for 0.1-0.2 s.
    Not for in-process LLMs: a frozen model's reference cycles would never be collected once it is dropped."""
    import gc
    gc.collect()
    gc.freeze()


def config_arg(argv: list[str] | None, config_type: type, module: str):
    """The one CONFIG_JSON argument of a process started as `python -m testbed.runtime.MODULE CONFIG_JSON`,
    decoded as `config_type`; None, after a usage line on stderr, when the arguments are not that."""
    import sys

    import msgspec
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m testbed.runtime.{module} CONFIG_JSON (a process that `testbed serve` starts)",
              file=sys.stderr)
        return None
    return msgspec.json.decode(argv[0], type=config_type)


def run_process(proc, name: str, on_error=None) -> int:
    """`proc.run()` to its end, then `proc.close()`; the process's exit code: 0, a SystemExit's code, or 1
    when it raised, after the error and its traceback went to stderr and to `on_error(error, traceback)`."""
    import sys
    import traceback
    try:
        proc.run()
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        tb = traceback.format_exc()
        print(f"{name}: fatal error: {e!r}\n{tb}", file=sys.stderr, flush=True)
        if on_error is not None:
            on_error(e, tb)
        return 1
    finally:
        proc.close()
