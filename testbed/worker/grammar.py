"""Structured outputs through xgrammar (vLLM V1's default backend): compile a request's constraint once,
keep one matcher per request, and mask each step's logits with the matcher's token bitmask.

The bitmask is packed 32 tokens to an int32 (bit set = allowed), filled on the host by xgrammar for the
rows that carry a grammar, copied to the logits' device in one transfer and unpacked there with tensor
ops: the same batched path on GPU and CPU. A matcher advances lazily: before each fill it accepts the
request's tokens it has not seen yet (the caller passes every token sampled so far). Once it accepted
the end of its grammar (a stop token), its row is no longer constrained, as in vLLM (ignore_eos goes on
freely). The constraint's translation into xgrammar, and the front-ends' torch-free check of it, are in
grammar_compile.py.

Compiling against the tokenizer (seconds for a schema of a thousand optional properties) runs on threads
of the worker that samples (rank 0), as in vLLM V1's pool: the engine's driver `submit`s a request's grammar
when it is queued and `poll`s for finished compiles (EngineStepper), so no step waits for one; the time
bound counts from when a request's compile begins (`compiling_for`), not its wait for a thread or for the
one-time setup of the tokenizer's vocabulary. A request forgotten mid-compile (past the bound, or aborted)
leaves its compile to finish on its thread, since xgrammar cannot stop one, and frees its place: the next
grammar starts at once instead of waiting out a 3,000-property schema's 20 s (up to MAX_ABANDONED such
threads run at once; beyond, new compiles wait). xgrammar releases the GIL while it compiles, so the step
loop goes on meanwhile. A request whose grammar was never submitted (a caller driving the model runner
directly) compiles it at its first bitmask.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from testbed.engine.params import StructuredOutputsParams
from testbed.worker.grammar_compile import compile_constraint, xgrammar

MAX_ABANDONED = 2  # compiles whose request was forgotten (past --structured-outputs-timeout) still running at once


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, ceil(V / 32)] (bit j of word w = token 32 w + j allowed) -> bool [n, V], on packed's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()


class _State:
    __slots__ = ("matcher", "accepted")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.accepted = 0  # output tokens the matcher has consumed


class GrammarStates:
    """Per-request xgrammar matchers of one worker. Grammars compile on this object's thread pool (`submit`,
    then `poll`), or at a request's first bitmask when it was not submitted; a matcher is made at the first
    bitmask. Invariant: a request id is in at most one of compiling, compiled and states."""

    def __init__(self, load_tokenizer: Callable[[], Any], threads: int | None = None) -> None:
        self.load_tokenizer = load_tokenizer
        self.states: dict[str, _State] = {}
        self.compiling: dict[str, Future] = {}
        self.started: dict[str, float] = {}  # request id -> when its compile began (time.monotonic), while compiling
        self.compiled: dict[str, Any] = {}  # request id -> CompiledGrammar, until its first bitmask
        self._threads = threads or max(1, (os.cpu_count() or 2) // 2)
        # compiles waiting for a thread; the number of threads compiling for a live request (at most _threads) and
        # of those whose request was forgotten mid-compile (abandoned: xgrammar cannot be stopped, so the thread
        # finishes and drops the result, no longer holding a place: at most MAX_ABANDONED at once)
        self._queue: deque[tuple[str, Future, tuple]] = deque()
        self._running: dict[Future, str] = {}
        self._abandoned: set[Future] = set()
        self._slots = threading.Lock()  # guards the four above
        self._lock = threading.Lock()  # one compiler (its tokenizer info) shared by the compiling threads
        self._xgr = None
        self._compiler = None
        self._vocab = 0

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            self.compiled.pop(rid, None)
            self.started.pop(rid, None)
            f = self.compiling.pop(rid, None)
            if f is not None and not f.cancel():  # running: it finishes on its thread, its result dropped
                with self._slots:
                    if f in self._running:
                        del self._running[f]
                        self._abandoned.add(f)
                    self._dispatch()

    def submit(self, request_id: str, so: StructuredOutputsParams, vocab_size: int, eos_token_id: int | None) -> None:
        """Start compiling a request's grammar on a thread of its own, once fewer than `threads` compile for live
        requests and fewer than MAX_ABANDONED for forgotten ones; `poll` reports it once done."""
        f: Future = Future()
        self.compiling[request_id] = f
        with self._slots:
            self._queue.append((request_id, f, (so, vocab_size, eos_token_id, request_id)))
            self._dispatch()

    def _dispatch(self) -> None:
        """Start queued compiles while there is room (the caller holds _slots)."""
        while self._queue and len(self._running) < self._threads and len(self._abandoned) < MAX_ABANDONED:
            rid, f, args = self._queue.popleft()
            if not f.set_running_or_notify_cancel():
                continue  # forgotten while it waited
            self._running[f] = rid
            threading.Thread(target=self._run, args=(f, args), name="grammar-compile", daemon=True).start()

    def _run(self, f: Future, args: tuple) -> None:
        try:
            f.set_result(self._compile(*args))
        except BaseException as e:  # noqa: BLE001 - reported by poll (InvalidParam) or raised by result()
            f.set_exception(e)
        finally:
            with self._slots:
                if self._running.pop(f, None) is None:
                    self._abandoned.discard(f)
                    self.started.pop(args[-1], None)
                self._dispatch()

    def compiling_for(self, request_id: str) -> float:
        """Seconds the request's grammar has been compiling (0 while it waits for a thread or for the one-time
        tokenizer setup): what --structured-outputs-timeout bounds."""
        t = self.started.get(request_id)
        return 0.0 if t is None else time.monotonic() - t

    def poll(self) -> list[tuple[str, str | None]]:
        """Requests whose compile finished since the last poll: (request id, None when it compiled, else why
        not: the InvalidParam text naming structured_outputs.<kind>)."""
        done = [rid for rid, f in self.compiling.items() if f.done()]
        out: list[tuple[str, str | None]] = []
        for rid in done:
            f = self.compiling.pop(rid)
            self.started.pop(rid, None)
            e = f.exception()
            if e is None:
                self.compiled[rid] = f.result()
                out.append((rid, None))
            else:
                out.append((rid, str(e)))
        return out

    def shutdown(self) -> None:
        """Cancel the compiles still waiting; running ones end on their (daemon) threads."""
        with self._slots:
            for _, f, _ in self._queue:
                f.cancel()
            self._queue.clear()

    def _compile(self, so: StructuredOutputsParams, vocab_size: int, eos_token_id: int | None,
                 request_id: str | None = None):
        """The CompiledGrammar of a constraint (InvalidParam when it does not compile)."""
        with self._lock:
            if self._compiler is None or self._vocab != vocab_size:
                xgr = self._xgr = xgrammar()
                stop = [eos_token_id] if eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(self.load_tokenizer(), vocab_size=vocab_size,
                                                          stop_token_ids=stop)
                self._compiler, self._vocab = xgr.GrammarCompiler(info), vocab_size
            compiler = self._compiler
        if request_id is not None:
            self.started[request_id] = time.monotonic()
        return compile_constraint(so, compiler)

    def _matcher(self, rid: str, so: StructuredOutputsParams, vocab_size: int, eos_token_id: int | None):
        compiled = self.compiled.pop(rid, None)
        if compiled is None:
            f = self.compiling.pop(rid, None)
            compiled = f.result() if f is not None else self._compile(so, vocab_size, eos_token_id)
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self, request_ids: Sequence[str], params: Sequence, outputs: Sequence[Sequence[int]],
                eos_token_ids: Sequence[int | None], vocab_size: int, pin: bool = False) -> torch.Tensor:
        """Host int32 bitmask [len(request_ids), ceil(vocab / 32)] of the next token of each request, after
        advancing its matcher over `outputs` (every token it sampled so far). Rows whose grammar has ended
        allow everything."""
        words = -(-vocab_size // 32)
        mask = torch.full((len(request_ids), words), -1, dtype=torch.int32, pin_memory=pin)
        for k, (rid, p, out, eos) in enumerate(zip(request_ids, params, outputs, eos_token_ids)):
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = _State(self._matcher(rid, p.structured_outputs, vocab_size, eos))
            m = st.matcher
            for t in out[st.accepted:]:
                if m.is_terminated():
                    break
                if not m.accept_token(int(t)):
                    raise RuntimeError(f"request {rid!r}: the grammar refused token {int(t)}, which its own mask "
                                       "allowed (xgrammar matcher out of step with the output)")
            st.accepted = len(out)
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, k)
        return mask
