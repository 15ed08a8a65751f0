"""Shared fixtures: for the engine tests a request factory, a token-fixed executor and a checked step loop;
for the server tests the openai and httpx clients of a module's server; a small local Ray cluster on 127.0.0.1."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Sequence

import pytest

from testbed.engine.config import EngineConfig
from testbed.engine.core import EngineCore
from testbed.engine.outputs import ModelRunnerOutput, EngineCoreOutput, SchedulerOutput
from testbed.engine.params import SamplingParams
from testbed.engine.request import Request, RequestStatus

REPO = Path(__file__).resolve().parents[1]
FIXED_TOKEN = 7


def make_request(rid: str, prompt_len: int = 8, max_tokens: int | None = 4, *, tokens: Sequence[int] | None = None,
                 arrival: float = 0.0, priority: int = 0, eos: int | None = None, ignore_eos: bool = True,
                 **sampling) -> Request:
    """A request whose prompt is `tokens`, or `prompt_len` ids derived from `rid` (distinct ids share no block)."""
    if tokens is None:
        base = zlib.crc32(rid.encode()) % 1_000_000
        tokens = [1000 + (base * 7919 + i) % 30_000 for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
    return Request(rid, list(tokens), sp, arrival_time=arrival, priority=priority, eos_token_id=eos)


class FixedTokenExecutor:
    """Samples `token` for every request that caught up with its tokens (-1 mid-prompt), like SimExecutor."""

    def __init__(self, token: int = FIXED_TOKEN) -> None:
        self.token = token

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput([self.token if r.num_computed_tokens >= r.num_tokens else -1 for r in so.requests])


class KVCheckingExecutor(FixedTokenExecutor):
    """A FixedTokenExecutor that keeps what a worker's KV cache would hold (the token id of every written slot, GPU
    and CPU pools), runs the step's block moves as a worker does (swap out, swap in, copy on write, in that order)
    and asserts that every scheduled request finds its earlier tokens in its blocks: it checks the block manager's
    swaps, copies and prefix-cache hits by content, not by counts."""

    def __init__(self, block_size: int, token: int = FIXED_TOKEN) -> None:
        super().__init__(token)
        self.bs = block_size
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for g, c in so.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu.get(g, [None] * self.bs))
        for c, g in so.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
        for src, dst in so.blocks_to_copy:
            self.gpu[dst] = list(self.gpu.get(src, [None] * self.bs))
        bs = self.bs
        for req, before, n, table in zip(so.requests, so.num_computed_before, so.num_new_tokens, so.block_ids):
            for p in range(before):
                want = req.token_id(p) if p < req.num_tokens else self.token
                got = self.gpu.get(table[p // bs], [None] * bs)[p % bs]
                assert got == want, f"{req}: position {p} holds {got} in block {table[p // bs]}, not {want}"
            for p in range(before, before + n):
                self.gpu.setdefault(table[p // bs], [None] * bs)[p % bs] = (
                    req.token_id(p) if p < req.num_tokens else self.token)
        return super().execute(so)


def make_engine(num_gpu_blocks: int = 64, max_model_len: int = 256, **config) -> EngineCore:
    return EngineCore(EngineConfig(**config), num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len)


def check_step(engine: EngineCore, so: SchedulerOutput) -> None:
    """The per-step invariants the scheduler promises (asserted right after schedule())."""
    cfg, bm = engine.config, engine.block_manager
    assert sum(so.num_new_tokens) == so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert so.num_reqs <= cfg.max_num_seqs and engine.scheduler.num_running <= cfg.max_num_seqs
    assert len({r.request_id for r in so.requests}) == so.num_reqs, "a request scheduled twice in one step"
    assert so.num_prefill_tokens + so.num_decode_tokens == so.total_num_scheduled_tokens
    assert so.sum_context_tokens == sum(b + n for b, n in zip(so.num_computed_before, so.num_new_tokens))
    assert so.sum_attn_pairs == sum(n * b + n * (n + 1) // 2 for b, n in zip(so.num_computed_before, so.num_new_tokens))
    assert so.max_context_tokens == max((b + n for b, n in zip(so.num_computed_before, so.num_new_tokens)), default=0)
    for req, n, before, table in zip(so.requests, so.num_new_tokens, so.num_computed_before, so.block_ids):
        assert before + n == req.num_computed_tokens <= req.num_tokens + req.num_pending
        assert 0 <= req.num_pending <= 2, f"{req}: more than the in-flight step's and this step's tokens pending"
        assert table is bm.req_blocks[req.request_id]
        assert len(table) * bm.block_size >= req.num_computed_tokens, f"{req} lacks blocks"
    bm.check_invariants()
    lora = engine.scheduler.lora
    if lora is not None:  # at most max_loras adapters run, each in the slot the step names
        ids = [r.lora_request.lora_int_id for r in so.requests if r.lora_request is not None]
        assert len(set(ids)) == so.num_loras <= cfg.max_loras and len(engine.scheduler.running_loras) <= cfg.max_loras
        assert so.num_lora_tokens == sum(n for r, n in zip(so.requests, so.num_new_tokens) if r.lora_request)
        for r, slot in zip(so.requests, so.lora_slots):
            assert slot == (-1 if r.lora_request is None else lora.slot_of[r.lora_request.lora_int_id])
        assert len(lora.host) <= cfg.max_cpu_loras and len(set(lora.slot_of.values())) == len(lora.slot_of)
        sched = engine.scheduler  # the stats' adapter counts match a recount of the queues
        queued = list(sched.waiting._dq) if sched.waiting.fcfs else [e[3] for e in sched.waiting._heap]
        running = [r for r in sched.running if r.status == RequestStatus.RUNNING]
        assert sched.lora_adapters() == tuple(
            dict(Counter(r.lora_request.lora_name for r in reqs if r.lora_request is not None))
            for reqs in (running, queued + list(sched.swapped)))


def run_engine(engine: EngineCore, arrivals: Sequence[tuple[int, Request]], executor=None, max_steps: int = 100_000,
               aborts: Sequence[tuple[int, str]] = ()) -> tuple[list[SchedulerOutput], dict[str, list[EngineCoreOutput]]]:
    """Add each (step, request) and abort each (step, id) before that step, run checked steps (time = step
    index, each step ends 1.0 later) until every request ended. A step with live requests must schedule.
    With `engine.config.async_scheduling` one step stays in flight: step N+1 is scheduled (and executed,
    as a device would start it) before step N is updated, as the real EngineStepper does."""
    executor = executor or FixedTokenExecutor()
    overlap = engine.config.async_scheduling
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    pending = sorted(arrivals, key=lambda a: a[0])
    abort_at: dict[int, list[str]] = {}
    for step, rid in aborts:
        abort_at.setdefault(step, []).append(rid)
    steps: list[SchedulerOutput] = []
    outs: dict[str, list[EngineCoreOutput]] = {}
    k = 0
    for step in range(max_steps):
        while k < len(pending) and pending[k][0] <= step:
            rejected = engine.add_request(pending[k][1], float(step))
            if rejected is not None:
                outs.setdefault(rejected.request_id, []).append(rejected)
            k += 1
        for rid in abort_at.get(step, ()):
            if (aborted := engine.abort(rid, float(step))) is not None:
                outs.setdefault(rid, []).append(aborted)
        if k == len(pending) and not engine.has_unfinished_requests() and in_flight is None:
            return steps, outs
        so = engine.schedule(float(step))
        check_step(engine, so)
        if so.is_empty and in_flight is None:
            assert not engine.has_unfinished_requests(), f"step {step}: nothing scheduled with live requests"
            continue
        launched = None
        if not so.is_empty:
            steps.append(so)
            launched = (so, executor.execute(so))
        if not overlap:
            in_flight, launched = launched, None
        if in_flight is not None:
            for o in engine.update(*in_flight, float(step + 1)):
                outs.setdefault(o.request_id, []).append(o)
        in_flight = launched
    raise AssertionError(f"not done after {max_steps} steps: {list(engine.requests.values())[:5]}")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny matmuls on a 2-core CI machine: one torch thread avoids OpenMP spin contention (10-40x faster)."""
    try:
        import torch
    except ImportError:  # a sim-only install
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- clients of a module's real server: a module that defines a `server` fixture (a ServerProcess) gets these
@pytest.fixture(scope="module")
def client(server):
    """The official openai client for the module's server (no retries: a failure shows at once)."""
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    """An httpx client for the module's server, with its API key."""
    import httpx
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as h:
        yield h


@pytest.fixture
def ray_cluster(tmp_path, monkeypatch):
    """A one-node Ray cluster on 127.0.0.1 (3 CPUs, no dashboard, a 100 MB object store), run by
    `ray start --block` in its own process group, which the test ends. It has its own auth token
    (RAY_AUTH_TOKEN, also for this test's processes): the default ~/.ray/auth_token is shared by every
    cluster of the user, and another one started meanwhile would replace it."""
    ray = shutil.which("ray", path=os.path.dirname(sys.executable))
    if ray is None:
        pytest.fail("the ray CLI is missing: install the 'ray' extra (pip install -e '.[ray]')")
    from server_helpers import free_port
    port, log = free_port(), tmp_path / "ray.log"
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    cmd = [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus",
           "3", "--num-gpus", "0", "--include-dashboard", "false", "--object-store-memory", str(100 << 20),
           "--temp-dir", temp, "--disable-usage-stats"]
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        deadline = time.monotonic() + 180
        while "block forever" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, f"ray did not start:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):  # its daemons share its process group
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(temp, ignore_errors=True)
