"""The FastAPI app of `testbed serve`: OpenAI routes (completions, chat, embeddings, models), /health,
/metrics, /tokenize, /detokenize, and its OpenAPI document (/openapi.json, browsable at /docs;
responses.py describes every answer).

Every error is answered with OpenAI's body (bad JSON and schema errors too, as 400; a method a path
does not take, 405 with its Allow header). An outer ASGI middleware checks the API key (every route
but /health, /metrics and the document) and bounds the body size (413) before any handler runs,
buffering the body it has read for the app.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from testbed.engine.params import InvalidParam
from testbed.server import responses as R
from testbed.server.chat import create_chat_completion, render_chat
from testbed.server.completions import create_completion
from testbed.server.embeddings import create_embedding
from testbed.server.schemas import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                                    EmbeddingRequest, TokenizeRequest, bad_request)
from testbed.server.bodies import ThreadedBodyRoute
from testbed.server.state import ServerState

OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs")
DOCS_ASSETS = "/docs-assets"  # Swagger UI's files, served from the fastapi-offline package: /docs works offline


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote any text the client sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return ASCIIJSONResponse(e.body(), status_code=e.status, headers=headers)


class GuardMiddleware:
    """API key and body-size bound, as plain ASGI so nothing reads an oversized body first."""

    def __init__(self, app, api_key: str | None, max_bytes: int) -> None:
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not scope["path"].startswith(DOCS_ASSETS):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
            # the scheme is case-insensitive (RFC 7235); the key is compared in constant time
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.api_key.encode()):
                err = APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                                    "with the key given to --api-key", None, "invalid_api_key")
                return await error_response(err)(scope, receive, send)
        too_big = APIError(413, f"request body larger than {self.max_bytes} bytes (--max-request-bytes)", None,
                           "request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_big)(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await error_response(too_big)(scope, receive, send)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)


def mount_docs(app: FastAPI) -> None:
    """/docs: Swagger UI over /openapi.json, its script, style and icon served from the installed
    fastapi-offline package (FastAPI's default loads them from a CDN, a blank page offline). Its Swagger UI is
    5.x, which renders the OpenAPI 3.1 document FastAPI writes (4.x refuses it: "Unable to render this
    definition")."""
    from importlib.resources import files

    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def _docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="testbed API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")


def build_app(state: ServerState, max_request_bytes: int) -> FastAPI:
    from testbed import __version__
    app = FastAPI(title="testbed", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", description="OpenAI-compatible API of `testbed serve` (vLLM's "
                  "extensions included). Every error has OpenAI's body: {\"error\": {message, type, param, code}}.")
    app.state.server = state
    mount_docs(app)
    app.add_middleware(GuardMiddleware, api_key=state.api_key, max_bytes=max_request_bytes)
    keyed = state.api_key is not None
    R.document(app, keyed)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        own = next((x for err in errs if isinstance(x := (err.get("ctx") or {}).get("error"), InvalidParam)), None)
        if own is not None:  # our own check inside the schema: its message and parameter as they are
            return error_response(bad_request(str(own), own.param))
        msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in errs[:5])
        param = next((err["loc"][1] for err in errs if len(err["loc"]) > 1 and isinstance(err["loc"][1], str)), None)
        return error_response(bad_request(f"invalid request: {msg}", param))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), None, None), e.headers)  # 405 keeps Allow

    @app.get("/health", response_model=R.HealthResponse,
             responses={503: {"model": R.ErrorResponse, "description": "No engine serves (`engine_dead`)"}})
    async def health() -> Response:
        """200 while a replica serves (with the dead ones listed when some died), 503 once none does."""
        if state.client.is_dead:
            return error_response(APIError(503, f"engine core is dead: {state.client.dead_reason}", None,
                                           "engine_dead"))
        dead = state.client.dead_engines
        if dead:
            return JSONResponse({"status": "degraded", "dead_engines": {str(r): why for r, why in sorted(dead.items())}})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {R.PROMETHEUS_TEXT: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition (docs/metrics.md)"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=R.ModelList, responses=R.openapi_responses(api_key=keyed))
    async def models() -> JSONResponse:
        """The base model, then each LoRA adapter (its `parent` the base model, as vLLM lists them)."""
        base = {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "testbed",
                "root": state.model_path, "parent": None, "max_model_len": state.max_model_len,
                "vocab_size": state.vocab_size, "emulated": state.emulated}
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": state.served_model_name}
                    for name, lora in state.loras.adapters.items()]
        return JSONResponse({"object": "list", "data": [base, *adapters]})

    # vLLM answers these two in plain text; their errors are JSON like every other route's (response_class
    # Response: FastAPI then documents the error bodies as application/json, and the 200 as declared here)
    said = {200: {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}}}

    @app.post("/v1/load_lora_adapter", response_class=Response,
              responses={**R.openapi_responses(R.BAD_REQUEST, api_key=keyed), **said})
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Serve one more LoRA adapter (a PEFT folder), named by lora_name in the `model` field from now on."""
        await state.run_blocking(state.loras.add, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response,
              responses={**R.openapi_responses(R.BAD_REQUEST, R.MODEL_NOT_FOUND, api_key=keyed), **said})
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Stop serving an adapter (requests already running on it finish)."""
        state.loras.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    generation = R.openapi_responses(R.BAD_REQUEST, R.MODEL_NOT_FOUND, R.GENERATION_ERRORS, api_key=keyed, stream=True)
    plain = R.openapi_responses(R.BAD_REQUEST, R.MODEL_NOT_FOUND, api_key=keyed)

    def post_threaded(path: str, **kw):  # as @app.post, the body validated on a thread (ThreadedBodyRoute)
        def register(endpoint):
            app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=ThreadedBodyRoute, **kw)
            return endpoint
        return register

    @post_threaded("/v1/completions", response_model=R.CompletionResponse, responses=generation)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, req, raw)

    @post_threaded("/v1/chat/completions", response_model=R.ChatCompletionResponse, responses=generation)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, req, raw)

    @post_threaded("/v1/embeddings", response_model=R.EmbeddingResponse,
                   responses=R.openapi_responses(R.BAD_REQUEST, R.MODEL_NOT_FOUND, R.GENERATION_ERRORS, api_key=keyed))
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(state, req, raw)

    @post_threaded("/tokenize", response_model=R.TokenizeResponse, responses=plain)
    async def tokenize(req: TokenizeRequest, raw: Request) -> JSONResponse:
        state.check_model(req.model)
        if req.messages is not None:
            ids = await state.run_blocking(render_chat, state, req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await state.run_blocking(state.tokenize, req.prompt, req.add_special_tokens)
        else:
            raise bad_request("give either prompt (text) or messages (chat)", "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})

    @post_threaded("/detokenize", response_model=R.DetokenizeResponse, responses=plain)
    async def detokenize(req: DetokenizeRequest, raw: Request) -> JSONResponse:
        state.check_model(req.model)
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer (dummy weights)", "tokens")

        def text() -> str:  # a megabyte-long id list is checked on the tokenizer thread too
            state.check_token_ids(req.tokens, "tokens")
            return state.detokenize(req.tokens)
        return JSONResponse({"prompt": await state.run_blocking(text)})

    return app
