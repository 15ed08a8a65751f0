"""POST /v1/chat/completions: messages through the tokenizer's chat template; OpenAI response shapes.
A stream starts with one `role: assistant` delta per choice."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from testbed.text.chat_utils import apply_chat_template
from testbed.engine.params import MAX_LOGPROBS
from testbed.server.schemas import ChatCompletionRequest, ChatMessage, bad_request
from testbed.server.params import beam_search_params, request_params, truncate_prompts
from testbed.server.serving import GenerationRun, floor_logprob, prompt_logprobs_json
from testbed.server.state import ServerState, new_id
from testbed.server.streaming import (EventFramer, SSEResponse, client_closed_response, collect, event_stream, sse,
                                       wakeup_chunks)


def message_texts(messages: list[ChatMessage]) -> list[str]:
    """The text of every message: its content string, or its content parts of type text."""
    out = []
    for m in messages:
        if isinstance(m.content, str):
            out.append(m.content)
        elif m.content:
            out.extend(p["text"] for p in m.content if p.get("type") == "text" and isinstance(p.get("text"), str))
    return out


def render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                bounded: bool = True) -> list[int]:
    """Token ids of the conversation through the model's chat template, given `chat_template_kwargs` as
    variables (a request cannot replace the template itself); 400 on anything it cannot render. `bounded`
    (unless the prompt is to be truncated): messages whose text alone is too long to fit max_model_len tokens
    are refused before the template runs (a chat template puts the messages' text in the prompt)."""
    tok = state.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer (dummy weights), so no chat template; use /v1/completions "
                          "with prompt token ids", "messages")
    if bounded:
        state.check_text_fits(message_texts(messages), "the messages' text", "messages")
    try:
        text = apply_chat_template(tok, [m.model_dump(exclude_none=True) for m in messages], add_generation_prompt,
                                   continue_final_message, None, chat_template_kwargs)
    except ValueError as e:
        raise bad_request(str(e), "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
                          ) from None
    return tok(text, add_special_tokens=False).input_ids


def chat_logprobs(run: GenerationRun, token_ids: list[int], logprobs: list) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = run.token_text(tid)
        return {"token": s, "logprob": floor_logprob(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                        for tid, (lp, _, top) in zip(token_ids, logprobs)]}


def refuse_tools(req: ChatCompletionRequest) -> None:
    """Tool calling is not built: tools and any tool_choice but "none" get a 400 naming the parameter."""
    if req.tools:
        raise bad_request("tools (function calling) are not supported by this server; drop tools", "tools")
    if req.tool_choice is not None and req.tool_choice != "none":
        raise bad_request(f"tool_choice {req.tool_choice!r} is not supported: this server calls no tools (only "
                          "'none' is accepted)", "tool_choice")


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    lora = state.check_model(req.model)
    refuse_tools(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                              "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp = await request_params(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, stop,
                              req.prompt_logprobs)
    prompt = await state.run_blocking(render_chat, state, req.messages, req.add_generation_prompt,
                                      req.continue_final_message, req.chat_template_kwargs,
                                      sp.truncate_prompt_tokens is None)
    prompt = truncate_prompts(state, [prompt], sp)[0]
    run = GenerationRun(state, new_id("chatcmpl"), [prompt], sp, req.priority, lora,
                        beam_search_params(state, req, sp, [prompt]))
    run.start()
    head = {"id": run.request_id, "created": int(time.time()), "model": run.model}
    if req.stream:
        return SSEResponse(event_stream(run, _stream(run, req, head)), run.abort)
    if not await collect(run, request):
        return client_closed_response()
    choices = []
    for c in run.choices:
        d = {"index": c.index, "message": {"role": "assistant", "content": c.detok.text},
             "logprobs": chat_logprobs(run, c.token_ids, c.logprobs) if req.logprobs else None,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            d["token_ids"] = c.token_ids
        choices.append(d)
    body = {**head, "object": "chat.completion", "choices": choices, "usage": run.usage()}
    if req.prompt_logprobs is not None:  # vLLM's field, for the conversation's tokens
        body["prompt_logprobs"] = prompt_logprobs_json(run, prompt, run.choices[0].prompt_logprobs,
                                                       req.prompt_logprobs)
    return JSONResponse(body)


async def _stream(run: GenerationRun, req: ChatCompletionRequest, head: dict) -> AsyncIterator[bytes]:
    """The role event at once, then one chunk per wakeup: every event that the outputs applied at once make (and
    the usage event once the run is done) goes out in one write."""
    head = {**head, "object": "chat.completion.chunk"}
    yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None} for c in run.choices]})
    framer = EventFramer(head)

    def events_of(c) -> list[bytes]:
        d = {"index": c.index, "delta": {"content": c.delta_text},
             "logprobs": chat_logprobs(run, c.delta_ids, c.delta_logprobs) if req.logprobs else None,
             "finish_reason": c.finish_reason}
        if c.finished:
            d["stop_reason"] = c.stop_reason
        if req.return_token_ids:
            d["token_ids"] = c.delta_ids
        return [framer.event(d)]

    usage = req.stream_options is not None and req.stream_options.include_usage
    async for chunk in wakeup_chunks(run, head, usage, events_of):
        yield chunk
