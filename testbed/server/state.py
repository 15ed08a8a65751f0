"""ServerState: what every route needs (engine client, tokenizer, limits, metrics) and the request
checks that depend on the served model (name, tokenization, vocabulary).

Tokenization, chat templating and detokenizing a whole prompt run on one worker thread
(`run_blocking`), never on the event loop: a prompt of megabytes takes seconds to tokenize, and
/health and every stream must keep moving meanwhile. One thread, because a tokenizer is not safe
to share between threads; the tokenizers release the GIL while they work.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from testbed.engine.config import PoolerConfig
from testbed.engine.params import InvalidParam, check_token_ids
from testbed.runtime.client import EngineClient
from testbed.text.detokenizer import TokenTexts
from testbed.server.bodies import LargeBodies
from testbed.server.lora import LoRARegistry
from testbed.server.metrics import ServerMetrics
from testbed.server.schemas import APIError, bad_request

T = TypeVar("T")
GRAMMAR_THREADS = 2

if TYPE_CHECKING:
    from testbed.runtime.dp_client import DPEngineClient


@dataclass
class ServerState:
    client: EngineClient | DPEngineClient
    tokenizer: Any | None
    served_model_name: str
    model_path: str
    metrics: ServerMetrics
    max_model_len: int
    vocab_size: int
    num_gpu_blocks: int
    block_size: int
    max_num_waiting: int | None = None
    api_key: str | None = None
    token_texts: TokenTexts | None = None
    scheduling_policy: str = "fcfs"  # a request's priority counts only under "priority"
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)  # how /v1/embeddings pools
    live: dict[str, Any] = field(default_factory=dict)  # core request id -> its serving.Choice, until finished
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))
    # grammar checks: their own threads, so a slow schema holds up neither tokenization nor the event loop
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar"))
    large_bodies: LargeBodies = field(default_factory=LargeBodies)  # request bodies over LARGE_BODY bytes
    structured_outputs_timeout: float = 5.0
    emulated: str | None = None  # --emulate: "GPU, cost model" (reported in /v1/models), else None
    loras: LoRARegistry = field(default_factory=LoRARegistry)  # the LoRA adapters served beside the base model
    _max_prompt_bytes: int | None = field(default=None, repr=False)

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the tokenizer thread (an APIError it raises reaches the caller as raised)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def on_stats(self, stats, scheduled: dict[str, float], engine: int = 0) -> None:
        """A stats snapshot of replica `engine`, with the requests it scheduled for the first time (and when)."""
        self.metrics.update_stats(engine, stats)
        for rid, t in scheduled.items():
            c = self.live.get(rid)
            if c is not None and c.scheduled_time is None:
                c.scheduled_time = t

    def check_model(self, model: str | None):
        """The LoRARequest of the adapter `model` names, None for the base model; 404 for any other name."""
        if model is None or model in (self.served_model_name, self.model_path):
            return None
        lora = self.loras.adapters.get(model)
        if lora is None:
            served = ", ".join(f"`{m}`" for m in [self.served_model_name, *self.loras.adapters])
            raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.",
                           "model", "model_not_found")
        return lora

    @property
    def max_prompt_bytes(self) -> int:
        """UTF-8 bytes above which a text cannot fit max_model_len tokens with this tokenizer: no token covers
        more than 4 bytes a character of its longest vocabulary entry (computed once)."""
        if self._max_prompt_bytes is None:
            vocab = self.tokenizer.get_vocab()
            longest = max((len(t) for t in vocab), default=1)
            self._max_prompt_bytes = (self.max_model_len + 1) * 4 * max(longest, 1)
        return self._max_prompt_bytes

    def tokenize(self, text: str, add_special_tokens: bool = True, bounded: bool = True) -> list[int]:
        """The text's token ids. `bounded` (unless the prompt is to be truncated): a text too long to fit
        max_model_len tokens is refused before it is tokenized (a few megabytes take seconds), with a 400."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer (dummy weights): send prompt token ids instead", "prompt")
        if bounded:
            self.check_text_fits([text], "the prompt", "prompt")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def check_text_fits(self, texts: list[str], what: str, param: str) -> None:
        """A 400 naming `param` when `texts` together are too long to fit max_model_len tokens with this
        tokenizer (max_prompt_bytes), checked before any tokenizing: a few megabytes take seconds."""
        chars = sum(map(len, texts))
        if chars > self.max_model_len and sum(
                len(t.encode("utf-8", "surrogatepass")) for t in texts) > self.max_prompt_bytes:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; {what} of "
                              f"{chars} characters is longer than that can be with this tokenizer, so it was not "
                              "tokenized. Shorten it.", param)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        try:
            check_token_ids(ids, self.vocab_size, param)
        except InvalidParam as e:
            raise bad_request(str(e).removeprefix(f"{param} "), param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
