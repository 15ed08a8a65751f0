"""POST /v1/embeddings: each input's final hidden states pooled as the server's --pooler-config says (LAST or
MEAN, normalised unless the request sets `normalize: false`); OpenAI's response, floats or base64 float32.
Each input is one prompt-only core request through the same engine and scheduler as a generation."""
from __future__ import annotations

import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from testbed.engine.params import InvalidParam, PoolingParams
from testbed.server.completions import parse_prompts_async
from testbed.server.schemas import APIError, EmbeddingRequest, bad_request
from testbed.server.params import check_request_priority, truncate_prompts, warn_ignored_fields
from testbed.server.serving import GenerationRun
from testbed.server.state import ServerState, new_id
from testbed.server.streaming import client_closed_response, collect


def encode(vec: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes (what OpenAI's client decodes)."""
    return vec if encoding_format == "float" else base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()


async def create_embedding(state: ServerState, req: EmbeddingRequest, request: Request) -> Response:
    lora = state.check_model(req.model)
    warn_ignored_fields(req)
    check_request_priority(state, req.priority)
    try:
        pp = PoolingParams(normalize=req.normalize, dimensions=req.dimensions,
                           truncate_prompt_tokens=req.truncate_prompt_tokens).resolve(
            state.pooler_config.pooling_type, state.pooler_config.normalize)
    except InvalidParam as e:
        raise bad_request(str(e), e.param) from None
    prompts, _ = await parse_prompts_async(state, req.input, "input", req.add_special_tokens,
                                           req.truncate_prompt_tokens is not None, None)
    prompts = truncate_prompts(state, prompts, pp)
    run = GenerationRun(state, new_id("embd"), prompts, pp, priority=req.priority, lora=lora)
    run.start()
    if not await collect(run, request):
        return client_closed_response()
    if any(c.embedding is None for c in run.choices):
        raise APIError(500, "generation failed: the executor returned no embedding for an input (an executor that "
                            "runs no model, or a custom one that does not pool)", None, "generation_failed")
    n = sum(len(p) for p in prompts)
    return JSONResponse({"id": run.request_id, "object": "list", "created": int(time.time()),
                         "model": run.model,
                         "data": [{"index": c.index, "object": "embedding", "embedding": encode(c.embedding,
                                                                                                 req.encoding_format)}
                                  for c in run.choices],
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
