"""Request parameters, defined and validated once: SamplingParams (with StructuredOutputsParams) and
PoolingParams with vLLM's names, the checks of prompts, priorities and token ids, and InvalidParam, the error
naming the bad field that the API server answers 400 with. The offline API, the API server, the wire message
to the engine process and the engine all use these classes."""
from __future__ import annotations

import json as _json
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


# repetition_penalty's range: logits divided or multiplied by it stay finite in fp32 (vLLM only asks for > 0)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # the engine stores ids, seeds and priorities as int64
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-30 overflow
MAX_N = 128  # sequences per prompt (OpenAI's bound on `n`)
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's bound)
MAX_LOGIT_BIAS = 100.0  # logit_bias values are clamped to [-100, 100] (OpenAI's range, as vLLM's server)


class InvalidParam(ValueError):
    """A request parameter out of range; `param` names it (the API server answers 400 with it)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param} {reason}")
        self.param = param


def _int_in(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_priority(priority) -> None:
    """A request's scheduling priority must fit the engine's int64."""
    if not _int_in(priority, INT64_MIN, INT64_MAX):
        raise InvalidParam("priority", f"must be an integer in [-2**63, 2**63 - 1], got {priority!r}")


def _is_token(t, vocab_size: int) -> bool:
    try:
        return not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
    except TypeError:
        return False


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Every token id must index the vocabulary (the embedding reads out of bounds otherwise). Integer
    lists and arrays are checked with numpy; anything else id by id."""
    if len(ids) == 0:
        return
    arr = np.asarray(ids) if not isinstance(ids, np.ndarray) else ids
    if arr.ndim == 1 and arr.dtype.kind in "iu" and arr.min() >= 0 and arr.max() < vocab_size:
        return
    for t in ids:
        if not _is_token(t, vocab_size):
            shown = int(t) if isinstance(t, (int, np.integer)) and not isinstance(t, bool) else repr(t)
            raise InvalidParam(param, f"token id {shown} is outside the vocabulary [0, {vocab_size})")


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of sequence `index` of an n > 1 request: seed + index, wrapped into int64."""
    return None if seed is None else (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# stop strings: each new piece of text is searched for every one of them, over a window as long as the longest
MAX_STOP_STRINGS, MAX_STOP_CHARS = 128, 1024
MAX_CONSTRAINT_CHARS = 256 * 1024  # a JSON schema, regex or grammar: larger ones are refused before any parsing
MAX_SCHEMA_DEPTH = 128  # JSON nesting levels of a schema (its parse time grows steeply with depth)


def _check_schema(schema) -> None:
    """InvalidParam when a JSON schema nests deeper than MAX_SCHEMA_DEPTH or refers outside itself: every
    `$ref` must be a local JSON pointer ("#..."), since a file:// or http:// one would silently mean any JSON."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidParam("structured_outputs.json", f"nests deeper than {MAX_SCHEMA_DEPTH} JSON levels")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                raise InvalidParam("structured_outputs.json", f"$ref {ref!r} points outside the schema; only local "
                                                              "references (\"#/$defs/...\") are resolved")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


@dataclass
class StructuredOutputsParams:
    """One constraint on the output text, with vLLM's names: a JSON schema (`json`, a dict or its JSON text),
    a regular expression, a choice among strings, an EBNF grammar (xgrammar's dialect, GBNF-like), or any
    JSON (`json_object=True`). Exactly one is set. `disable_any_whitespace` allows no free whitespace in
    JSON (separators exactly ", " and ": ", as xgrammar and vLLM write them). Construction checks the shape
    (InvalidParam naming the field); whether the schema, regex or grammar compiles is checked by the
    worker's grammar compiler (testbed/worker/grammar_compile.py, which the front-ends call too). A dict
    schema is kept as JSON text."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidParam("structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                                                     f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        if self.json is not None:
            if not isinstance(self.json, str):
                raise InvalidParam("structured_outputs.json", f"must be a JSON schema (an object or its JSON "
                                                              f"text), got {type(self.json).__name__}")
            if len(self.json) > MAX_CONSTRAINT_CHARS:
                raise InvalidParam("structured_outputs.json", f"is {len(self.json)} characters; at most "
                                                              f"{MAX_CONSTRAINT_CHARS} are accepted")
            try:
                schema = _json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise InvalidParam("structured_outputs.json", f"is not valid JSON (or nested too deeply): {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidParam("structured_outputs.json", f"must be a JSON schema object, got "
                                                              f"{type(schema).__name__}")
            _check_schema(schema)
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidParam(f"structured_outputs.{k}", f"must be a non-empty string, got {v!r}")
            if v is not None and len(v) > MAX_CONSTRAINT_CHARS:
                raise InvalidParam(f"structured_outputs.{k}", f"is {len(v)} characters; at most "
                                                              f"{MAX_CONSTRAINT_CHARS} are accepted")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidParam("structured_outputs.choice", f"must be a non-empty list of non-empty strings, "
                                                                f"got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise InvalidParam("structured_outputs.json_object", f"must be true when given, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidParam("structured_outputs.disable_any_whitespace",
                               f"must be a boolean, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> Any:
        """The constraint's value (JSON text, regex, choice list, grammar text, or True)."""
        return getattr(self, self.kind)


