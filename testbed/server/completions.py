"""POST /v1/completions: prompts as text, token ids, or lists of either; OpenAI response shapes."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from testbed.server.schemas import CompletionRequest, bad_request
from testbed.server.params import beam_search_params, request_params, truncate_prompts
from testbed.server.serving import (Choice, GenerationRun, check_choice_count, floor_logprob as _floor,
                                    prompt_logprobs_json)
from testbed.server.state import ServerState, new_id
from testbed.server.streaming import (EventFramer, SSEResponse, client_closed_response, collect, event_stream,
                                       wakeup_chunks)


INLINE_IDS = 16384  # token-id prompts up to this many ids in all are checked on the event loop (tens of us)


async def parse_prompts_async(state: ServerState, prompt, *args) -> tuple[list[list[int]], list[str | None]]:
    """parse_prompts, on the tokenizer thread when there is text to tokenize or a very long id list, inline
    otherwise: a burst of token-id requests then reaches the engine without a thread hop each."""
    lists = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    if len(lists) <= INLINE_IDS and all(isinstance(p, list) for p in lists) and sum(map(len, lists)) <= INLINE_IDS:
        return parse_prompts(state, prompt, *args)
    return await state.run_blocking(parse_prompts, state, prompt, *args)


def parse_prompts(state: ServerState, prompt, param: str = "prompt", add_special_tokens: bool = True,
                  truncating: bool = False, n: int | None = 1) -> tuple[list[list[int]], list[str | None]]:
    """(token ids per prompt, text per prompt or None when given as ids); `param` names the field in errors;
    `truncating` (truncate_prompt_tokens given): any length is tokenized, to be cut afterwards; `n` sequences a
    prompt (None: pooling inputs), whose count is checked before anything is tokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise bad_request(f"the {param} is empty; give a string, a list of strings or token ids", param)
    elif isinstance(prompt[0], int):
        prompt = [prompt]
    check_choice_count(len(prompt), n)
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids.append(state.tokenize(p, add_special_tokens, bounded=not truncating))
            texts.append(p)
        else:
            state.check_token_ids(p, param)
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def completion_logprobs(run: GenerationRun, token_ids: list[int], logprobs: list, offset: int,
                        width: int) -> dict[str, Any]:
    """The legacy logprobs object; `offset` is where the first token's text starts in the choice text. An
    entry None (the first prompt token under echo) has no logprob; tops keep `width` entries plus the token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        s = run.token_text(tid)
        tokens.append(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            lp, _, top = entry
            token_lps.append(_floor(lp))
            d = {run.token_text(t): _floor(v) for t, v in top[:width]}
            d.setdefault(s, _floor(lp))  # the token itself is always there (up to width + 1 entries)
            tops.append(d)
        offsets.append(offset)
        if run.state.tokenizer is not None:  # without one the choice text stays empty
            offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _choice(run: GenerationRun, req: CompletionRequest, c: Choice, text: str, ids: list[int], lps: list,
            offset: int, prompt_ids: list[int] | None, last: bool = True) -> dict[str, Any]:
    """One choice; `prompt_ids` given in a choice's first (or only) event: the echoed prompt's logprobs and
    token ids go there. `last` False: an event before the choice's latest one (no finish reason yet)."""
    lp_obj = None
    if req.logprobs is not None:
        lp_obj = completion_logprobs(run, ids, lps, offset, req.logprobs)
        if req.echo and prompt_ids is not None:
            echoed = completion_logprobs(run, prompt_ids, [None] + (c.prompt_logprobs or []), 0, req.logprobs)
            lp_obj = {k: echoed[k] + lp_obj[k] for k in lp_obj}
    d = {"index": c.index, "text": text, "logprobs": lp_obj, "finish_reason": c.finish_reason if last else None,
         "stop_reason": c.stop_reason if last else None}
    if req.prompt_logprobs is not None and prompt_ids is not None:
        d["prompt_logprobs"] = prompt_logprobs_json(run, prompt_ids, c.prompt_logprobs, req.prompt_logprobs)
    if req.return_token_ids:
        d["token_ids"] = ids
        if prompt_ids is not None:
            d["prompt_token_ids"] = prompt_ids
    return d


def echo_texts(state: ServerState, prompts: list[list[int]], texts: list[str | None]) -> list[str]:
    return [t if t is not None else state.detokenize(p) for p, t in zip(prompts, texts)]


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    lora = state.check_model(req.model)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs too
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    sp = await request_params(state, req, req.max_tokens, req.logprobs, stop, prompt_logprobs)
    parsed, texts = await parse_prompts_async(state, req.prompt, "prompt", True, req.truncate_prompt_tokens is not None,
                                              sp.n)
    prompts = truncate_prompts(state, parsed, sp)
    texts = [t if len(p) == len(q) else None for t, p, q in zip(texts, prompts, parsed)]  # echo what was kept
    beam = beam_search_params(state, req, sp, prompts)
    run = GenerationRun(state, new_id("cmpl"), prompts, sp, req.priority, lora, beam)
    echoes = await state.run_blocking(echo_texts, state, prompts, texts) if req.echo else [""] * len(prompts)
    run.start()
    head = {"id": run.request_id, "object": "text_completion", "created": int(time.time()),
            "model": run.model}
    if req.stream:
        return SSEResponse(event_stream(run, _stream(run, req, head, echoes)), run.abort)
    if not await collect(run, request):
        return client_closed_response()
    choices = []
    for c in run.choices:
        echo = echoes[c.prompt_index]
        choices.append(_choice(run, req, c, echo + c.detok.text, c.token_ids, c.logprobs, len(echo),
                               prompts[c.prompt_index]))
    return JSONResponse({**head, "choices": choices, "usage": run.usage()})


async def _stream(run: GenerationRun, req: CompletionRequest, head: dict, echoes: list[str]) -> AsyncIterator[bytes]:
    """The stream's events, one chunk per wakeup: every event that the outputs applied at once make (and the usage
    event once the run is done) goes out in one write."""
    offsets = {c.index: len(echoes[c.prompt_index]) for c in run.choices}
    started: set[int] = set()
    framer = EventFramer(head)

    def events_of(c) -> list[bytes]:
        text = c.delta_text
        prompt_ids = None
        if c.index not in started:
            started.add(c.index)
            text = echoes[c.prompt_index] + text
            prompt_ids = run.prompts[c.prompt_index]
        if run.state.tokenizer is None and len(c.delta_ids) > 1:
            # no text to carry (no tokenizer): one event per token, so a client can still count and time
            # them (several tokens queued behind a slow reader otherwise go out as one event, as in vLLM)
            lps = c.delta_logprobs or [None] * len(c.delta_ids)
            last = len(c.delta_ids) - 1
            return [framer.event(_choice(run, req, c, text if k == 0 else "", [tid],
                                         [lps[k]] if c.delta_logprobs else [], offsets[c.index],
                                         prompt_ids if k == 0 else None, k == last))
                    for k, tid in enumerate(c.delta_ids)]
        choice = _choice(run, req, c, text, c.delta_ids, c.delta_logprobs, offsets[c.index], prompt_ids)
        if choice["logprobs"] and run.state.tokenizer is not None:
            offsets[c.index] += sum(len(run.token_text(t)) for t in c.delta_ids)
        return [framer.event(choice)]

    usage = req.stream_options is not None and req.stream_options.include_usage
    async for chunk in wakeup_chunks(run, head, usage, events_of):
        yield chunk
