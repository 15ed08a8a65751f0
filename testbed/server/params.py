"""From an OpenAI request body to the engine's SamplingParams, for /v1/completions and /v1/chat/completions
(and the checks /v1/embeddings shares: the priority rule, prompt truncation, the unknown-field warning).

Every field is validated through SamplingParams (the offline API's validator too) into a 400 naming the
field; what is not built (best_of other than n, a priority without priority scheduling) is refused by name;
the output constraint comes from exactly one of response_format, structured_outputs and guided_*; unknown
fields are ignored with one warning line per request, as vLLM does. Work that needs the tokenizer or a
grammar compiler (bad words, structured outputs) runs on the tokenizer thread.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from testbed.engine.params import (BeamSearchParams, InvalidParam, PoolingParams, SamplingParams,
                                   StructuredOutputsParams, check_priority, truncate_prompt)
from testbed.server.schemas import bad_request
from testbed.server.state import ServerState

LARGE_TOKEN_LISTS = 4096  # logit_bias, allowed_token_ids and stop_token_ids entries checked off the event loop beyond this
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
logger = logging.getLogger("uvicorn.error")  # the server's log (its level is --uvicorn-log-level)


def warn_ignored_fields(req) -> None:
    """Unknown fields are ignored, as vLLM does, with one warning line naming them."""
    if req.model_extra:
        logger.warning("The following fields were present in the request but ignored: %s", sorted(req.model_extra))


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the parameter it came from: response_format (json_object,
    json_schema), structured_outputs, or one of guided_json / guided_regex / guided_choice / guided_grammar."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema (the JSON schema "
                                  "the output must follow)", "response_format")
            found.append(("response_format", {"json": schema}))
        else:
            raise bad_request(f"response_format type {rf.type!r} is not supported; use text, json_object or "
                              "json_schema", "response_format")
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"give one output constraint, got {', '.join(n for n, _ in found)}", found[1][0])
    source, fields = found[0]
    try:
        return StructuredOutputsParams(**fields), source
    except InvalidParam as e:
        raise bad_request(f"{source}: {e}", source) from None


def sampling_params(state: ServerState, req, max_tokens: int | None, logprobs: int | None,
                    stop: list[str], prompt_logprobs: int | None = None) -> tuple[SamplingParams, str | None]:
    """Validate the shared sampling fields through SamplingParams (the offline API's validator too) into a
    400 naming the parameter, and refuse what is not built; with the parameter structured outputs came from."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} with n={req.n} is not supported: this server returns every "
                          "sequence it generates (best_of must equal n, or be left out)", "best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    warn_ignored_fields(req)
    so, source = structured_outputs(req)
    if so is not None and state.tokenizer is None:
        raise bad_request("structured outputs need the model's tokenizer; this model has none (dummy weights)", source)
    if req.bad_words and state.tokenizer is None:
        raise bad_request("bad_words need the model's tokenizer; this model has none (dummy weights)", "bad_words")
    check_request_priority(state, req.priority)
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0, logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens, structured_outputs=so), source
    except InvalidParam as e:
        if e.param.startswith("structured_outputs") and source is not None:
            raise bad_request(f"{source}: {e}", source) from None
        raise bad_request(str(e), e.param) from None


def beam_search_params(state: ServerState, req, sp: SamplingParams, prompts: list[list[int]]
                       ) -> BeamSearchParams | None:
    """vLLM's `use_beam_search` (with `n` beams, `length_penalty`, `ignore_eos`, `temperature`, `max_tokens`), or
    None without it; a 400 naming what a beam search cannot take. Without max_tokens the beams may grow to the
    shortest prompt's max_model_len."""
    if not req.use_beam_search:
        return None
    for name, given in (("stop", sp.stop), ("logprobs", sp.logprobs is not None), ("stop_token_ids", sp.stop_token_ids),
                        ("structured outputs", sp.structured_outputs is not None), ("stream", req.stream),
                        ("prompt_logprobs", sp.prompt_logprobs is not None), ("min_tokens", sp.min_tokens),
                        ("penalties and token constraints", sp.needs_processing)):
        if given:
            raise bad_request(f"use_beam_search does not take {name}: the beams are chosen by their logprobs alone "
                              "and returned at the end; drop it", name.split()[0])
    max_tokens = sp.max_tokens if sp.max_tokens is not None else state.max_model_len - max(len(p) for p in prompts)
    try:
        return BeamSearchParams(req.n, max_tokens, ignore_eos=req.ignore_eos, temperature=sp.temperature,
                                length_penalty=req.length_penalty)
    except InvalidParam as e:
        param = "n" if e.param == "beam_width" else e.param
        raise bad_request(f"use_beam_search: {e}".replace("beam_width", "n (the beam width)"), param) from None


