"""The profiled cost model: a step's time from a measured profile (`testbed profile`), by interpolation.

A step's time is the real engine's cycle, schedule to next schedule, built from measured terms:

  engine    the EngineCore's schedule + update on the host: per batch size, plus per admitted prompt token
  decode    decode-only steps (the common case) are looked up whole in the decode table by batch size and
            mean context: host preparation, CUDA-graph forward (padding to the graph's batch included, since
            both edges of every graph bucket were measured), LM head + sampler, readback
  eager     any other step (one with a prefill chunk); its device time is
              linear(T tokens) + attention + LM head/sampler(sampled rows)
            where T is the size of the mixed CUDA graph the step is padded to (engine/capture_sizes.py: the
            simulated engine's capture sizes, by default those the profile records; above the largest, or for a
            profile that records none, the step's own tokens; the padding tokens' attention, over one another
            only, is left out)
            where attention = decode rows at their mean context (as an eager step runs them) + each chunk's
            attention at (new tokens, cached context) above the launch floor (from the attention modules'
            timings, or from the forward where those timed the host: attention_split.py); host preparation is linear in
            rows, tokens and block-table entries (fitted on the profile's eager steps)

  sync:   step = engine + host preparation + max(launch, device) + readback
  async:  step = max(device step, all host work), since the next step is prepared while this one runs
  grammar rows (structured outputs) add GRAMMAR_ROW_S of host work each, and a step with any runs as in
          sync mode: the worker reads the previous step's tokens back before it can fill their bitmasks
  a data-parallel replica (data_parallel_size > 1) adds the profile's `dp_replica_host` per step to the engine
          term: step_s + row_s x rows, the host work its own engine process does between two steps beyond the
          single engine's (publishing the step's outputs to the API server, its input poll, its stats reports);
          and request_s for each request a step with a prefill chunk schedules for the first time (or resumes
          after a preemption: the step's new_req_ids): its receipt from the coordinator and admission around
          that step;
          a profile without that section, or a single engine, charges nothing for it

`explain(so)` returns those terms for one step, so a reader can see which one dominates.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from testbed.engine.capture_sizes import padded_tokens
from testbed.engine.outputs import SchedulerOutput
from testbed.profiling.profile_file import FORMAT, ProfileError, read_profile
from testbed.sim import attention_split
from testbed.sim.cost_model import GRAMMAR_ROW_S, BlockMoveCost
from testbed.specs.hardware import get_gpu_spec
from testbed.sim.step_terms import DECODE_ASYNC, DECODE_SYNC, MIXED_ASYNC, MIXED_SYNC, Scales, combine
from testbed.sim.tables import LastLookup, RowPieces, Table1D, Table2D

ISSUE_BOUND_TOKENS = 1024  # eager steps this small take longer to issue than to run: their launch time is pure host


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| subject to x >= 0 (Lawson-Hanson active set). Scale columns beforehand."""
    m, n = A.shape
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(np.abs(A).sum(axis=0).max(), 1.0)
    for _ in range(3 * n + 10):
        w = A.T @ (b - A @ x)
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if s[passive].min() > tol:
                x = s
                break
            neg = passive & (s <= tol)
            step = x[neg] - s[neg]  # > 0 except in degenerate cases, where the variable just leaves
            x = x + np.min(np.where(step > 0, x[neg] / np.where(step > 0, step, 1.0), 0.0)) * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def fit_nonnegative(X: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least-squares coefficients of y on the columns of X (columns scaled for conditioning)."""
    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    scale = np.where(np.linalg.norm(A, axis=0) > 0, np.linalg.norm(A, axis=0), 1.0)
    return (nnls(A / scale, b) / scale).tolist()


def block_move_cost(profile: dict) -> BlockMoveCost | None:
    """The price of KV block moves on the profiled machine: block bytes from the profile's model, dtype, TP and
    block size; the host link's bandwidth as `testbed profile` measured it (its `host_device` section), else the
    GPU preset's estimate (the profile predates that measurement), and the preset's memory bandwidth for copies.
    None when the profile does not record its model's shape."""
    m, tp = profile["model"], int(profile["tensor_parallel_size"])
    if not all(m.get(k) for k in ("num_key_value_heads", "num_hidden_layers", "hidden_size", "num_attention_heads")):
        return None
    elem = 4 if profile.get("dtype") == "float32" else 2
    kv_heads = max(1, int(m["num_key_value_heads"]) // tp)
    head_dim = int(m.get("head_dim") or int(m["hidden_size"]) // int(m["num_attention_heads"]))
    block_bytes = int(profile["engine"]["block_size"]) * 2 * int(m["num_hidden_layers"]) * kv_heads * head_dim * elem
    try:
        gpu = get_gpu_spec(profile["gpu"])
        host, device = gpu.host_bandwidth, gpu.mem_bandwidth
    except ValueError:  # a machine without a preset (a CPU profile): the H100's estimates
        gpu = get_gpu_spec("H100-SXM")
        host, device = gpu.host_bandwidth, gpu.mem_bandwidth
    measured = profile.get("host_device") or {}
    return BlockMoveCost(block_bytes, measured.get("bandwidth") or host, measured.get("device_bandwidth") or device)


def dp_replica_host(profile: dict, name: str = "") -> tuple[float, float, float] | None:
    """(step_s, row_s, request_s) of the profile's `dp_replica_host` section (a data-parallel replica's extra host
    seconds per step, per row of the step, and per request the step schedules for the first time), or None when
    it has none. ProfileError for a malformed one."""
    d = profile.get("dp_replica_host")
    if d is None:
        return None
    try:
        step, row, request = float(d["step_s"]), float(d.get("row_s", 0.0)), float(d.get("request_s", 0.0))
    except (KeyError, TypeError, ValueError):
        raise ProfileError(f"{name or 'profile'}: its dp_replica_host section needs a number step_s (and may give "
                           f"row_s and request_s), got {d!r}; re-make it with `testbed profile --dp-replica-host` or "
                           "`testbed calibrate` of a data-parallel run") from None
    if not all(v >= 0.0 and math.isfinite(v) for v in (step, row, request)):
        raise ProfileError(f"{name or 'profile'}: dp_replica_host step_s {step!r}, row_s {row!r} and request_s "
                           f"{request!r} must be finite and >= 0")
    return step, row, request


class ProfiledCostModel:
    """A step's time from a profile (see the module docstring). `data_parallel_size` > 1: the model of one DP
    replica, which also pays the profile's dp_replica_host term per step (none at 1: a single engine)."""

    def __init__(self, profile: dict, async_scheduling: bool = False, enable_prefix_caching: bool = False,
                 name: str = "", data_parallel_size: int = 1, mixed_graph_sizes: list[int] | None = None) -> None:
        """`mixed_graph_sizes`: the simulated engine's mixed CUDA-graph sizes (engine/capture_sizes.split_sizes),
        which a step with a prefill chunk is padded to; None: those the profile records."""
        if profile.get("format") != FORMAT:
            raise ProfileError(f"{name or 'profile'}: not a testbed profile (format {profile.get('format')!r}); "
                               "make one with `testbed profile`")
        self.profile, self.async_scheduling, self.prefix_caching, self.name = (profile, async_scheduling,
                                                                              enable_prefix_caching, name)
        self.model_name = profile["model"]["name"]
        self.gpu_name = profile["gpu"]
        self.tensor_parallel_size = int(profile["tensor_parallel_size"])
        self.block_size = int(profile["engine"]["block_size"])
        d, ch, dr, eh = profile["decode"], profile["chunk"], profile["decode_rows"], profile["engine_host"]
        b, c = d["batch"], d["context"]
        self.dec_wall = Table2D(b, c, d["wall_s"])
        self.dec_async = Table2D(b, c, d["async_cycle_s"]) if any(
            v is not None for row in d["async_cycle_s"] for v in row) else None
        self.dec_host = Table2D(b, c, [[None if p is None else p + l + o for p, l, o in zip(*t)]
                                       for t in zip(d["prepare_s"], d["launch_s"], d["output_s"])])
        self.sample = Table1D(b, [statistics.median(v for v in row if v is not None) for row in d["sample_s"]])
        self.output = Table1D(b, [statistics.median(v for v in row if v is not None) for row in d["output_s"]])
        # attention: a chunk of n tokens after ctx cached ones; decode rows inside an eager step
        if not any(v for row in ch["attention_s"] for v in row if v is not None):
            raise ProfileError(f"{name or 'profile'}: it measured no time in attention (made while graphed steps "
                               "hid the attention modules from the profiler); re-make it with `testbed profile`")
        self.attention_source = "module timings"
        if attention_split.implausible(ch, dr):  # they timed the host's issue: the forward says how much it is
            chunk_attn, rows_attn = attention_split.from_forward(ch, dr)
            ch, dr = {**ch, "attention_s": chunk_attn}, {**dr, "attention_s": rows_attn}
            self.attention_source = "the forward (the module timings exceed what the device spends)"
        self.chunk_attn = Table2D(ch["tokens"], ch["context"], ch["attention_s"])
        self.rows_attn = Table2D(dr["batch"], dr["context"], dr["attention_s"])
        self.row_chunk = int(dr["chunk"])
        self.attn_floor = self.chunk_attn(self.row_chunk, 0)
        # the mixed graphs the profiled engine padded a step with a prefill chunk to (a profile that records none:
        # made with --enforce-eager, or before they were recorded, when such steps ran eager), and in this model
        measured = sorted(profile.get("mixed_graph_sizes") or [])
        self.mixed_sizes = [] if not measured else measured if mixed_graph_sizes is None else sorted(mixed_graph_sizes)
        # linear part of an eager forward, by the tokens it computed (padded): forward - attention over every
        # measurement with a chunk
        lin: dict[int, list[float]] = {}
        host_X, host_y, launch, eps = [], [], [], []
        for kind, tab in (("chunk", ch), ("rows", dr)):
            axis0 = tab["tokens"] if kind == "chunk" else tab["batch"]
            for i, a in enumerate(axis0):
                for j, ctx in enumerate(tab["context"]):
                    fwd = tab["forward_s"][i][j]
                    if fwd is None:
                        continue
                    if kind == "chunk":
                        T, rows, blocks = a, 1, -(-(a + ctx) // self.block_size)
                    else:
                        T, rows = a + self.row_chunk, a + 1
                        blocks = a * -(-(ctx + 1) // self.block_size) + -(-self.row_chunk // self.block_size)
                    lin.setdefault(padded_tokens(measured, T), []).append(max(0.0, fwd - tab["attention_s"][i][j]))
                    host_X.append([1.0, rows, T, blocks])
                    host_y.append(tab["prepare_s"][i][j])
                    if T <= ISSUE_BOUND_TOKENS:
                        launch.append(tab["launch_s"][i][j])
                    gpu = fwd + tab["sample_s"][i][j]
                    eps.append(tab["wall_s"][i][j] - tab["prepare_s"][i][j] - max(tab["launch_s"][i][j], gpu)
                               - tab["output_s"][i][j])
        if not lin:
            raise ProfileError(f"{name or 'profile'}: no eager step was measured")
        self.linear = Table1D(sorted(lin), [statistics.median(lin[t]) for t in sorted(lin)])
        # uneven contexts: the extra time when one row's context exceeds the mean by delta (0 at delta 0)
        self.dec_tail = self.dec_tail_async = self.rows_tail = None
        if "decode_tail" in profile:
            t = profile["decode_tail"]
            base = t["base"]
            for attr, key, table in (("dec_tail", "wall_s", self.dec_wall), ("dec_tail_async", "async_cycle_s",
                                                                              self.dec_async)):
                if table is None or all(v is None for row in t[key] for v in row):
                    continue
                extra = [[0.0] + [None if w is None else max(0.0, w - table(bb, base + dd / bb))
                                  for dd, w in zip(t["delta"], row)] for bb, row in zip(t["batch"], t[key])]
                setattr(self, attr, LastLookup(Table2D(t["batch"], [0] + t["delta"], extra)))
        if "rows_tail" in profile:
            t = profile["rows_tail"]
            extra = [[0.0] + [None if u is None or e is None else max(0.0, u - e) for u, e in zip(ur, er)]
                     for ur, er in zip(t["attention_s"], t["even_attention_s"])]
            self.rows_tail = Table2D(t["batch"], [0] + t["delta"], extra)
        self.prep_coef = fit_nonnegative(host_X, host_y)
        self.eager_launch = statistics.fmean(launch)
        self.sync_gap = max(0.0, statistics.median(eps))
        # engine host work: per decode batch size, and per admitted prompt token
        self.engine_step = LastLookup(Table1D(eh["decode_batch"], eh["decode_step_s"]))
        base = self.engine_step(1)  # an admission step schedules and updates one request
        self.admit = {k: Table1D(eh["admit_tokens"], [max(0.0, v - base) for v in vals])
                      for k, vals in eh["admit_step_s"].items()}
        self.graph_max = max(b)
        self.moves = block_move_cost(profile)
        self.data_parallel_size = int(data_parallel_size)
        self.dp_host = dp_replica_host(profile, name) if self.data_parallel_size > 1 else None
        try:  # per-component scales of a rescaled or calibrated profile (rescale.py); 1 for a measured one
            self.scales = Scales.from_dict(profile.get("scales"))
        except ValueError as e:
            raise ProfileError(f"{name or 'profile'}: {e}") from None

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, async_scheduling: bool = False, enable_prefix_caching: bool = False,
                  data_parallel_size: int = 1, mixed_graph_sizes: list[int] | None = None) -> "ProfiledCostModel":
        p = Path(path)
        data = read_profile(p)
        try:
            return cls(data, async_scheduling, enable_prefix_caching, str(p), data_parallel_size, mixed_graph_sizes)
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, statistics.StatisticsError) as e:
            raise ProfileError(f"{p}: malformed profile ({type(e).__name__}: {e}); re-make it with `testbed profile`") from None

    # ---- the model -----------------------------------------------------------------------------
    def _engine(self, b: int, prefill_tokens: int) -> float:
        t = self.engine_step(b)
        if prefill_tokens:
            t += self.admit["prefix_caching" if self.prefix_caching else "plain"](prefill_tokens)
        return t

    def _engine_term(self, b: int, prefill_tokens: int) -> float:
        """The engine term a step of b rows pays: _engine's, and on it a DP replica's dp_replica_host term."""
        t = self._engine(b, prefill_tokens)
        if self.dp_host is not None:
            t += self.dp_step(b)
        return t

    def dp_step(self, b: int) -> float:
        """A DP replica's extra host seconds in a step of b rows (0.0 for a single engine or without the term)."""
        if self.dp_host is None:
            return 0.0
        step, row, _ = self.dp_host
        return step + row * b

    def dp_admit(self, so: SchedulerOutput) -> float:
        """A DP replica's host seconds for the requests `so` schedules for the first time or resumes (its
        new_req_ids; 0.0 for a single engine, without the term, or for a step that has none). `terms` charges it to
        steps with a prefill chunk, where a request's first step falls."""
        if self.dp_host is None or not self.dp_host[2] or not so.new_req_ids:
            return 0.0
        return self.dp_host[2] * len(so.new_req_ids)

    def _eager_terms(self, so: SchedulerOutput) -> tuple[float, float, float, float, float]:
        """(linear, attention, sampler, host preparation, sampled rows) of a step with a prefill chunk."""
        reqs, nnew, before = so.requests, so.num_new_tokens, so.num_computed_before
        B, T = len(reqs), so.total_num_scheduled_tokens
        attn = 0.0
        chunk_ctx = chunks = sampled = longest_row = 0
        for i, n in enumerate(nnew):
            c = before[i]
            if n > 1:
                attn += self.chunk_attn(n, c) - self.attn_floor
                chunk_ctx += c + n
                chunks += 1
                if c + n >= reqs[i].num_tokens:
                    sampled += 1
            elif c > longest_row:
                longest_row = c
        rows = B - chunks
        if rows:
            mean = (so.sum_context_tokens - chunk_ctx) / rows - 1.0
            attn += self.rows_attn(rows, mean)
            if self.rows_tail is not None and longest_row > mean:
                attn += self.rows_tail(rows, longest_row - mean)
        else:
            attn += self.attn_floor
        sampled += rows
        a, per_row, per_token, per_block = self.prep_coef
        prep = a + per_row * B + per_token * T + per_block * (so.sum_context_tokens / self.block_size + 0.5 * B)
        return self.linear(padded_tokens(self.mixed_sizes, T)), attn, self.sample(sampled) if sampled else 0.0, prep, \
            sampled

    def step_time(self, so: SchedulerOutput, engine: float | None = None) -> float:
        """The step's time; `engine` overrides the engine's host term (validation against executor-only times).
        KV block moves (swap, copy on write) add their time at the profile's measured host link."""
        t = combine(*self.terms(so, engine), self.scales) if so.requests else 0.0
        if so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy:
            if self.moves is None:
                raise ProfileError(f"{self.name or 'profile'}: it records no model shape (num_key_value_heads, ...), "
                                   "so the KV blocks a step swaps or copies cannot be priced; re-make it with "
                                   "`testbed profile`")
            t += self.moves.time(so)
        return t

    def decode_steps(self, B: int, num_structured: int) -> Callable[[int, int], Iterator[float]] | None:
        """step_time of successive decode-only steps of B rows (`num_structured` of them under a grammar), no
        block moves: from the first one's (sum_context_tokens, max_context_tokens), each next step with B more
        context tokens and its longest row one more (a stretch of decodes); given the first one's `start`, the
        ends of the steps instead, each starting where the one before ended (as environment.landing places
        them in simulated time). The same floats bit for bit, with
        the batch's lookups done once and a table's piece looked up again only when the context leaves it. None
        where step_time takes another path (B past the decode table, async decode cycles) or a table has one
        column."""
        grammar = GRAMMAR_ROW_S * num_structured
        if B > self.graph_max or (self.async_scheduling and not grammar and self.dec_async is not None):
            return None
        tables = [self.dec_wall, self.dec_host] + ([self.dec_tail.table] if self.dec_tail else [])
        if any(len(t.cols) < 2 for t in tables):
            return None
        s = self.scales
        h, sd = s.host, s.decode
        he, hg = h * self._engine_term(B, 0), h * grammar
        hosted = h != sd  # else combine reads no runner-host term
        wall, host = RowPieces(self.dec_wall, B), RowPieces(self.dec_host, B)
        tail = RowPieces(self.dec_tail.table, B) if self.dec_tail else None
        inf = math.inf

        def steps(sum_ctx: int, max_ctx: int, start: float | None = None) -> Iterator[float]:
            # per step: terms(so)'s DECODE_SYNC tuple, then step_terms.combine, inlined (tests hold them equal);
            # a term is y0 + dy * (x - x0) / dx floored at 0, as Table2D's lookup computes it
            wl = hl = tl = inf
            wh = hh = th = -inf
            while True:
                ctx = sum_ctx / B - 1.0
                if not wl < ctx <= wh:
                    wl, wh, wy, wdy, wx, wdx = wall.piece(ctx)
                w = wy + wdy * (ctx - wx) / wdx
                if not w > 0.0:
                    w = 0.0
                if hosted:
                    if not hl < ctx <= hh:
                        hl, hh, hy, hdy, hx, hdx = host.piece(ctx)
                    r = hy + hdy * (ctx - hx) / hdx
                    if not r > 0.0:
                        r = 0.0
                    dec = h * r + sd * (w - r)
                else:
                    dec = h * w
                x = 0.0
                if tail is not None:
                    x = max_ctx - 1.0 - ctx
                    if not tl < x <= th:
                        tl, th, ty, tdy, tx, tdx = tail.piece(x)
                    x = ty + tdy * (x - tx) / tdx
                    if not x > 0.0:
                        x = 0.0
                if start is None:
                    yield he + dec + sd * x + hg
                else:  # where a step of that duration ends in simulated time (environment.landing)
                    end = start + (he + dec + sd * x + hg)
                    start = start + (end - start)
                    yield start
                sum_ctx += B
                max_ctx += 1
        return steps

    def terms(self, so: SchedulerOutput, engine: float | None = None) -> tuple[int, tuple]:
        """(kind, measured terms) of a non-empty step, as step_terms.combine takes them."""
        B = len(so.requests)
        grammar = GRAMMAR_ROW_S * so.num_structured_reqs
        overlap = self.async_scheduling and not grammar
        if so.num_decode_tokens == B and B <= self.graph_max:
            ctx = so.sum_context_tokens / B - 1.0  # tokens cached before the new one, as the table is indexed
            skew = so.max_context_tokens - 1.0 - ctx  # how far the longest row is past the mean
            eng = self._engine_term(B, 0) if engine is None else engine
            if overlap and self.dec_async is not None:
                cycle = self.dec_async(B, ctx) + (self.dec_tail_async(B, skew) if self.dec_tail_async else 0.0)
                return DECODE_ASYNC, (eng, cycle, self.dec_host(B, ctx))
            return DECODE_SYNC, (eng, self.dec_wall(B, ctx), self.dec_host(B, ctx),
                                 self.dec_tail(B, skew) if self.dec_tail else 0.0, grammar)
        lin, attn, samp, prep, sampled = self._eager_terms(so)
        eng = self._engine_term(B, so.num_prefill_tokens) + self.dp_admit(so) if engine is None else engine
        out = self.output(sampled) if sampled else 0.0
        return (MIXED_ASYNC if overlap else MIXED_SYNC), (eng, prep, grammar, self.eager_launch, lin, attn, samp,
                                                           out, self.sync_gap)

    def pipeline_split(self, so: SchedulerOutput) -> tuple[float, float, float]:
        """(host, decoder layers, LM head) of step_time(so), which they sum to (sync steps: pipeline parallelism
        excludes async scheduling): what a pipeline stage's share is cut from (sim/pipeline.py). Host: the
        engine, input preparation, readback; LM head: the measured LM head + sampler of the step's sampled rows
        (in a decode step, of its batch); layers: the rest of the device time (the forward's linear layers and
        attention, or the host time to launch an eager step's layers when that is longer)."""
        if not so.requests:
            return 0.0, 0.0, 0.0
        kind, t = self.terms(so)
        s = self.scales
        if kind == DECODE_SYNC:
            eng, wall, runner_host, tail, grammar = t
            host, device = s.host * (eng + runner_host + grammar), s.decode * (wall - runner_host + tail)
            head = min(device, s.decode * self.sample(len(so.requests)))
        elif kind == MIXED_SYNC:
            eng, prep, grammar, launch, lin, attn, samp, out, gap = t
            host = s.host * (eng + prep + grammar + out + gap)
            device = max(s.host * launch, s.gemm * lin + s.attention * attn + s.gemm * samp)
            head = min(device, s.gemm * samp)
        else:
            raise ValueError("pipeline parallelism runs without async scheduling: build the profile's cost model "
                             "with async_scheduling=False")
        return host, device - head, head

    def explain(self, so: SchedulerOutput) -> dict[str, float | str]:
        """The terms of one step's predicted time (seconds), and which dominates."""
        B = len(so.requests)
        if B == 0:
            return {"kind": "empty", "total": 0.0}
        if so.num_decode_tokens == B and B <= self.graph_max:
            ctx = so.sum_context_tokens / B - 1.0
            skew = so.max_context_tokens - 1.0 - ctx
            terms = {"kind": "decode", "engine": self.engine_step(B), "step (table)": self.dec_wall(B, ctx),
                     "uneven contexts": self.dec_tail(B, skew) if self.dec_tail else 0.0,
                     "runner host (table)": self.dec_host(B, ctx)}
            if self.dec_async is not None:
                terms["async cycle (table)"] = self.dec_async(B, ctx)
        else:
            lin, attn, samp, prep, sampled = self._eager_terms(so)
            terms = {"kind": "eager", "engine": self._engine(B, so.num_prefill_tokens), "host preparation": prep,
                     "launch": self.eager_launch, "linear layers": lin, "attention": attn, "lm head + sampler": samp,
                     "readback": self.output(sampled) if sampled else 0.0, "sync gap": self.sync_gap}
        if so.num_structured_reqs:
            terms["grammar bitmasks"] = GRAMMAR_ROW_S * so.num_structured_reqs
        if self.dp_host is not None:
            terms["dp replica host"] = self.dp_step(B) + self.dp_admit(so)
        terms["total"] = self.step_time(so)
        return terms

    def validate(self) -> dict[str, float]:
        """Errors of this model on the profile's held-out mixed steps, which were measured whole on the
        executor alone (so the engine's host term is left out): MAPE and the worst error, sync and async."""
        from testbed.profiling.synthetic_steps import StepFactory
        f = StepFactory(1 << 30, self.block_size, 32000)
        steps = [(f.step([tuple(r) for r in v["rows"]]), v) for v in self.profile.get("validation", [])]
        out: dict[str, float] = {}
        mode = self.async_scheduling
        try:
            for async_, key in ((False, "wall_s"), (True, "async_cycle_s")):
                self.async_scheduling = async_
                errs = [(self.step_time(so, 0.0) - v[key]) / v[key] for so, v in steps if v.get(key)]
                if errs:
                    name = "async" if async_ else "sync"
                    out[f"{name}_mape"] = float(np.mean(np.abs(errs)))
                    out[f"{name}_worst"] = float(max(errs, key=abs))
                    out[f"{name}_steps"] = len(errs)
        finally:
            self.async_scheduling = mode
        return out

    def to_json(self) -> dict:
        out = {"kind": "profile", "path": self.name, "model": self.model_name, "gpu": self.gpu_name,
               "tensor_parallel_size": self.tensor_parallel_size, "async_scheduling": self.async_scheduling}
        if self.dp_host is not None:
            out["dp_replica_host"] = {"step_s": self.dp_host[0], "row_s": self.dp_host[1],
                                      **({"request_s": self.dp_host[2]} if self.dp_host[2] else {})}
        return out

    def __repr__(self) -> str:
        return f"ProfiledCostModel({self.model_name}, gpu={self.gpu_name}, tp={self.tensor_parallel_size}, {self.name})"
