"""The response shapes of `testbed serve`, for its OpenAPI document (/openapi.json, /docs).

The handlers build their JSON directly; these models only describe it, so a client generator or a
schema tool (schemathesis) sees exactly what comes back. They allow extra keys, as OpenAI's objects
do. `openapi_responses` lists the error statuses each route can answer (all with OpenAI's error
body), and `document` drops FastAPI's default 422 entry: a body that does not validate is a 400 here.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

PROMETHEUS_TEXT = "text/plain"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body; `param` names the request field at fault, where one is."""

    error: ErrorInfo


class HealthResponse(BaseModel):
    """`ok`, or `degraded` with the data-parallel replicas that died (rank -> why) while others serve."""

    status: Literal["ok", "degraded"]
    dead_engines: dict[str, str] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    vocab_size: int
    emulated: str | None = None  # testbed: the GPU and cost model `--emulate` times steps by, else null


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int | None = None
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(BaseModel):
    index: int
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with vLLM's return_token_ids


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A whole completion; with `stream: true` the same objects come as `data:` events, then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Choice):
    message: ChatMessageOut
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; with `stream: true`, `chat.completion.chunk` events, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Embedding(BaseModel):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str  # encoding_format base64: little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


BAD_REQUEST = {400: _error("Invalid request: a malformed body or a parameter out of range (`param` names it)"),
               413: _error("Request body larger than --max-request-bytes")}
UNAUTHORIZED = {401: _error("Missing or wrong API key (the server runs with --api-key)")}
MODEL_NOT_FOUND = {404: _error("The `model` field names a model this server does not serve")}
GENERATION_ERRORS = {500: _error("The engine failed on this request (`generation_failed`); the server goes on"),
                     503: _error("The engine is dead or shutting down, or the waiting queue is full")}
# one server-sent event (OpenAPI before 3.2 has an event stream's schema describe each event): its data is a JSON
# chunk of the response object, and the last event's is [DONE]
STREAM = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "A JSON chunk (the response object's shape), or [DONE] last"}}}}}


def openapi_responses(*groups: dict, api_key: bool, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses` of one route (its 200 body is the route's response_model): its error groups, 401
    when an API key guards it, and the event stream as a second 200 content type when the route streams."""
    out: dict[int | str, dict[str, Any]] = {}
    for g in groups:
        out.update(g)
    if api_key:
        out.update(UNAUTHORIZED)
    if stream:
        out[200] = {"content": STREAM}
    return out


def document(app, api_key: bool) -> None:
    """Make `app.openapi()` this server's truthful document: no 422 entries (validation errors are 400s
    with OpenAI's body) and, under --api-key, the bearer scheme on every guarded route."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if api_key and "401" in op.get("responses", {}):
                    op["security"] = [{"bearer": []}]
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if api_key:
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
