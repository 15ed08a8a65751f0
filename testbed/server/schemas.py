"""OpenAI request bodies (pydantic, unknown fields ignored) and the OpenAI error body.

Fields follow the OpenAI API plus vLLM's extra sampling parameters (top_k, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, return_token_ids).
Range checks live in the handlers, so each failure names its parameter.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: int = 0
    user: str | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
