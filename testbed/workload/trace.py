"""Request traces: load the project's JSONL, Azure CSV, Mooncake JSONL, length-only CSVs, and the
requests a run directory recorded (so a simulation or a replay can serve exactly what a run served).

Every loader returns requests ordered by arrival (stable) with the first arrival at 0.0 s.
Bad input never gets skipped: it raises TraceError("FILE:LINE: reason (how to fix)").
`synthesize_prompt` turns lengths and hash_ids into deterministic token ids, so equal hash ids
give equal token runs and shared prefixes really hit a prefix cache.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.engine.params import MAX_LOGPROBS, BeamSearchParams, SamplingParams, StructuredOutputsParams

FORMATS = ("auto", "jsonl", "azure", "mooncake", "lengths")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTHS_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
JSONL_FIELDS = ("id", "arrival_s", "input_tokens", "output_tokens", "prompt_token_ids",
                "hash_ids", "hash_block_size", "priority", "structured_output", "lora", "beam_width")
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_AZURE_ROW = re.compile(_TIMESTAMP.pattern + r",([1-9][0-9]*),([1-9][0-9]*)")  # TIMESTAMP,ContextTokens,GeneratedTokens


MAX_ARRIVAL_S = 1e9  # about 32 years: a later arrival is a unit mistake (ms for s), not a trace
MAX_HASH_BLOCK_SIZE = 1 << 24  # tokens per hash id: longer than any context
REJECTED_OUTPUT_TOKENS = 1 << 40  # a run directory's rejected request asks for this many: every engine refuses it


class TraceError(ValueError):
    """A bad trace file; the message is always "FILE:LINE: reason (how to fix)"."""

    def __init__(self, path, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line = str(path), line


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace. Invariant after loading: token counts > 0, arrival_s >= 0, and
    hash_ids (if any) has exactly ceil(input_tokens / hash_block_size) entries."""

    id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prompt_token_ids: list[int] | None = None
    hash_ids: list[int] | None = None
    hash_block_size: int = 512
    priority: int = 0
    structured_output: bool = False  # generated under a grammar (structured outputs: any JSON)
    lora: str | None = None  # the LoRA adapter it runs with, by name (None: the base model)
    beam_width: int | None = None  # a beam search of this width (None: one sequence)

    def beam_params(self) -> BeamSearchParams | None:
        """A beam search of beam_width beams for output_tokens steps, EOS ignored (None for one sequence)."""
        return None if self.beam_width is None else BeamSearchParams(self.beam_width, self.output_tokens,
                                                                     ignore_eos=True)

    def sampling_params(self) -> SamplingParams:
        """How a simulation or a replay generates it: greedy, exactly output_tokens tokens, under a JSON
        grammar when structured_output (the cost of structured outputs, not a schema, is what is studied)."""
        return SamplingParams(max_tokens=self.output_tokens, ignore_eos=True, temperature=0.0,
                              structured_outputs=StructuredOutputsParams(json_object=True)
                              if self.structured_output else None)


def load_trace(path, *, request_rate: float | None = None, burstiness: float = 1.0, seed: int = 0,
               limit: int | None = None, fmt: str = "auto") -> list[TraceRequest]:
    """Load a trace ordered by arrival, first arrival 0.0. With `request_rate` (req/s) the arrival
    times are replaced by a gamma process (shape `burstiness`, 1 = Poisson) seeded by `seed`, as
    vLLM's `--request-rate`/`--burstiness`; length-only traces require it. `limit` keeps the
    first N requests."""
    if fmt not in FORMATS:
        raise ValueError(f"--trace-format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit must be a positive integer; got {limit!r}")
    check_arrivals(request_rate, burstiness)
    path = Path(path)
    if path.is_dir():
        if fmt != "auto":
            raise ValueError(f"{path} is a run directory, read as the trace of the requests it recorded; "
                             f"drop --trace-format {fmt}")
        reqs = _load_run(path)
    else:
        data = path.read_bytes()  # FileNotFoundError names the path
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise TraceError(path, data[:e.start].count(b"\n") + 1, f"not UTF-8 text (byte {data[e.start]:#04x} at "
                                                                     f"offset {e.start}); is it a binary or compressed "
                                                                     "file?") from None
        lines = [line.rstrip("\r") for line in text.split("\n")]
        if not any(line.strip() for line in lines):
            raise TraceError(path, 1, "empty trace file (write one request per line; see traces/README.md)")
        fmt = _detect(path, lines) if fmt == "auto" else fmt
        if fmt == "lengths" and request_rate is None:
            raise TraceError(path, 1, "a length-only trace has no arrival times "
                                      "(give them a rate: --request-rate R, e.g. --request-rate 5)")
        reqs = {"jsonl": _load_jsonl, "azure": _load_azure, "mooncake": _load_mooncake,
                "lengths": _load_lengths}[fmt](path, lines)
    if not reqs:
        raise TraceError(path, 1, "no requests after the header (add data rows)")
    reqs.sort(key=lambda r: r.arrival_s)  # stable: equal arrivals keep file order
    reqs = reqs[:limit]
    start = reqs[0].arrival_s
    for r in reqs:
        r.arrival_s -= start
    if request_rate is not None:
        for r, t in zip(reqs, gamma_arrivals(len(reqs), request_rate, burstiness, seed)):
            r.arrival_s = t
    return reqs