def _finite_in(v, lo: float, hi: float) -> bool:
    return _number(v) and lo <= v <= hi


@dataclass
class SamplingParams:
    """Per-request generation settings with vLLM's names and semantics; the one validator of them, for the
    offline API and the API server alike. Construction checks every range that does not depend on the
    model (InvalidParam naming the field) and normalises: `top_k` -1 becomes 0 (off), a temperature below
    SAMPLING_EPS becomes 0 (greedy), logit_bias keys become ints and values are clamped to [-100, 100].
    `verify(vocab_size)` adds the vocabulary-dependent checks.

    The worker applies them in vLLM's order: allowed_token_ids, bad words, min_tokens (stop tokens masked
    until min_tokens are out), logit_bias, then the penalties (repetition over prompt and output,
    frequency and presence over the output, as OpenAI defines them); greedy rows take the argmax there,
    random rows go on with temperature, min_p, top-k and top-p. A grammar (structured_outputs) masks
    first. Logprobs (and prompt logprobs) are of the raw distribution, as vLLM reports them.
    `bad_words` need a tokenizer: `update_from_tokenizer` turns them into `bad_words_token_ids` (the
    offline LLM and the API server call it; the engine only sees the ids). include_stop_str_in_output,
    skip_special_tokens, spaces_between_special_tokens and truncate_prompt_tokens act in the front-end
    (detokenizer, tokenization), before and after the engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _int_in(self.n, 1, MAX_N):
            raise InvalidParam("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        t = self.temperature
        if not (_number(t) and 0 <= t < math.inf):
            raise InvalidParam("temperature", f"must be a finite number >= 0, got {t!r}")
        self.temperature = 0.0 if t < SAMPLING_EPS else float(t)
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidParam("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _int_in(self.top_k, -1, INT64_MAX):
            raise InvalidParam("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _int_in(self.seed, INT64_MIN, INT64_MAX):
            raise InvalidParam("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.max_tokens is not None and not _int_in(self.max_tokens, 1, INT64_MAX):
            raise InvalidParam("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _int_in(self.min_tokens, 0, INT64_MAX):
            raise InvalidParam("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_LOGPROBS):
            raise InvalidParam("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParam("stop", f"strings must be non-empty, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidParam("stop", f"strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
            check_text(s, "stop")
        for t in self.stop_token_ids:
            if not _int_in(t, 0, INT64_MAX):
                raise InvalidParam("stop_token_ids", f"must be token ids (integers >= 0), got {t!r}")
        if self.top_k == -1:
            self.top_k = 0
        self._check_processing()
        self._check_front_end()

    def _check_processing(self) -> None:
        """Penalties, min_p, logit_bias, allowed_token_ids, bad words and structured outputs."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite_in(getattr(self, name), -2.0, 2.0):
                raise InvalidParam(name, f"must be a number in [-2, 2], got {getattr(self, name)!r}")
        r = self.repetition_penalty
        if not _finite_in(r, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
            raise InvalidParam("repetition_penalty", f"must be a number in [{MIN_REPETITION_PENALTY:g}, "
                               f"{MAX_REPETITION_PENALTY:g}] (1 = off; beyond, a penalised logit overflows), got {r!r}")
        if not _finite_in(self.min_p, 0.0, 1.0):
            raise InvalidParam("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParam("logit_bias", f"must map token ids to biases, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    t = int(k) if not isinstance(k, (bool, float)) else None
                except (TypeError, ValueError):
                    t = None
                if t is None or not 0 <= t <= INT64_MAX:
                    raise InvalidParam("logit_bias", f"keys must be token ids (integers >= 0, or their decimal "
                                                     f"strings), got {k!r}")
                if not (_number(v) and math.isfinite(v)):
                    raise InvalidParam("logit_bias", f"values must be finite numbers, got {v!r} for token {t}")
                bias[t] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(v)))
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise InvalidParam("allowed_token_ids", f"must be a non-empty list of token ids, got {ids!r}")
            for t in ids:
                if not _int_in(t, 0, INT64_MAX):
                    raise InvalidParam("allowed_token_ids", f"must be token ids (integers >= 0), got {t!r}")
            self.allowed_token_ids = list(dict.fromkeys(ids))
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
                raise InvalidParam("bad_words", f"must be a list of non-empty strings, got {self.bad_words!r}")
            for w in words:
                check_text(w, "bad_words")
            self.bad_words = list(dict.fromkeys(words)) or None
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, (list, tuple)) or not all(isinstance(q, (list, tuple)) and q for q in seqs):
                raise InvalidParam("bad_words", f"token sequences must be non-empty lists of token ids, got {seqs!r}")
            for q in seqs:
                for t in q:
                    if not _int_in(t, 0, INT64_MAX):
                        raise InvalidParam("bad_words", f"token sequences must hold token ids, got {t!r}")
            self.bad_words_token_ids = [list(q) for q in seqs] or None
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise InvalidParam("structured_outputs", f"must be a StructuredOutputsParams, got {type(so).__name__}")
            so.__post_init__()
            if self.min_tokens:
                raise InvalidParam("min_tokens", "cannot be combined with structured_outputs: the grammar decides "
                                                 "where the output may end (drop min_tokens)")

    def _check_front_end(self) -> None:
        """Fields the detokenizer and the tokenization use (the engine never sees them)."""
        if self.prompt_logprobs is not None and not _int_in(self.prompt_logprobs, 0, MAX_LOGPROBS):
            raise InvalidParam("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], "
                                                  f"got {self.prompt_logprobs!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"must be a boolean, got {getattr(self, name)!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    def update_from_tokenizer(self, tokenizer) -> "SamplingParams":
        """Token sequences of `bad_words`, as vLLM forms them: each word as given (leading spaces stripped) and,
        where it tokenizes to a different first token of the same length, with one leading space (a word
        in the middle of a text)."""
        if not self.bad_words:
            return self
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise InvalidParam("bad_words", f"{word!r} tokenizes to no token")
            seqs.append(list(plain))
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(list(spaced))
        self.bad_words_token_ids = seqs
        return self

    @property
    def needs_processing(self) -> bool:
        """Whether the sampler must process this row's logits before drawing (anything beyond temperature,
        top-k, top-p and min_p): rows that need nothing take the fast path."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids or self.min_tokens
                    or self.structured_outputs is not None)

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def verify(self, vocab_size: int) -> "SamplingParams":
        """Check everything again (a field may have been set after construction) plus what depends on
        the model: top_k up to the vocabulary size, stop_token_ids inside the vocabulary."""
        self.__post_init__()
        if self.top_k > vocab_size:
            raise InvalidParam("top_k", f"must be -1, 0 (off) or in [1, {vocab_size}] (the vocabulary size), "
                                        f"got {self.top_k}")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        if self.logit_bias:
            check_token_ids(list(self.logit_bias), vocab_size, "logit_bias")
        if self.allowed_token_ids:
            check_token_ids(self.allowed_token_ids, vocab_size, "allowed_token_ids")
        if self.bad_words and self.bad_words_token_ids is None:
            raise InvalidParam("bad_words", "need a tokenizer to become token ids (update_from_tokenizer); this "
                                            "model has none: give bad_words_token_ids instead")
        for q in self.bad_words_token_ids or ():
            check_token_ids(q, vocab_size, "bad_words")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_truncate_prompt_tokens(t) -> None:
    """truncate_prompt_tokens is None, -1 (keep max_model_len tokens) or a positive count."""
    if t is not None and not (t == -1 or _int_in(t, 1, INT64_MAX)):
        raise InvalidParam("truncate_prompt_tokens", f"must be an integer >= 1 (keep the last that many prompt "
                                                     f"tokens) or -1 (keep max_model_len), got {t!r}")


def truncate_prompt(ids: Sequence[int], truncate_prompt_tokens: int | None, max_model_len: int) -> Sequence[int]:
    """The last `truncate_prompt_tokens` tokens of a prompt (-1: the last max_model_len; None: all of it)."""
    k = truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise InvalidParam("truncate_prompt_tokens", f"({k}) must not exceed max_model_len ({max_model_len})")
    return ids[-k:]


@dataclass
class BeamSearchParams:
    """A beam search, with vLLM's names (vLLM V1's `LLM.beam_search` and the OpenAI server's `use_beam_search`):
    `beam_width` beams, each step extended by the top 2 x beam_width tokens of every beam (and a token drawn at
    `temperature` when it is above 0), of which the best `beam_width` by cumulative logprob / length **
    `length_penalty` go on; a beam that draws EOS (unless `ignore_eos`) is complete. After `max_tokens` steps the
    best `beam_width` of the complete and running beams are the result. 2 x beam_width is bounded by MAX_LOGPROBS
    (the candidates are a step's top logprobs), so beam_width is at most 10."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _int_in(self.beam_width, 1, MAX_LOGPROBS // 2):
            raise InvalidParam("beam_width", f"must be an integer in [1, {MAX_LOGPROBS // 2}] (each step reads the top "
                                             f"2 x beam_width logprobs, at most {MAX_LOGPROBS}), got {self.beam_width!r}")
        if not _int_in(self.max_tokens, 1, INT64_MAX):
            raise InvalidParam("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"must be a boolean, got {getattr(self, name)!r}")
        t = self.temperature
        if not (_number(t) and 0 <= t < math.inf):
            raise InvalidParam("temperature", f"must be a finite number >= 0, got {t!r}")
        if not (_number(self.length_penalty) and math.isfinite(self.length_penalty)):
            raise InvalidParam("length_penalty", f"must be a finite number, got {self.length_penalty!r}")

    def sampling_params(self) -> SamplingParams:
        """What each beam's row samples with: one token per step, the top 2 x beam_width logprobs with it."""
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, temperature=self.temperature,
                              logprobs=2 * self.beam_width)


POOLING_TYPES = ("LAST", "MEAN")


@dataclass
class PoolingParams:
    """Settings of a pooling (embedding) request, with vLLM's names: the model's final hidden states pooled
    over the prompt, at its last token (LAST, vLLM's default for decoder models) or averaged over every prompt
    token (MEAN), then L2-normalised unless `normalize` is False. `pooling_type` None takes the LLM's or the
    server's pooler config (vLLM sets it per model; here a request may also name it). `dimensions` (a
    Matryoshka truncation) is refused, as vLLM refuses it for models not trained for it. `resolve` fills the
    unset fields from a pooler config; the engine then sees a prompt-only request (no token is sampled).
    `truncate_prompt_tokens` keeps the prompt's last that many tokens (-1: max_model_len), as SamplingParams'."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise InvalidParam("pooling_type", f"must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidParam("normalize", f"must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None:
            raise InvalidParam("dimensions", "is not supported: the served model was not trained for Matryoshka "
                                             "representations, so its embeddings cannot be shortened; leave it out")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    def resolve(self, pooling_type: str = "LAST", normalize: bool = True) -> "PoolingParams":
        """A copy with every unset field taken from the given pooler config."""
        return PoolingParams(self.pooling_type or pooling_type, normalize if self.normalize is None else self.normalize,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


def check_text(text: str, param: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (JSON "\\ud800") cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParam(param, f"holds a lone surrogate {text[e.start]!r} at character {e.start}, which is "
                                  "not valid Unicode text; send UTF-8 text") from None
