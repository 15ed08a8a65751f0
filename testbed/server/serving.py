"""The generation machinery shared by /v1/completions and /v1/chat/completions (and /v1/embeddings).

A GenerationRun holds the choices of one HTTP request (prompts x n): one core request each (with
`use_beam_search`, one beam-search request per prompt, whose n best beams fill its n choices when it ends), all
routed to one output stream, each with its own detokenizer (its SamplingParams come from params.py). Given
PoolingParams instead, each prompt is one prompt-only core request whose choice ends with its embedding. It
checks the prompts' lengths, admits (or refuses with 503) as a whole, applies outputs (stop strings abort the core request),
observes the latency metrics, and aborts whatever is unfinished when it is closed early.
Invariant: every choice finishes exactly once, with one finish_reason.
"""
from __future__ import annotations

import copy
import time
from typing import Any

from testbed.engine.lora import LoRARequest
from testbed.engine.outputs import NO_TOKEN_LEFT
from testbed.engine.params import BeamSearchParams, PoolingParams, SamplingParams, child_seed
from testbed.runtime.client import EngineDeadError, RequestStream
from testbed.text.detokenizer import IncrementalDetokenizer
from testbed.server.metrics import FinishedRequest
from testbed.server.schemas import APIError, bad_request
from testbed.server.state import ServerState

LOGPROB_FLOOR = -9999.0  # -inf is not JSON
MAX_CHOICES = 1024  # prompts x n of one HTTP request (each is a core request with its own detokenizer)


def check_choice_count(num_prompts: int, n: int | None) -> None:
    """A 400 when one request asks for more than MAX_CHOICES sequences: prompts x n (n None: pooling inputs, one
    sequence each). Checked again before the prompts are tokenized, so a request of a million prompts is refused at
    once rather than after tokenizing them all."""
    if num_prompts * (n or 1) > MAX_CHOICES:
        what = "inputs" if n is None else f"prompts x n={n} asks for {num_prompts * n} sequences"
        raise bad_request(f"{num_prompts} {what}; this server takes at most {MAX_CHOICES} per request: split it",
                          "input" if n is None else "n")


def floor_logprob(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR)