def prepare_params(state: ServerState, sp: SamplingParams) -> SamplingParams:
    """What needs the tokenizer (run it on the tokenizer thread): bad words become token ids; then the
    vocabulary checks."""
    try:
        sp.update_from_tokenizer(state.tokenizer)
        return sp.verify(state.vocab_size)
    except InvalidParam as e:
        raise bad_request(str(e), e.param) from None


async def check_grammar(state: ServerState, sp: SamplingParams, source: str | None) -> None:
    """The request's structured output must parse, on a grammar thread within --structured-outputs-timeout
    (a 400 naming the field otherwise; a check that overran finishes in the background, holding no one up)."""
    from testbed.worker.grammar_compile import check_structured_outputs
    loop = asyncio.get_running_loop()
    job = loop.run_in_executor(state.grammar_pool, check_structured_outputs, sp.structured_outputs)
    try:
        await asyncio.wait_for(asyncio.shield(job), state.structured_outputs_timeout)
    except asyncio.TimeoutError:
        raise bad_request(f"{source}: the constraint was not checked within {state.structured_outputs_timeout:g} s "
                          "(--structured-outputs-timeout); simplify it", source) from None
    except InvalidParam as e:
        raise bad_request(f"{source}: {e}", source) from None


async def request_params(state: ServerState, req, max_tokens: int | None, logprobs: int | None, stop: list[str],
                         prompt_logprobs: int | None = None) -> SamplingParams:
    """sampling_params, its grammar checked (on a grammar thread), then prepare_params (on the tokenizer
    thread when the request needs it). Token-id maps and lists of more than LARGE_TOKEN_LISTS entries in all are
    checked on the tokenizer thread too, off the event loop (400,000 logit_bias entries take a fifth of a second)."""
    large = sum(len(x or ()) for x in (req.logit_bias, req.allowed_token_ids, req.stop_token_ids)) > LARGE_TOKEN_LISTS
    if large:
        sp, source = await state.run_blocking(sampling_params, state, req, max_tokens, logprobs, stop, prompt_logprobs)
    else:
        sp, source = sampling_params(state, req, max_tokens, logprobs, stop, prompt_logprobs)
    if sp.structured_outputs is not None:
        await check_grammar(state, sp, source)
    if sp.bad_words or large:
        return await state.run_blocking(prepare_params, state, sp)
    return prepare_params(state, sp)


def check_request_priority(state: ServerState, priority) -> None:
    """A priority fits int64 and, other than 0, needs priority scheduling (as vLLM): else a 400 naming it."""
    try:
        check_priority(priority)
    except InvalidParam as e:
        raise bad_request(str(e), e.param) from None
    if priority and state.scheduling_policy != "priority":
        raise bad_request(f"priority={priority} needs priority scheduling, which this server does not use "
                          "(start it with --scheduling-policy priority, or drop priority)", "priority")


def truncate_prompts(state: ServerState, prompts: list[list[int]], sp: SamplingParams | PoolingParams
                     ) -> list[list[int]]:
    """truncate_prompt_tokens applied to each prompt (a 400 when it exceeds max_model_len)."""
    try:
        return [list(truncate_prompt(p, sp.truncate_prompt_tokens, state.max_model_len)) for p in prompts]
    except InvalidParam as e:
        raise bad_request(str(e), e.param) from None
