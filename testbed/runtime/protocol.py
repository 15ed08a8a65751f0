"""Messages between the API server and the engine-core process: msgspec structs on ZMQ (never pickle).

API server -> engine core (one PUSH/PULL pipe): AddRequest, AbortRequests, Shutdown.
Engine core -> API server (another pipe): Ready once the executor is built, then Outputs after every
step or batch of inputs (token deltas + a SchedulerStats snapshot), and EngineError just before the
process dies of an exception. Every struct is tagged, so one decoder reads the whole union.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from testbed.engine.request import SamplingParams, StructuredOutputsParams

# (logprob of the chosen token, its rank, [(token id, logprob), ...] top-N), as ModelRunnerOutput carries them
TokenLogprob = tuple[float, int, list[tuple[int, float]]]


class StructuredOutput(msgspec.Struct, array_like=True):
    """StructuredOutputsParams on the wire: its one constraint (kind, value) and the whitespace option."""

    kind: str
    spec: Union[str, bool, list[str]]
    disable_any_whitespace: bool = False


class Pooling(msgspec.Struct, array_like=True):
    """A pooling (embedding) request's resolved PoolingParams."""

    pooling_type: str
    normalize: bool


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """One sequence to generate, or with `pooling` one prompt to embed (the sampling fields unused). `seq`
    numbers adds so the API server knows which ones a stats snapshot already includes (its waiting-bound
    estimate). Stop strings, detokenization options and bad words as text stay in the API server (bad words
    cross as token ids)."""

    seq: int
    request_id: str
    prompt_token_ids: list[int]
    arrival_time: float
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutput | None = None
    pooling: Pooling | None = None


# AddRequest fields that are SamplingParams fields of the same name (the engine's share of them)
SAMPLING_FIELDS = tuple(f for f in AddRequest.__struct_fields__
                        if f not in ("seq", "request_id", "prompt_token_ids", "arrival_time", "priority",
                                     "structured_outputs", "pooling"))


def engine_fields(sp: SamplingParams) -> dict[str, Any]:
    """The AddRequest fields of what the engine honours in `sp` (seed and priority are per request: the
    caller gives them)."""
    so = sp.structured_outputs
    fields = {f: getattr(sp, f) for f in SAMPLING_FIELDS if f != "seed"}
    fields["structured_outputs"] = None if so is None else StructuredOutput(so.kind, so.spec, so.disable_any_whitespace)
    return fields


def sampling_params(m: AddRequest) -> SamplingParams:
    """The engine's SamplingParams of an AddRequest (validated again by the caller's `verify`)."""
    w = m.structured_outputs
    so = None if w is None else StructuredOutputsParams(**{w.kind: w.spec},
                                                        disable_any_whitespace=w.disable_any_whitespace)
    return SamplingParams(**{f: getattr(m, f) for f in SAMPLING_FIELDS}, structured_outputs=so)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """Sent once the executor is built: what the API server needs to validate requests."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    eos_token_id: int | None
    vocab_size: int
    pid: int


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request after a step (RequestOutput on the wire)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token: prompt tokens 1..
    pooling_output: list[float] | None = None
    timing: tuple[float | None, float | None, float | None, float] | None = None  # set when finished


class SchedulerStats(msgspec.Struct, array_like=True):
    """Gauges and cumulative counters of the core, sampled after a step. `acked_seq` is the last
    AddRequest the snapshot includes. The token counts are EngineCore.token_counts."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    acked_seq: int
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """One step's deltas. `scheduled` maps requests scheduled for the first time to that time
    (for the queue-time histogram); times are time.time() of the engine host."""

    outputs: list[CoreOutput]
    stats: SchedulerStats
    scheduled: dict[str, float] = {}


class EngineError(msgspec.Struct, tag="error", array_like=True):
    message: str
    traceback: str = ""


ToEngine = Union[AddRequest, AbortRequests, Shutdown]
FromEngine = Union[Ready, Outputs, EngineError]

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
