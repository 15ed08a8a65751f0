"""Prompt logprobs: the logprob of each prompt token given the tokens before it, for the requests that ask
(SamplingParams.prompt_logprobs), from the hidden states of the step's own chunk.

The hidden state at position p predicts token p + 1, so a chunk covering positions [s, e) of a prompt of
P tokens yields the logprobs of tokens s + 1 .. min(e, P - 1) (token 0 has none). Those token rows are
appended to the step's sampled rows, so the LM head runs once over both (on every tensor-parallel rank
alike) and the sampled rows stay first. Positions already gathered (a prompt recomputed after a
preemption) and requests that have begun their output are skipped. The engine keeps each request's
list and hands it out with its first token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.engine.outputs import SchedulerOutput
from testbed.worker.logits_processors import on_device
from testbed.worker.sampler import gather_logprobs, logprob_lists

SLICE_ROWS = 1024  # log-softmax over at most this many rows at once (float32 [rows, vocab] temporaries)


@dataclass
class PromptLogprobRows:
    """The step's token rows whose logits give prompt logprobs: flat token indices, the prompt token each
    predicts, and per request (its index in the step, first prompt position, count, top-k width)."""

    flat: list[int]
    targets: list[int]
    spans: list[tuple[int, int, int, int]]


def prompt_logprob_rows(so: SchedulerOutput) -> PromptLogprobRows | None:
    flat: list[int] = []
    targets: list[int] = []
    spans: list[tuple[int, int, int, int]] = []
    offset = 0
    for i, (req, start, n) in enumerate(zip(so.requests, so.num_computed_before, so.num_new_tokens)):
        done = req.prompt_logprobs
        if done is not None and not req.output_token_ids:
            s = max(start, len(done))
            e = min(start + n, req.num_prompt_tokens - 1)
            if e > s:
                flat.extend(range(offset + s - start, offset + e - start))
                targets.extend(req.token_ids(s + 1, e + 1))
                spans.append((i, s, e - s, req.sampling_params.prompt_logprobs))
        offset += n
    return PromptLogprobRows(flat, targets, spans) if spans else None


def compute(logits: torch.Tensor, rows: PromptLogprobRows, first: int = 0) -> list[tuple]:
    """gather_logprobs tensors of each slice of `logits` [rows, vocab] (raw model logits of the prompt rows
    first.., in the order of rows.flat)."""
    k = max(span[3] for span in rows.spans)
    targets = on_device(logits, rows.targets[first:first + logits.shape[0]])
    return [gather_logprobs(torch.log_softmax(logits[a:a + SLICE_ROWS].float(), dim=-1),
                            targets[a:a + SLICE_ROWS], k) for a in range(0, logits.shape[0], SLICE_ROWS)]


def to_lists(parts: list[tuple], rows: PromptLogprobRows, num_reqs: int) -> list:
    """Per request of the step: None or (first prompt position, [(logprob, rank, top), ...])."""
    widths = [w for _, _, count, w in rows.spans for _ in range(count)]
    entries: list = []
    for part in parts:
        entries.extend(logprob_lists(part, widths[len(entries):len(entries) + part[0].shape[0]]))
    out: list = [None] * num_reqs
    at = 0
    for i, s, count, _ in rows.spans:
        out[i] = (s, entries[at:at + count])
        at += count
    return out
