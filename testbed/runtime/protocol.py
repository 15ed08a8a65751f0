"""Messages between the API server and the engine-core process: msgspec structs on ZMQ (never pickle).

API server -> engine core (one PUSH/PULL pipe): AddRequest, AbortRequests, Shutdown.
Engine core -> API server (another pipe): Ready once the executor is built, then Outputs after every
step or batch of inputs (token deltas + a SchedulerStats snapshot), and EngineError just before the
process dies of an exception. Every struct is tagged, so one decoder reads the whole union.
"""
from __future__ import annotations

from typing import Union

import msgspec

from testbed.engine.lora import LoRARequest
from testbed.engine.params import BeamSearchParams, PoolingParams, SamplingParams

# (logprob of the chosen token, its rank, [(token id, logprob), ...] top-N), as ModelRunnerOutput carries them
TokenLogprob = tuple[float, int, list[tuple[int, float]]]


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """One sequence to generate (`sampling_params`) or one prompt to embed (resolved `pooling_params`), exactly
    one of them. The parameters cross as the classes the front-ends validated (engine/params.py, msgspec
    encodes the dataclasses field by field), so the engine sees the same fields and checks them with the same
    code: decoding runs their validation again, and the engine adds the vocabulary checks (`verify`). `seq`
    numbers adds so the API server knows which ones a stats snapshot already includes (its waiting-bound
    estimate). The engine ignores the front-end's fields (stop strings, detokenization options, bad words as
    text: they cross as bad_words_token_ids). `lora_request`: the LoRA adapter the request runs with (None: the
    base model)."""

    seq: int
    request_id: str
    prompt_token_ids: list[int]
    arrival_time: float
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None
    beam_params: BeamSearchParams | None = None  # a beam search (sampling_params are then its beams')


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
    num_cpu_blocks: int = 0  # the CPU swap pool (swap preemption)


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request after a step (EngineCoreOutput on the wire). Not tracked by the garbage collector
    (gc=False: it holds plain data, never a reference back to itself): the API server decodes one per request a
    step, and tracked ones cost the decode more than twice as much in collections under a burst."""

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
    # a finished beam search's best beams: (token ids, per token {token id: logprob}, cumulative logprob, reason)
    beams: list[tuple[list[int], list[dict[int, float]], float, str]] | None = None


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
    num_swapped: int = 0  # swap preemption: requests in the CPU pool now, its usage, and cumulative counts
    cpu_cache_usage: float = 0.0
    num_swap_preemptions: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    num_deferred: int = 0  # waiting requests the last step passed over for their LoRA adapter (max_loras)
    # LoRA adapter name -> requests using it, running / waiting (Scheduler.lora_adapters; empty without LoRA)
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}


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
