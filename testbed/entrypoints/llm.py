"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`, `.chat(messages)` and
`.embed(prompts)` (pooled hidden states: a prompt-only request through the same scheduler).

One EngineCore and one real executor in this process; `step()` is the real-mode driver of the
sans-I/O core: schedule at the wall clock, run the model, update at the wall clock. With
`data_parallel_size=N` > 1 the engine is N replica processes behind the DP coordinator process
(dp_llm.DPEngine, the stack of `testbed serve -dp N`); `step()` then waits for their outputs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence


from testbed.text.detokenizer import IncrementalDetokenizer, TokenTexts
from testbed.engine.config import PoolerConfig
from testbed.engine.core import EngineCore
from testbed.engine.lora import LoRARequest
from testbed.engine.outputs import EngineCoreOutput
from testbed.engine.params import (BeamSearchParams, InvalidParam, PoolingParams, SamplingParams, check_priority,
                                   check_token_ids, child_seed, truncate_prompt)
from testbed.engine.request import Request
from testbed.outputs import (BeamSearchOutput, CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                             RequestMetrics, RequestOutput, beam_sequences, logprob_dict, prompt_logprob_dicts)
from testbed.engine.stepper import EngineStepper


def pair_params(prompts, params, kind: str) -> tuple[list, list]:
    """(the prompts as a list, one params per prompt): one prompt (a string, a dict or a token-id list) or a list
    of them, and one params for all or a list of one each."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} {kind} params for {len(prompts)} prompts")
    return prompts, params_list


def progress_bar(enabled: bool, total: int, desc: str):
    """A tqdm bar of `total` items on stderr, or None when not enabled."""
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="prompt", dynamic_ncols=True)


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, load_format: str = "auto",
                 dtype: str = "auto", device: str | None = None, skip_tokenizer_init: bool = False,
                 enforce_eager: bool = False, executor=None, pooler_config=None, trust_remote_code: bool = False,
                 revision: str | None = None, tokenizer_revision: str | None = None, download_dir: str | None = None,
                 **engine_args: Any) -> None:
        """`model`: a folder, a .gguf file, a hub id found in the local Hugging Face cache (at `revision`, under
        `download_dir` if given; nothing is downloaded), a preset with `load_format="dummy"`, or None for the
        bundled SmolLM2. `engine_args`: this engine's EngineConfig fields and vLLM's common engine arguments
        (llm_args.py honours, fixes or refuses each). `executor`: reuse one built earlier for the same model (a
        fresh engine over its KV cache, whose stale contents are never read: every block is written before it
        is attended over); its block size and tensor-parallel size must match these engine arguments. An executor
        with no model runner (testbed.sim.emulator.EmulatedExecutor, built for these engine arguments) is taken as
        it is: the offline engine then steps at the emulated GPU's pace.
        `data_parallel_size` > 1 starts the replica processes (no executor to reuse). `pooler_config` (a
        PoolerConfig or a dict of its fields) is how `embed` pools unless its PoolingParams say otherwise.
        `trust_remote_code` lets the tokenizer run code shipped with the model."""
        from testbed.entrypoints.llm_args import engine_config
        from testbed.worker.hub import resolve_model
        self.pooler_config = PoolerConfig.of(pooler_config)
        self.config = engine_config(engine_args)
        if executor is None:
            model = resolve_model(model, load_format, revision, download_dir)
        self.dp = None
        self.engine = self.executor = self.stepper = None
        if self.config.data_parallel_size > 1:
            if executor is not None:
                raise ValueError("executor: data-parallel replicas build their own; pass none with data_parallel_size > 1")
            from testbed.entrypoints.dp_llm import DPEngine
            self.dp = DPEngine(model, self.config, load_format, dtype, device, enforce_eager)
            model_path, ready = self.dp.model_path, self.dp.ready
            self.eos_token_id, self.vocab_size = ready.eos_token_id, ready.vocab_size
            self.max_model_len = ready.max_model_len
        else:
            if executor is None:
                from testbed.worker.executor import create_executor
                executor = create_executor(model, self.config, load_format, dtype, device, enforce_eager)
            elif getattr(executor, "runner", None) is not None:  # a real executor built earlier: check its build
                runner = executor.runner
                slots = runner.lora.num_slots if runner.lora is not None else 0
                if self.config.enable_lora and (slots < self.config.max_loras
                                                or runner.config.max_lora_rank < self.config.max_lora_rank):
                    raise ValueError(f"executor was built without room for max_loras={self.config.max_loras} adapters "
                                     f"of rank {self.config.max_lora_rank} (it has {slots} slots); build it with "
                                     "enable_lora=True and at least these max_loras and max_lora_rank")
                built, asked = (runner.block_size, runner.config.tensor_parallel_size,
                                runner.config.pipeline_parallel_size), (self.config.block_size,
                                                                        self.config.tensor_parallel_size,
                                                                        self.config.pipeline_parallel_size)
                if built != asked:
                    raise ValueError("executor was built for block_size {}, tensor_parallel_size {} and "
                                     "pipeline_parallel_size {}; these engine arguments ask for {}, {} and {}"
                                     .format(*built, *asked))
                if hasattr(executor, "set_swap_space"):  # the CPU pool these engine arguments ask for
                    executor.set_swap_space(self.config.cpu_blocks(runner.block_bytes))
            self.executor = executor
            self.engine = EngineCore(self.config, executor.num_gpu_blocks, executor.max_model_len,
                                     num_cpu_blocks=getattr(executor, "num_cpu_blocks", None))
            self.stepper = EngineStepper(self.engine, executor, self.now, self.config.async_scheduling)
            model_path, self.eos_token_id, self.vocab_size, self.max_model_len = (
                executor.model_path, executor.eos_token_id, executor.vocab_size, executor.max_model_len)
        self.tokenizer = None
        if not skip_tokenizer_init and load_format != "dummy":
            from testbed.worker.loader import load_tokenizer
            source = model_path if tokenizer is None else resolve_model(tokenizer, "auto", tokenizer_revision,
                                                                        download_dir)
            self.tokenizer = load_tokenizer(source, trust_remote_code)
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self._next_id = 0

    def now(self) -> float:
        """Seconds since this engine's clock was (re)started: the `now` the core is fed."""
        return self.dp.now() if self.dp is not None else time.perf_counter() - self._t0

    def reset_clock(self) -> None:
        """Make this moment time 0 (a replay's timeline starts at its first arrival)."""
        if self.dp is not None:
            self.dp.reset_clock()
        self._t0, self._wall0 = time.perf_counter(), time.time()

    def shutdown(self) -> None:
        """End the worker processes (TP ranks, or the DP coordinator and replicas)."""
        if self.dp is not None:
            self.dp.shutdown()
        else:
            self.executor.shutdown()

    def records(self):
        """The run's records (Recorder): per-replica steps and each request's replica; with data
        parallelism also the coordinator's routes and stats reports (read after shutdown())."""
        return self.dp.records() if self.dp is not None else self.engine.records

    def get_tokenizer(self):
        return self.tokenizer

    # ---- the real-mode driver ------------------------------------------------------------------
    def step(self, now: float | None = None, timeout: float | None = None) -> list[EngineCoreOutput]:
        """One engine step scheduled at `now` (default: the wall clock), updated at the wall clock
        once the model ran (with async scheduling: the previous step is updated after this one is
        launched); nothing happens when nothing is schedulable or in flight. With data parallelism
        the replicas step on their own: this returns the outputs that arrived, waiting up to
        `timeout` s (None: until one does)."""
        if self.dp is not None:
            return self.dp.step(timeout)
        so, outputs = self.stepper.step(now)
        if so.is_empty and not outputs and self.stepper.in_flight is None and self.stepper.compiling:
            time.sleep(0.001)  # only grammars compiling (on their threads): leave them the CPU
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.dp.has_unfinished_requests() if self.dp is not None else self.stepper.has_work()

    def abort_request(self, request_id: str) -> None:
        """End a live request (its blocks are freed); unknown or finished ids are ignored."""
        if self.dp is not None:
            self.dp.abort(request_id)
        else:
            self.engine.abort(request_id, self.now())

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams | PoolingParams | BeamSearchParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> EngineCoreOutput | None:
        """Queue one request (PoolingParams: an embedding of the prompt, pooled as this LLM's pooler config says
        where they do not); returns a finished 'rejected' output when the engine cannot serve it.
        Bad input raises ValueError before the request is queued: sampling parameters out of range (checked
        again here, as they may have been changed after construction), a grammar that does not compile, a priority
        outside int64 and token ids outside the vocabulary (the embedding would fail or, under TP, read zeros).
        bad_words become token ids through this LLM's tokenizer. `lora_request`: the adapter to run (None: the base
        model); its folder's config is checked here (rank, target modules) and its weights on first use."""
        vocab = self.vocab_size
        if lora_request is not None:
            self._check_lora(request_id, lora_request)
        beam = None
        if isinstance(params, BeamSearchParams):  # its beams sample with these
            beam, params = params, params.sampling_params()
        pooling = isinstance(params, PoolingParams)
        try:
            if pooling:
                params = PoolingParams(params.pooling_type, params.normalize, params.dimensions,
                                       params.truncate_prompt_tokens).resolve(self.pooler_config.pooling_type,
                                                                              self.pooler_config.normalize)
            else:
                if params.bad_words and self.tokenizer is not None:
                    params.update_from_tokenizer(self.tokenizer)
                if params.structured_outputs is not None:
                    if self.tokenizer is None:
                        raise InvalidParam("structured_outputs", "needs the model's tokenizer; this LLM has none")
                    from testbed.worker.grammar_compile import check_structured_outputs
                    check_structured_outputs(params.structured_outputs)
                params.verify(vocab)
            check_priority(priority)
            check_token_ids(prompt_token_ids, vocab)
        except InvalidParam as e:
            raise ValueError(f"request {request_id!r}: {e}; pass token ids from this model's tokenizer"
                             if e.param == "prompt" else f"request {request_id!r}: {e}") from None
        if self.dp is not None:  # a rejection comes back from step() as a finished output
            return self.dp.add_request(request_id, prompt_token_ids, params,
                                       self.now() if arrival_time is None else arrival_time, priority, lora_request,
                                       beam)
        req = Request(request_id, prompt_token_ids, None if pooling else params,
                      self.now() if arrival_time is None else arrival_time, priority=priority,
                      eos_token_id=self.eos_token_id, pooling_params=params if pooling else None,
                      lora_request=lora_request, beam_params=beam)
        return self.engine.add_request(req, self.now())

    def _check_lora(self, request_id: str, lora: LoRARequest) -> None:
        """ValueError unless LoRA is on and the adapter's folder is one this engine can serve."""
        from testbed.worker.lora_config import read_adapter_config
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"request {request_id!r}: lora_request must be a LoRARequest(name, int_id, path) or None, "
                             f"got {type(lora).__name__}")
        if not self.config.enable_lora:
            raise ValueError(f"request {request_id!r}: asks for LoRA adapter {lora.lora_name!r} but LoRA is off; "
                             "create the LLM with enable_lora=True")
        read_adapter_config(lora.lora_path, self.config.max_lora_rank, lora.lora_name)

    # ---- offline generation --------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer (dummy weights or skip_tokenizer_init): "
                                 "pass prompts as token-id lists")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a token-id list, or a list of those) in input order; `use_tqdm`
        shows a progress bar of finished prompts on stderr (as vLLM's). `lora_request`: one adapter for every
        prompt, or a list with one per prompt (None: the base model), as vLLM takes it."""
        prompts, params_list = pair_params(prompts, sampling_params or SamplingParams(), "sampling")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; give one, or one per prompt")
        results: list[RequestOutput] = []
        seqs: dict[str, tuple[RequestOutput, int, SamplingParams, IncrementalDetokenizer | None, list]] = {}
        try:
            for prompt, sp, lora in zip(prompts, params_list, loras):
                text, ids = self._tokenize(prompt)
                ids = self._truncate(ids, sp, len(results))
                gen = RequestOutput(str(self._next_id), text, ids)
                self._next_id += 1
                results.append(gen)
                gen.metrics = RequestMetrics(self._wall(self.now()), None, None, None, None)
                for k in range(sp.n):
                    # the prompt's logprobs are the same for every sequence: the first one computes them
                    child = sp if sp.n == 1 else dataclasses.replace(
                        sp, n=1, seed=child_seed(sp.seed, k), prompt_logprobs=sp.prompt_logprobs if k == 0 else None)
                    rid = gen.request_id if sp.n == 1 else f"{gen.request_id}-{k}"
                    rejected = self.add_request(rid, ids, child, gen.metrics.arrival_time - self._wall(0.0),
                                                lora_request=lora)
                    if rejected is not None:
                        raise ValueError(f"prompt {len(results) - 1}: {rejected.stop_reason}")
                    detok = IncrementalDetokenizer(self.tokenizer, ids, child.stop, child.include_stop_str_in_output,
                                                   child.skip_special_tokens, child.spaces_between_special_tokens
                                                   ) if self.tokenizer else None
                    gen.outputs.append(CompletionOutput(k, "", [], None, [] if child.logprobs is not None else None, None))
                    seqs[rid] = (gen, k, child, detok, [])
            self._drain(seqs, progress_bar(use_tqdm, len(results), "Processed prompts"))
        except BaseException:
            self._abort_all(seqs)
            raise
        return results

    def beam_search(self, prompts, params: BeamSearchParams, lora_request: LoRARequest | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search, one BeamSearchOutput per prompt (a string, a token-id list, or a dict with
        "prompt" or "prompt_token_ids", as vLLM's TextPrompt / TokensPrompt), in input order, its sequences best
        first. Each prompt is one beam group in the engine: its beams share their prompt's blocks and copy a
        shared block on write (engine/beam_search.py)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids_of: dict[str, list[int]] = {}
        results: dict[str, list] = {}
        try:
            for prompt in prompts:
                _, ids = self._tokenize(prompt)
                rid = str(self._next_id)
                self._next_id += 1
                ids_of[rid] = ids
                rejected = self.add_request(rid, ids, params, lora_request=lora_request)
                if rejected is not None:
                    raise ValueError(f"prompt {len(ids_of) - 1}: {rejected.stop_reason}")
            bar = progress_bar(use_tqdm, len(ids_of), "Beam search")
            while len(results) < len(ids_of):
                for o in self.step():
                    if o.request_id not in ids_of or not o.finished:
                        continue
                    if o.beams is None:
                        raise RuntimeError(f"beam search of prompt {list(ids_of).index(o.request_id)} ended with "
                                           f"{o.finish_reason}: {o.stop_reason}")
                    results[o.request_id] = o.beams
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            self._abort_all([rid for rid in ids_of if rid not in results])
            raise
        tok = self.tokenizer
        decode = (lambda t: tok.decode(t)) if tok is not None else None
        text = (lambda t: tok.decode([t])) if tok is not None else None
        return [BeamSearchOutput(beam_sequences(ids_of[rid], results[rid], 2 * params.beam_width, decode, text))
                for rid in ids_of]

    def _truncate(self, ids: list[int], params: SamplingParams | PoolingParams, index: int) -> list[int]:
        """The prompt as `params.truncate_prompt_tokens` keeps it (ValueError naming prompt `index`)."""
        try:
            return list(truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len))
        except InvalidParam as e:
            raise ValueError(f"prompt {index}: {e}") from None

    def _wall(self, t: float) -> float:
        """time.time() of a time on this LLM's clock (now())."""
        return t + (self.dp.t0 if self.dp is not None else self._wall0)

    def _observe(self, m: RequestMetrics, request_id: str, o: EngineCoreOutput, finished: bool) -> None:
        """Fold one output of one of a prompt's sequences into the prompt's metrics: token and finish times as
        this LLM receives them (its clock, in time.time()), the first scheduling as the engine saw it."""
        now = self._wall(self.now())
        if m.first_scheduled_time is None or o.new_token_ids or finished:
            scheduled = self._first_scheduled(request_id, o)
            if scheduled is not None and (m.first_scheduled_time is None or scheduled < m.first_scheduled_time):
                m.first_scheduled_time, m.time_in_queue = scheduled, scheduled - m.arrival_time
        if o.new_token_ids:
            m.first_token_time = now if m.first_token_time is None else m.first_token_time
            m.last_token_time = now
        if finished:
            m.finished_time = now
            if self.dp is not None:
                self.dp.scheduled.pop(request_id, None)

    def _first_scheduled(self, request_id: str, o: EngineCoreOutput) -> float | None:
        """When the engine first scheduled a request (time.time()), None while it has not."""
        if self.dp is not None:
            return self.dp.scheduled.get(request_id)
        req = self.engine.requests.get(request_id)
        t = req.first_scheduled_time if req is not None else (o.timing[0] if o.timing else None)
        return None if t is None else self._wall(t)

    def _abort_all(self, request_ids) -> None:
        """End every live request (a batch call failed or was interrupted): their outputs are not wanted."""
        if self.dp is not None:
            for rid in request_ids:
                self.dp.abort(rid)
        else:
            self.stepper.discard()  # their tokens are not wanted; the aborts below free their blocks
            for rid in list(self.engine.requests):
                self.engine.abort(rid, self.now())

    def embed(self, prompts, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (a string, a token-id list, or a list of those), in input order: its
        final hidden states pooled as `pooling_params` (or this LLM's pooler config) say. Each is a prompt-only
        request through the same scheduler as a generation. `use_tqdm`: a progress bar on stderr."""
        prompts, params_list = pair_params(prompts, pooling_params or PoolingParams(), "pooling")
        results: dict[str, EmbeddingRequestOutput] = {}
        try:
            for prompt, pp in zip(prompts, params_list):
                _, ids = self._tokenize(prompt)
                ids = self._truncate(ids, pp, len(results))
                rid = str(self._next_id)
                self._next_id += 1
                rejected = self.add_request(rid, ids, pp)
                if rejected is not None:
                    raise ValueError(f"prompt {len(results)}: {rejected.stop_reason}")
                results[rid] = EmbeddingRequestOutput(rid, EmbeddingOutput([]), ids)
            bar = progress_bar(use_tqdm, len(results), "Processed prompts")
            while self.has_unfinished_requests():
                for o in self.step():
                    if o.finish_reason in ("rejected", "error"):
                        raise ValueError(f"request {o.request_id}: {o.stop_reason}")
                    r = results[o.request_id]
                    r.outputs.embedding, r.num_cached_tokens = o.pooling_output, o.num_cached_tokens
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            self._abort_all(results)
            raise
        return list(results.values())

    def _drain(self, seqs: dict, bar) -> None:
        texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None  # logprobs' decoded tokens
        left = {}  # unfinished sequences per prompt, for the progress bar
        for gen, *_ in seqs.values():
            left[gen.request_id] = left.get(gen.request_id, 0) + 1
        tokens_in = tokens_out = 0  # of the prompts done, and generated so far: the bar's speeds, as vLLM's
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finish_reason == "rejected":  # data parallel: a replica refused it
                    raise ValueError(f"request {o.request_id}: {o.stop_reason}")
                gen, k, sp, detok, _ = seqs[o.request_id]
                c = gen.outputs[k]
                c.token_ids.extend(o.new_token_ids)
                tokens_out += len(o.new_token_ids)
                if o.new_logprobs and c.logprobs is not None:
                    c.logprobs.extend(logprob_dict(t, e, texts) for t, e in zip(o.new_token_ids, o.new_logprobs))
                    c.cumulative_logprob = (c.cumulative_logprob or 0.0) + sum(e[0] for e in o.new_logprobs)
                gen.num_cached_tokens = o.num_cached_tokens
                if o.prompt_logprobs is not None:
                    gen.prompt_logprobs = prompt_logprob_dicts(gen.prompt_token_ids, o.prompt_logprobs, texts)
                finished, reason, stop_reason = o.finished, o.finish_reason, o.stop_reason
                if detok is not None:
                    stopped = detok.add(o.new_token_ids)
                    if stopped and not finished:  # a stop string: end the request in the core, free its blocks
                        self.abort_request(o.request_id)
                        finished = True
                    if finished:
                        detok.finish()
                    c.text += detok.delta(final=True)
                    if detok.stop_reason is not None:
                        reason, stop_reason = "stop", detok.stop_reason
                self._observe(gen.metrics, o.request_id, o, finished)
                if finished:
                    c.finish_reason, c.stop_reason = reason, stop_reason
                    left[gen.request_id] -= 1
                    if left[gen.request_id] == 0 and bar is not None:
                        tokens_in += len(gen.prompt_token_ids or ())
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"est. speed input: {tokens_in / elapsed:.2f} toks/s, output: "
                                            f"{tokens_out / elapsed:.2f} toks/s", refresh=False)
                        bar.update(1)
        if bar is not None:
            bar.close()

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI messages, whose content may be a list of text
        parts) or a list of them, through the tokenizer's chat template (or `chat_template`), given
        `chat_template_kwargs` as template variables; `lora_request` as `generate` takes it."""
        from testbed.text.chat_utils import apply_chat_template
        if tools is not None:
            raise ValueError("tools: tool calling is not supported by this engine; leave it out")
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template (not available with dummy weights)")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = apply_chat_template(self.tokenizer, conv, add_generation_prompt, continue_final_message,
                                       chat_template, chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)
