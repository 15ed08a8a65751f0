"""OpenAI request bodies (pydantic) and the OpenAI error body.

Fields follow the OpenAI API plus vLLM's extra sampling parameters (top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, allowed_token_ids, bad_words, prompt_logprobs,
include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens, truncate_prompt_tokens,
return_token_ids, structured_outputs and the guided_* forms of it). Unknown fields are kept aside
(`model_extra`) for the handler to name in one warning and otherwise ignore, as vLLM does (OpenAI's
`user`, an end-user id for abuse monitoring, is one of them). Every field here is honoured; the values
that are not built (tools, tool_choice other than "none", best_of other than n, a priority without
priority scheduling) are refused by the handlers with a 400 naming the field. Every string anywhere in a body must be valid Unicode (no lone surrogate); range
checks live in SamplingParams and the handlers, so each failure names its parameter.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from testbed.engine.params import check_text


class _Strict(BaseModel):
    """Values of the documented JSON types only (no 1.0 or true for an integer, no 1 for a boolean), so the
    OpenAPI document says exactly what is accepted."""

    model_config = ConfigDict(strict=True)


class _Body(_Strict):
    """A request body whose every string (keys, values, unknown fields included) is encodable text. Checked after
    validation from Python objects (a body Python's json module parsed): pydantic's own JSON parser refuses a lone
    surrogate, and a check before validation would make it build the whole body as Python objects first (holding
    the GIL, so the event loop, for a second on a body of a million small lists)."""

    @model_validator(mode="after")
    def _valid_text(self, info: ValidationInfo) -> "_Body":
        if info.mode == "json":
            return self
        todo: list[tuple[Any, str]] = [(self, "")]
        while todo:  # iterative: a deeply nested body must not overflow the stack
            value, path = todo.pop()
            if isinstance(value, BaseModel):
                value = {**value.__dict__, **(value.model_extra or {})}
            if isinstance(value, str):
                check_text(value, path or "body")
            elif isinstance(value, dict):
                for k, v in value.items():
                    todo.append((k, path or "body"))
                    todo.append((v, f"{path}.{k}" if path else str(k)))
            elif isinstance(value, list):
                todo.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        return self


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


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""

    model_config = ConfigDict(extra="allow")

    type: str
    json_schema: dict[str, Any] | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's structured_outputs object (the constraints this server builds; any other key is refused)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _GenerationRequest(_Body):
    model_config = ConfigDict(extra="allow")

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
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False
    priority: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False  # vLLM's extra parameters: a beam search of width n
    length_penalty: float = 1.0


# A prompt: token ids, a batch of them, a batch of texts, or one text. Tried in this order, each list stopping at its
# first bad item: a member that fails on the whole of a megabyte list (the string member, tried first, did) makes
# pydantic build that list as Python objects for its error, holding the GIL (so the event loop) for a second.
Prompt = Annotated[Union[Annotated[list[int], Field(fail_fast=True)], Annotated[list[list[int]], Field(fail_fast=True)],
                         Annotated[list[str], Field(fail_fast=True)], str], Field(union_mode="left_to_right")]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Strict):
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
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body plus vLLM's extras (add_special_tokens, normalize, truncate_prompt_tokens,
    priority); unknown fields are ignored with a warning, as for generation. How the hidden states are pooled is
    the server's --pooler-config; `dimensions` is refused (no Matryoshka model here)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class TokenizeRequest(_Body):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Body):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's body of POST /v1/unload_lora_adapter (lora_int_id is accepted and not needed: names are unique)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
