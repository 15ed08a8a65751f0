"""Simulated requests and results: a trace line as the engine Request it stands for, and what a simulation
returns. Shared by every simulator driver (cluster.py, recorded_dp.py) and by run.py's checks."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from testbed.engine.core import EngineCore
from testbed.engine.metrics import Recorder
from testbed.engine.params import BeamSearchParams, SamplingParams
from testbed.engine.request import Request
from testbed.workload.trace import TraceRequest, synthesize_prompt


class LazyPrompt(Sequence[int]):
    """A trace request's prompt tokens, synthesised on first read (only prefix caching reads them)."""

    __slots__ = ("_req", "_vocab", "_seed", "_tokens")

    def __init__(self, req: TraceRequest, vocab_size: int, seed: int) -> None:
        self._req, self._vocab, self._seed, self._tokens = req, vocab_size, seed, None

    def __len__(self) -> int:
        return self._req.input_tokens

    def tolist(self) -> list[int]:
        return self._materialize().tolist()

    def __getitem__(self, i):  # type: ignore[override]
        return self._materialize()[i]

    def _materialize(self):
        if self._tokens is None:
            self._tokens = synthesize_prompt(self._req, self._vocab, self._seed)
        return self._tokens


@functools.lru_cache(maxsize=4096)
def _sampling_params(output_tokens: int, structured_output: bool) -> SamplingParams:
    """One validated SamplingParams per (output length, grammar) shared by the requests that have them (the
    engine only reads a request's sampling params)."""
    return TraceRequest("", 0.0, 1, output_tokens, structured_output=structured_output).sampling_params()


@functools.lru_cache(maxsize=4096)
def _beam_params(width: int, output_tokens: int) -> BeamSearchParams:
    return TraceRequest("", 0.0, 1, output_tokens, beam_width=width).beam_params()


def trace_to_request(tr: TraceRequest, vocab_size: int, seed: int, loras: dict | None = None) -> Request:
    """Engine request for a trace line: its output forced to the trace's length, its adapter from `loras`
    (workload/lora.py's trace_loras) when it names one; a beam search of that many steps when it has a
    beam_width."""
    prompt = tr.prompt_token_ids if tr.prompt_token_ids is not None else LazyPrompt(tr, vocab_size, seed)
    bp = None if tr.beam_width is None else _beam_params(tr.beam_width, tr.output_tokens)
    sp = _sampling_params(tr.output_tokens, tr.structured_output) if bp is None else bp.sampling_params()
    return Request(tr.id, prompt, sp, arrival_time=tr.arrival_s, priority=tr.priority,
                   lora_request=None if tr.lora is None else loras[tr.lora], beam_params=bp)


@dataclass
class SimResult:
    engines: list[EngineCore]
    records: Recorder
    sim_time: float
    prefix_queries: int
    prefix_hits: int
    fast_forwarded_steps: int = 0  # of the steps in the records, those advanced by engine/fast_forward.py

    @classmethod
    def collect(cls, engines: list[EngineCore], records: Recorder, sim_time: float) -> "SimResult":
        """The result of a run: `records` plus every replica's, and the prefix-cache totals."""
        for e in engines:
            records.extend(e.records)
        return cls(engines, records, sim_time, sum(e.block_manager.prefix_queries for e in engines),
                   sum(e.block_manager.prefix_hits for e in engines))