def check_arrivals(request_rate: float | None, burstiness: float) -> None:
    """ValueError, in the flags' words, unless --request-rate (None: the trace's own arrivals) is > 0 (inf: all at
    once) and --burstiness a finite number > 0."""
    if request_rate is not None and not (request_rate > 0):  # also rejects NaN
        raise ValueError(f"--request-rate must be > 0 req/s (or inf: all at once), got {request_rate!r}")
    if not (0 < burstiness < math.inf):
        raise ValueError(f"--burstiness must be a finite number > 0 (1 = Poisson), got {burstiness!r}")


def gamma_arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """n arrival times starting at 0 with gamma inter-arrivals of mean 1/rate (inf: all at 0), shape
    `burstiness` (1 = Poisson); the same seed gives the same times in sim and in `bench serve`."""
    check_arrivals(rate, burstiness)
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def _detect(path: Path, lines: list[str]) -> str:
    first_no, first = next((i + 1, l) for i, l in enumerate(lines) if l.strip())
    if first.lstrip().startswith("{"):
        obj = _json_object(path, first_no, first)
        if "timestamp" in obj and "input_length" in obj:
            return "mooncake"
        if set(obj) & set(JSONL_FIELDS):
            return "jsonl"
        raise TraceError(path, first_no, "unrecognised JSON trace: expected `arrival_s` (project JSONL) or "
                                         "`timestamp` + `input_length` (Mooncake); or name the format with --trace-format")
    header = [c.strip() for c in first.split(",")]
    if AZURE_COLUMNS[0] in header:
        return "azure"
    if LENGTHS_COLUMNS[0] in header:
        return "lengths"
    raise TraceError(path, first_no, f"unrecognised trace header (expected JSONL, {','.join(AZURE_COLUMNS)} or "
                                     f"{','.join(LENGTHS_COLUMNS)}; or name the format with --trace-format)")