def prompt_logprobs_json(run: GenerationRun, prompt: list[int], entries: list | None, width: int) -> list | None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}} with
    the prompt token and the `width` most likely ones."""
    if entries is None:
        return None
    out: list = [None]
    for tid, (lp, rank, top) in zip(prompt[1:], entries):
        d = {str(t): {"logprob": floor_logprob(v), "rank": r, "decoded_token": run.token_text(t)}
             for r, (t, v) in enumerate(top[:width], 1)}
        d.setdefault(str(tid), {"logprob": floor_logprob(lp), "rank": rank, "decoded_token": run.token_text(tid)})
        out.append(d)
    return out


class Choice:
    """One generated sequence and what its latest output added."""

    def __init__(self, index: int, request_id: str, prompt_index: int, detok: IncrementalDetokenizer) -> None:
        self.index, self.request_id, self.prompt_index, self.detok = index, request_id, prompt_index, detok
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = None  # logprobs of prompt tokens 1.. (with the first output)
        self.embedding: list[float] | None = None  # a pooling request's result
        self.num_generated = 0  # tokens the engine sampled (stop strings may keep fewer in the text)
        self.scheduled_time: float | None = None  # the engine's first scheduling (ServerState.on_stats)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.delta_text = ""
        self.delta_ids: list[int] = []
        self.delta_logprobs: list = []
        self.engine_metrics = None  # the serving replica's EngineMetrics, once an output named the replica

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class GenerationRun:
    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]],
                 sp: SamplingParams | PoolingParams, priority: int = 0, lora: LoRARequest | None = None,
                 beam: BeamSearchParams | None = None) -> None:
        """`lora`: the adapter every choice runs with (None: the base model); `beam`: a beam search per prompt."""
        self.beam = beam
        self.beam_ids = {f"{request_id}-beam{pi}": pi for pi in range(len(prompts))} if beam is not None else {}
        self.state, self.request_id, self.prompts, self.sp = state, request_id, prompts, sp
        self.priority = priority
        self.lora = lora
        self.model = state.served_model_name if lora is None else lora.lora_name  # what responses name
        self.arrival = time.time()
        self.pooling = isinstance(sp, PoolingParams)
        self.n = 1 if self.pooling else sp.n
        if not self.pooling and sp.stop and state.tokenizer is None:
            raise bad_request("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
        check_choice_count(len(prompts), None if self.pooling else self.n)
        for p in prompts:
            self._check_length(p, 0 if self.pooling else sp.max_tokens)
        self.choices: list[Choice] = []
        for pi, prompt in enumerate(prompts):
            for i in range(self.n):
                idx = pi * self.n + i
                detok = (IncrementalDetokenizer(None, prompt) if self.pooling else
                         IncrementalDetokenizer(state.tokenizer, prompt, sp.stop, sp.include_stop_str_in_output,
                                                sp.skip_special_tokens, sp.spaces_between_special_tokens))
                self.choices.append(Choice(idx, f"{request_id}-{idx}", pi, detok))
        self.by_id = {c.request_id: c for c in self.choices}
        self.stream = RequestStream(request_id)
        self.num_unfinished = len(self.choices)
        self.unfinished_per_prompt = [self.n] * len(prompts)

    def _check_length(self, prompt: list[int], max_tokens: int | None) -> None:
        """max_tokens 0: a prompt-only (pooling) request, which may fill max_model_len."""
        st, n = self.state, len(prompt)
        param = "input" if self.pooling else "prompt"
        if n == 0:
            raise bad_request(f"the {param} is empty; give at least one token", param)
        if max_tokens == 0 and n > st.max_model_len:
            raise bad_request(f"This model's maximum context length is {st.max_model_len} tokens, but the input has "
                              f"{n} tokens; shorten it", param)
        if max_tokens is None and n >= st.max_model_len:
            raise bad_request(f"This model's maximum context length is {st.max_model_len} tokens, but the prompt has "
                              f"{n} tokens; shorten it", "messages")
        if max_tokens and n + max_tokens > st.max_model_len:
            raise bad_request(f"This model's maximum context length is {st.max_model_len} tokens. However, you "
                              f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
                              "completion). Please reduce the prompt or max_tokens.", "max_tokens")
        total = st.max_model_len if max_tokens is None else min(n + max_tokens, st.max_model_len)
        blocks = -(-total // st.block_size)
        if blocks > st.num_gpu_blocks:
            raise bad_request(f"the request needs {blocks} KV-cache blocks but the server has {st.num_gpu_blocks}; "
                              "shorten it", param if self.pooling else "max_tokens")

    def start(self) -> None:
        """Admit every choice or none: 503 when the engine is dead or the waiting bound is reached. A
        failure part way (the engine died) aborts the choices already sent, so none runs orphaned and
        no waiting slot or live entry is left behind."""
        st, client = self.state, self.state.client
        if client.is_dead:
            raise APIError(503, f"engine core is dead: {client.dead_reason}", None, "engine_dead")
        bound = st.max_num_waiting
        if bound is not None and client.num_waiting_estimate + len(self.choices) > bound:
            raise APIError(503, f"too many waiting requests (bound {bound}, --max-num-waiting); retry later",
                           None, "waiting_queue_full")
        sent: list[str] = []
        try:
            for rid, pi in self.beam_ids.items():
                st.client.add(rid, self.prompts[pi], self.arrival, stream=self.stream,
                              sampling_params=self.beam.sampling_params(), beam_params=self.beam,
                              priority=self.priority, lora_request=self.lora)
                sent.append(rid)
            for c in (self.choices if self.beam is None else ()):
                self._add(c)
                sent.append(c.request_id)
                st.live[c.request_id] = c
        except BaseException as e:
            client.abort(sent)
            self._fail_all()
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), None, e.code) from None
            raise

    def _add(self, c: Choice) -> None:
        sp = self.sp
        if self.pooling:
            self.state.client.add(c.request_id, self.prompts[c.prompt_index], self.arrival, stream=self.stream,
                                  pooling_params=sp, priority=self.priority, lora_request=self.lora)
            return
        seed = child_seed(sp.seed, c.index % sp.n)
        if seed != sp.seed:  # choice k of n draws with its own seed (a copy: the checked fields stay as they are)
            sp = copy.copy(sp)
            sp.seed = seed
        self.state.client.add(c.request_id, self.prompts[c.prompt_index], self.arrival, stream=self.stream,
                              sampling_params=sp, priority=self.priority, lora_request=self.lora)

    def metrics(self, c: Choice):
        """The metrics of the replica serving choice `c` (unrouted while none took it)."""
        return self.state.metrics.engine(self.stream.engines.get(c.request_id))

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0

    async def next(self) -> list[Choice]:
        """Wait for an output, then apply it and every output already queued behind it; returns the
        choices that changed, each with the merged delta of those outputs (a consumer that fell
        behind catches up with one event per choice, as vLLM's output collector merges deltas).
        EngineDeadError or APIError(rejected) on failure."""
        try:
            out = await self.stream.get()
            changed: dict[int, Choice] = {}
            while out is not None:
                pi = self.beam_ids.get(out.request_id)
                if pi is not None:
                    self._apply_beams(pi, out, changed)
                    out = self.stream.get_nowait()
                    continue
                c = self.by_id.get(out.request_id)
                if c is not None and not c.finished:
                    if c.index not in changed:
                        c.delta_ids, c.delta_logprobs, c.delta_text = [], [], ""
                        changed[c.index] = c
                    self._apply(c, out)
                out = self.stream.get_nowait()
        except EngineDeadError as e:
            self._fail_all()
            raise APIError(503, str(e), None, e.code) from None
        return list(changed.values())

    def _apply(self, c: Choice, out) -> None:
        st, m, now = self.state, c.engine_metrics, time.time()
        if m is None:  # an output came: its replica is known from now on
            m = c.engine_metrics = self.metrics(c)
        if out.finish_reason == "rejected":
            self._finish(c, "error", None, now)
            raise APIError(503 if "waiting" in str(out.stop_reason) else 400, f"request rejected: {out.stop_reason}")
        if out.finish_reason == "error":  # the executor failed on this request; the engine goes on
            self._finish(c, "error", None, now)
            if out.stop_reason == NO_TOKEN_LEFT:  # the request's own constraints contradict each other
                raise bad_request(NO_TOKEN_LEFT)
            raise APIError(500, f"generation failed: {out.stop_reason}", None, "generation_failed")
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        if out.pooling_output is not None:
            c.embedding = out.pooling_output
        if out.new_token_ids:
            c.num_generated += len(out.new_token_ids)
            if c.first_token_time is None:
                c.first_token_time = now
                c.num_cached_tokens = out.num_cached_tokens
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - c.last_token_time)
            c.last_token_time = now
        before = c.detok.num_tokens
        stopped = c.detok.add(out.new_token_ids)
        n = c.detok.num_tokens - before
        ids, lps = out.new_token_ids[:n], (out.new_logprobs or [])[:n]
        c.delta_ids.extend(ids)
        c.token_ids.extend(ids)
        c.delta_logprobs.extend(lps)
        c.logprobs.extend(lps)
        if stopped:
            st.client.abort([c.request_id])  # frees its KV blocks now
            self._finish(c, "stop", c.detok.stop_reason, now)
        elif out.finished:
            c.detok.finish()
            if c.detok.stop_reason is not None:
                self._finish(c, "stop", c.detok.stop_reason, now)
            else:
                self._finish(c, out.finish_reason, out.stop_reason, now)
        c.delta_text += c.detok.delta(final=c.finished)

    def _apply_beams(self, pi: int, out, changed: dict[int, Choice]) -> None:
        """A beam search's output: when it ends, its best beams (best first) become prompt `pi`'s choices."""
        n = self.n
        choices = self.choices[pi * n:(pi + 1) * n]
        if out.finish_reason in ("rejected", "error"):
            self._apply(choices[0], out)  # raises its error; the other choices are aborted with the run
        if not out.finished or choices[0].finished:
            return
        now = time.time()
        beams = out.beams or []
        for k, c in enumerate(choices):
            toks, _, _, reason = beams[k] if k < len(beams) else ([], [], 0.0, "length")
            c.delta_ids, c.delta_logprobs, c.delta_text = list(toks), [], ""
            changed[c.index] = c
            c.detok.add(toks)
            c.detok.finish()
            c.token_ids, c.num_generated, c.num_cached_tokens = list(toks), len(toks), out.num_cached_tokens
            c.first_token_time = c.last_token_time = now
            self._finish(c, reason, None, now)
            c.delta_text = c.detok.delta(final=True)

    def _finish(self, c: Choice, reason: str, stop_reason, now: float) -> None:
        c.finish_reason, c.stop_reason = reason, stop_reason
        self.num_unfinished -= 1
        self.state.live.pop(c.request_id, None)
        m = self.metrics(c)
        prompt = len(self.prompts[c.prompt_index])
        max_tokens = (None if self.pooling else self.sp.max_tokens if self.sp.max_tokens is not None
                      else self.state.max_model_len - prompt)
        m.observe_finished(FinishedRequest(reason, self.arrival, now, c.scheduled_time, c.first_token_time,
                                           c.last_token_time, prompt, c.num_cached_tokens, c.num_generated,
                                           max_tokens))
        left = self.unfinished_per_prompt
        left[c.prompt_index] -= 1
        if left[c.prompt_index] == 0 and not self.pooling:
            n = self.n
            siblings = self.choices[c.prompt_index * n:(c.prompt_index + 1) * n]
            m.observe_parent(n, max(s.num_generated for s in siblings))

    def _fail_all(self) -> None:
        for c in self.choices:
            if not c.finished:
                self._finish(c, "error", None, time.time())

    def abort(self) -> None:
        """Stop every unfinished choice (client gone, or another choice failed)."""
        live = [c for c in self.choices if not c.finished]
        if live:
            self.state.client.abort([rid for rid, pi in self.beam_ids.items() if not self.choices[pi * self.n].finished]
                                    if self.beam is not None else [c.request_id for c in live])
            now = time.time()
            for c in live:
                self._finish(c, "abort", None, now)

    async def run_to_end(self) -> None:
        """Collect every choice (non-streaming); aborts the rest if anything fails or it is cancelled."""
        try:
            while not self.done:
                await self.next()
        finally:
            self.abort()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        n = self.n
        cached = sum(self.choices[pi * n].num_cached_tokens for pi in range(len(self.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(self, token_id: int) -> str:
        return self.state.token_texts(token_id)
