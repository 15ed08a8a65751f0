"""Pooling for embedding requests (PoolingParams): the final hidden states of a request's prompt reduced to
one vector, in the step that computes its last prompt token.

LAST takes the last prompt token's hidden state; MEAN averages every prompt token's, summed chunk by chunk
over the steps of a chunked prefill (a MEAN request reads nothing from the prefix cache, so every position
passes through here, and a preempted one starts again at position 0). Vectors are float32, L2-normalised
unless the request asks otherwise. Invariant: a partial sum exists exactly while a MEAN request is mid-prompt.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from testbed.engine.outputs import SchedulerOutput


class Pooler:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}  # MEAN requests mid-prompt: the sum of their hidden states so far

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.sums.pop(rid, None)

    def pool(self, hidden: torch.Tensor, so: SchedulerOutput) -> list[torch.Tensor | None]:
        """hidden [T, hidden] of the step's flat tokens (each request's new tokens in turn) -> per request,
        the pooled vector of a pooling request whose prompt ends in this step, else None."""
        out: list[torch.Tensor | None] = [None] * so.num_reqs
        end = 0
        for i, (req, before, n) in enumerate(zip(so.requests, so.num_computed_before, so.num_new_tokens)):
            start, end = end, end + n
            pp = req.pooling_params
            if pp is None:
                continue
            last = before + n >= req.num_prompt_tokens
            if pp.pooling_type == "MEAN":
                part = hidden[start:end].float().sum(0)
                if before > 0:
                    prev = self.sums.pop(req.request_id, None)
                    if prev is None:
                        raise RuntimeError(f"request {req.request_id!r}: MEAN pooling resumes at position {before} "
                                           "without the sum of the positions before it")
                    part = part + prev
                if not last:
                    self.sums[req.request_id] = part
                    continue
                vec = part / req.num_prompt_tokens
            elif last:
                vec = hidden[end - 1].float()
            else:
                continue
            out[i] = F.normalize(vec, dim=-1) if pp.normalize else vec
        return out