def _json_object(path, no: int, line: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(path, no, f"bad JSON: {e.msg} at column {e.colno} (one JSON object per line)") from None
    if not isinstance(obj, dict):
        raise TraceError(path, no, f"expected a JSON object, got {type(obj).__name__} (one object per line)")
    return obj


def _int(path, no: int, name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, no, f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, no, f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise TraceError(path, no, f"{name} must be <= {maximum}, got {value}")
    return value


def _bool(path, no: int, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TraceError(path, no, f"{name} must be true or false, got {value!r}")
    return value


def _seconds(path, no: int, name: str, value, maximum: float = MAX_ARRIVAL_S) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(path, no, f"{name} must be a finite number >= 0, got {value!r}")
    if value > maximum:
        raise TraceError(path, no, f"{name} must be at most {maximum:g}, got {value!r} (a unit mistake?)")
    return float(value)


def _hash_ids(path, no: int, ids, input_tokens: int, block: int) -> list[int]:
    if not isinstance(ids, list) or any(
            isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 2**63 for h in ids):
        raise TraceError(path, no, "hash_ids must be a list of integers in [0, 2**63)")
    need = -(-input_tokens // block)
    if len(ids) != need:
        raise TraceError(path, no, f"hash_ids has {len(ids)} ids but {input_tokens} input tokens in blocks "
                                   f"of {block} need exactly {need} (one id per block, last one partial)")
    return ids


def _data_lines(lines: list[str], start: int = 0):
    """(1-based line number, line) for every non-blank line from index `start`."""
    return ((i + 1, lines[i]) for i in range(start, len(lines)) if lines[i].strip())


def _load_jsonl(path, lines) -> list[TraceRequest]:
    reqs, seen = [], set()
    for no, line in _data_lines(lines):
        d = _json_object(path, no, line)
        unknown = set(d) - set(JSONL_FIELDS)
        if unknown:
            raise TraceError(path, no, f"unknown field(s) {sorted(unknown)} (allowed: {', '.join(JSONL_FIELDS)})")
        for name in ("arrival_s", "output_tokens"):
            if name not in d:
                raise TraceError(path, no, f"missing field `{name}` (see traces/README.md for the schema)")
        rid = d.get("id", str(no - 1))
        if not isinstance(rid, str) or not rid:
            raise TraceError(path, no, f"id must be a non-empty string, got {rid!r}")
        if rid in seen:
            raise TraceError(path, no, f"duplicate id {rid!r} (ids must be unique)")
        seen.add(rid)
        ptids, hids = d.get("prompt_token_ids"), d.get("hash_ids")
        if ptids is not None and hids is not None:
            raise TraceError(path, no, "give either prompt_token_ids or hash_ids, not both")
        if ptids is not None:
            if not isinstance(ptids, list) or not ptids or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ptids):
                raise TraceError(path, no, "prompt_token_ids must be a non-empty list of non-negative integers")
            d.setdefault("input_tokens", len(ptids))
        if "input_tokens" not in d:
            raise TraceError(path, no, "missing field `input_tokens` (or give prompt_token_ids)")
        n_in = _int(path, no, "input_tokens", d["input_tokens"])
        if ptids is not None and n_in != len(ptids):
            raise TraceError(path, no, f"input_tokens is {n_in} but prompt_token_ids has {len(ptids)} "
                                       "ids (drop input_tokens or make them equal)")
        if "hash_block_size" in d and hids is None:
            raise TraceError(path, no, "hash_block_size given without hash_ids (add hash_ids or drop it)")
        block = _int(path, no, "hash_block_size", d.get("hash_block_size", 512), maximum=MAX_HASH_BLOCK_SIZE)
        reqs.append(TraceRequest(
            rid, _seconds(path, no, "arrival_s", d["arrival_s"]), n_in,
            _int(path, no, "output_tokens", d["output_tokens"]), ptids,
            None if hids is None else _hash_ids(path, no, hids, n_in, block), block,
            _int(path, no, "priority", d.get("priority", 0), minimum=-(2**63), maximum=2**63 - 1),
            _bool(path, no, "structured_output", d.get("structured_output", False)),
            _name(path, no, "lora", d.get("lora")),
            None if d.get("beam_width") is None else
            _int(path, no, "beam_width", d["beam_width"], maximum=MAX_LOGPROBS // 2)))
    return reqs


def _name(path, no: int, name: str, value) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise TraceError(path, no, f"{name} must be a non-empty string (an adapter's name) or absent, got {value!r}")
    return value


def _load_mooncake(path, lines) -> list[TraceRequest]:
    reqs = []
    for i, (no, line) in enumerate(_data_lines(lines)):
        d = _json_object(path, no, line)
        for name in ("timestamp", "input_length", "output_length"):
            if name not in d:
                raise TraceError(path, no, f"missing field `{name}` (Mooncake lines need timestamp in ms, "
                                           "input_length, output_length, hash_ids)")
        n_in = _int(path, no, "input_length", d["input_length"])
        hids = d.get("hash_ids")
        reqs.append(TraceRequest(
            f"mooncake-{i}", _seconds(path, no, "timestamp", d["timestamp"], MAX_ARRIVAL_S * 1000) / 1000.0, n_in,
            _int(path, no, "output_length", d["output_length"]),
            hash_ids=None if hids is None else _hash_ids(path, no, hids, n_in, 512)))
    return reqs


def _csv_header(path, lines, columns: tuple[str, ...]) -> tuple[int, list[str], list[int]]:
    """(line number, names, index of each of `columns` in them) of the header, which must name every column."""
    header_no, header = next(_data_lines(lines))
    names = [c.strip() for c in header.split(",")]
    missing = [c for c in columns if c not in names]
    if missing:
        raise TraceError(path, header_no, f"missing column(s) {missing} in header {names} "
                                          f"(need {','.join(columns)})")
    return header_no, names, [names.index(c) for c in columns]


def _csv_cells(path, no: int, line: str, width: int, idx: list[int]) -> list[str]:
    """The cells at `idx` of a data row of `width` cells."""
    cells = line.split(",")
    if len(cells) != width:
        raise TraceError(path, no, f"expected {width} cells like the header, got {len(cells)}")
    return [cells[j].strip() for j in idx]


def _csv_rows(path, lines, columns: tuple[str, ...]):
    """(line number, cells of `columns`) for each data row; header must name every column."""
    header_no, names, idx = _csv_header(path, lines, columns)
    for no, line in _data_lines(lines, header_no):
        yield no, _csv_cells(path, no, line, len(names), idx)


def _csv_int(path, no: int, name: str, cell: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        raise TraceError(path, no, f"{name} must be an integer, got {cell!r}") from None
    return _int(path, no, name, value)


def _load_lengths(path, lines) -> list[TraceRequest]:
    return [TraceRequest(f"lengths-{i}", 0.0, _csv_int(path, no, LENGTHS_COLUMNS[0], a),
                         _csv_int(path, no, LENGTHS_COLUMNS[1], b))
            for i, (no, (a, b)) in enumerate(_csv_rows(path, lines, LENGTHS_COLUMNS))]


def _load_azure(path, lines) -> list[TraceRequest]:
    """Azure LLM inference trace; timestamps parsed exactly to integer nanoseconds. A row of the published layout
    (TIMESTAMP,ContextTokens,GeneratedTokens; plain positive counts) is read in one match (_AZURE_ROW); any other
    row cell by cell, with the checks that name what is wrong in it."""
    days: dict[str, int] = {}
    stamps, reqs = [], []
    header_no, names, idx = _csv_header(path, lines, AZURE_COLUMNS)
    row = _AZURE_ROW.fullmatch if names == list(AZURE_COLUMNS) else lambda line: None
    for i, (no, line) in enumerate(_data_lines(lines, header_no)):
        m = row(line)
        if m is not None:
            date, hh, mm, ss, frac, ctx, gen = m.groups()
            ts, ctx, gen = None, int(ctx), int(gen)  # ts: the cell, wanted only to name it
        else:
            ts, ctx, gen = _csv_cells(path, no, line, len(names), idx)
            m = _TIMESTAMP.fullmatch(ts)
            date = hh = mm = ss = frac = None
            if m is not None:
                date, hh, mm, ss, frac = m.groups()
        try:
            if date is None:
                raise ValueError
            if date not in days:
                days[date] = datetime.date.fromisoformat(date).toordinal()
            hh, mm, ss = int(hh), int(mm), int(ss)
            if hh > 23 or mm > 59 or ss > 59:
                raise ValueError
        except ValueError:
            ts = line.partition(",")[0] if ts is None else ts
            raise TraceError(path, no, f"bad TIMESTAMP {ts!r} (expected YYYY-MM-DD HH:MM:SS[.fraction])") from None
        secs = days[date] * 86400 + hh * 3600 + mm * 60 + ss
        stamps.append(secs * 10**9 + int((frac or "0").ljust(9, "0")))
        if isinstance(ctx, str):
            ctx, gen = _csv_int(path, no, AZURE_COLUMNS[1], ctx), _csv_int(path, no, AZURE_COLUMNS[2], gen)
        reqs.append(TraceRequest(f"azure-{i}", 0.0, ctx, gen))
    t0 = min(stamps, default=0)
    for r, ns in zip(reqs, stamps):
        r.arrival_s = (ns - t0) / 1e9
    return reqs


def _load_run(path: Path) -> list[TraceRequest]:
    """The requests a run directory recorded (testbed.runs.rundir), with their ids, arrivals, priorities and the
    input and output tokens they were served with, in arrival order (ties in the order the engine received them,
    its `seq`, so a replay queues them as the run did; prompts are not recorded, so a run whose requests hit the
    prefix cache is a RunDirError).
    A request the engine rejected is kept, asking for
    REJECTED_OUTPUT_TOKENS (more than any max_model_len), so a replay sees it arrive and rejects it too, whatever
    the run's reason was (a data-parallel run routed it first); one that failed or was aborted before its first
    token has no output length to reproduce and is left out."""
    from testbed.runs.rundir import RunDirError, read_run
    run = read_run(path)
    names = run.request_column_names()
    lora = ["lora"] if "lora" in names else []  # runs with LoRA adapters have it
    seq = ["replica", "seq"] if "seq" in names else []  # runs written before it: requests in the order they ended
    req = run.requests(columns=["request_id", "arrival", "input_tokens", "output_tokens", "priority",
                                "finish_reason", "cached_tokens", *lora, *seq])
    if (run.manifest.get("config") or {}).get("enable_prefix_caching") and (req["cached_tokens"] > 0).any():
        source = (run.manifest.get("trace") or {}).get("path")
        raise RunDirError(f"{path}: this run's requests hit the prefix cache, and the prompts they shared are not in "
                          "the run directory, so it cannot be its own trace (a replay would miss where the run hit); "
                          "give the trace it served instead"
                          + (f" (its manifest names {source}, with the run's --request-rate, --burstiness and --limit)"
                             if source else ""))
    if seq:  # requests that arrived at the same instant were queued in the order their engine received them
        req = req.sort_values(["arrival", "replica", "seq"], kind="stable")
    rejected = req["finish_reason"] == "rejected"
    req = req[((req["output_tokens"] >= 1) | rejected) & (req["input_tokens"] >= 1)].copy()
    req.loc[rejected, "output_tokens"] = REJECTED_OUTPUT_TOKENS
    if req["arrival"].isna().any():
        raise RunDirError(f"{path}: requests.parquet has a request without an arrival time (re-run the command "
                          "that wrote it)")
    if not len(req):
        raise RunDirError(f"{path}: no request of this run produced output, so there is no workload to reproduce")
    return [TraceRequest(str(r.request_id), float(r.arrival), int(r.input_tokens), int(r.output_tokens),
                         priority=int(r.priority), lora=_adapter(getattr(r, "lora", None)))
            for r in req.itertuples(index=False)]


def _adapter(name) -> str | None:
    """A run's `lora` cell: the adapter's name, or None (a null cell, NaN in pandas)."""
    return name if isinstance(name, str) else None


def write_jsonl(requests: list[TraceRequest], path) -> None:
    """Write requests in the project's JSONL format (one object per line, optional fields only when set)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            d = {"id": r.id, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                 "output_tokens": r.output_tokens}
            if r.prompt_token_ids is not None:
                d["prompt_token_ids"] = list(r.prompt_token_ids)
            if r.hash_ids is not None:
                d["hash_ids"], d["hash_block_size"] = list(r.hash_ids), r.hash_block_size
            if r.priority:
                d["priority"] = r.priority
            if r.lora is not None:
                d["lora"] = r.lora
            if r.beam_width is not None:
                d["beam_width"] = r.beam_width
            f.write(json.dumps(d) + "\n")


_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Counter-based 64-bit mixer (uint64 arrays wrap mod 2**64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def synthesize_prompt(req: TraceRequest, vocab_size: int, seed: int = 0, reserved: int = 0) -> np.ndarray:
    """Deterministic int32 token ids in [reserved, vocab_size), len == input_tokens. Each hash id h
    maps to a fixed run of hash_block_size ids depending only on (h, seed); without hash_ids the
    run depends on (req.id, seed). prompt_token_ids, when present, are returned as they are."""
    if not 0 <= reserved < vocab_size:
        raise ValueError(f"need 0 <= reserved < vocab_size; got reserved={reserved}, vocab_size={vocab_size}")
    if req.prompt_token_ids is not None:
        ids = np.asarray(req.prompt_token_ids, dtype=np.int64)
        if ids.size and ids.max() >= vocab_size:
            raise ValueError(f"request {req.id}: prompt token id {ids.max()} >= vocab_size {vocab_size}")
        return ids.astype(np.int32)
    n = req.input_tokens
    seed_key = np.array([seed & _M64], dtype=np.uint64)
    if req.hash_ids is not None:  # token t is the (t % bs)-th of hash id t // bs: O(n) whatever bs is
        bs = req.hash_block_size
        keys = _splitmix64(np.asarray(req.hash_ids, dtype=np.uint64) ^ _splitmix64(seed_key))
        t = np.arange(n, dtype=np.uint64)
        counters = keys[t // np.uint64(bs)] + t % np.uint64(bs)
    else:  # domain-separated from hash-id keys by hashing the id string with a prefix
        digest = hashlib.blake2b(f"id:{req.id}".encode(), digest_size=8).digest()
        key = _splitmix64(np.array([int.from_bytes(digest, "little")], dtype=np.uint64) ^ seed_key)
        counters = key + np.arange(n, dtype=np.uint64)
    tokens = _splitmix64(counters) % np.uint64(vocab_size - reserved) + np.uint64(reserved)
    return tokens.astype(np.int32)
