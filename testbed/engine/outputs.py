"""Plain-data structs crossing the core's boundary, and the stop checks applied to each new token."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from testbed.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. `requests[i]` computes `num_new_tokens[i]` tokens starting at
    `num_computed_before[i]` (its KV for earlier positions is in its blocks).

    Aggregates (filled by the scheduler, used by cost models and step records):
    prefill tokens belong to requests still inside their prompt; `sum_context_tokens` is the KV
    length attended over, summed over requests (`max_context_tokens` its largest term: the longest
    sequence bounds how fast attention over a batch can finish); `sum_attn_pairs` the number of
    (query, key) pairs; `num_structured_reqs` the requests whose token this step is drawn under a
    grammar (each costs the worker a bitmask fill on the host).

    LoRA (only with enable_lora; engine/lora.py): `lora_slots[i]` is the device slot of request i's adapter
    (-1: the base model), `lora_loads` the adapters put into slots before the step runs, `lora_dropped` the
    adapter ids the host cache drops; `num_lora_tokens` the step's tokens that run an adapter and `num_loras`
    its distinct adapters (cost models).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_before: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # each request's block table (live reference)
    new_req_ids: set[str] = field(default_factory=set)  # first scheduled or resumed: runners (re)build state
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # finished since the previous step
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    sum_context_tokens: int = 0
    sum_attn_pairs: int = 0
    max_context_tokens: int = 0
    num_structured_reqs: int = 0  # requests sampling under a grammar (structured outputs) this step
    has_pooling: bool = False  # a pooling request is live: the runner pools rows that end their prompt
    lora_slots: list[int] | None = None
    lora_loads: list = field(default_factory=list)  # LoRALoad
    lora_dropped: list[int] = field(default_factory=list)
    num_lora_tokens: int = 0
    num_loras: int = 0
    step_state: tuple = ()  # (scheduled at, used blocks, waiting, running, swapped) for the step record
    # KV block moves the worker runs before the forward, in this order (vLLM's names): (GPU block, CPU block)
    # pairs of preempted requests copied out, (CPU block, GPU block) pairs of resumed ones copied back,
    # (source, destination) GPU blocks copied on write (a beam writing into a block it shares)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_swapped_out: int = 0  # preempted requests of this step that were swapped out (the others recompute)
    has_beams: bool = False  # a beam search is running: its rows (its prompt's, its beams') need top logprobs

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    def subset(self, rows: list[int]) -> "SchedulerOutput":
        """The same step restricted to `rows` (to run requests on their own after a failed step);
        the aggregates stay those of the whole step."""
        ids = {self.requests[i].request_id for i in rows}
        return replace(self, requests=[self.requests[i] for i in rows],
                       num_new_tokens=[self.num_new_tokens[i] for i in rows],
                       num_computed_before=[self.num_computed_before[i] for i in rows],
                       block_ids=[self.block_ids[i] for i in rows], new_req_ids=self.new_req_ids & ids,
                       preempted_req_ids=[], blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[],
                       lora_slots=None if self.lora_slots is None else [self.lora_slots[i] for i in rows],
                       lora_loads=[] if self.lora_slots is None else
                       [ld for ld in self.lora_loads if ld.slot in {self.lora_slots[i] for i in rows}])

    @property
    def has_block_ops(self) -> bool:
        """Whether the worker must move KV blocks before this step's forward."""
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no request and no block to move (a step may only swap out its preempted requests)."""
        return not self.requests and not self.has_block_ops


# The error of a request whose logits processing left no token to draw (the executor ends it, the engine goes on).
NO_TOKEN_LEFT = ("no token is left to sample: allowed_token_ids, bad_words, min_tokens and the output constraint "
                 "(response_format, structured_outputs or guided_*) together exclude every token; relax one of them")


@dataclass(slots=True)
class ModelRunnerOutput:
    """What an executor returns: one sampled token per scheduled request (-1 where the request was
    mid-prompt and sampled nothing), optional logprobs, how long the step took (seconds), and optionally
    where that time went (an executor-specific record, e.g. the worker's StepTiming; the core ignores it).
    `errors` maps the requests the executor failed on (their token is -1) to the reason; the core
    ends them with finish_reason "error" and the others go on."""

    sampled_token_ids: list[int]
    duration: float = 0.0
    logprobs: list | None = None  # per request: None or (token_logprob, rank, [(token_id, logprob), ...])
    timing: object | None = None
    errors: dict[str, str] | None = None
    # per request: None or (first prompt position p, logprobs of prompt tokens p + 1, ... in the logprobs' shape)
    prompt_logprobs: list | None = None
    pooler_output: list | None = None  # per request: None or the pooled vector (a pooling request's last chunk)


@dataclass(slots=True)
class EngineCoreOutput:
    """Incremental result for one request after a step (vLLM's EngineCoreOutput; the offline API's RequestOutput,
    testbed/outputs.py, is built from these)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list | None = None
    prompt_logprobs: list | None = None  # with the first token: logprobs of prompt tokens 1.. (SamplingParams.prompt_logprobs)
    pooling_output: list[float] | None = None  # a pooling request's pooled hidden states (finished with it)
    timing: tuple | None = None  # finished: (first scheduled, first token, last token, finished), the core's times
    # a finished beam search: its best beams, best first, as (generated token ids, per token {token id: logprob}
    # of the candidates it was chosen among, cumulative logprob, finish reason)
    beams: list[tuple[list[int], list[dict[int, float]], float, str]] | None = None


def check_stop(req: Request, token: int) -> RequestStatus | None:
    """Status the request finishes with after `token` was appended, or None to go on.

    Order as vLLM: EOS (unless ignore_eos) and stop_token_ids only once min_tokens are out; then
    the length limit (prompt + max_tokens, capped at max_model_len by the core)."""
    if req.token_stops and len(req.output_token_ids) >= req.sampling_params.min_tokens:
        if token == req.eos_token_id and not req.sampling_params.ignore_eos:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in req.sampling_params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if req.num_tokens >= req.length_limit:
        return RequestStatus.FINISHED_LENGTH
    return None
