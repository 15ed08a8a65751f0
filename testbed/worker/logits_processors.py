"""Logits processing before sampling, batched on the logits' device, for the rows that need it: a grammar
(structured outputs), allowed_token_ids, bad words, min_tokens, logit_bias, and the repetition /
frequency / presence penalties, in vLLM's order and with its semantics:

  repetition  logit / r where it is > 0, logit * r otherwise, for tokens seen in the prompt or the output
  frequency   logit - f * (times the token was generated)
  presence    logit - p * (1 if the token was generated)

Per-request state stays on the device between steps, like the seeded generators: a row of output-token
counts and a row of prompt-token presence per penalised request (rows of [capacity, vocab] tensors,
grown by doubling; freed when the request finishes), and an allowed-token mask per request. The counts
are updated on the device from each step's sampled tokens (`record`), so nothing is read back, and a
token still in flight under async scheduling is counted already. The host builds only small index lists
(bad words, stop tokens under min_tokens, logit_bias entries) for the rows that use them.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from testbed.engine.params import SamplingParams
from testbed.worker.grammar import GrammarStates, unpack_bitmask


class RowContext(NamedTuple):
    """What processing a row needs beyond its SamplingParams. `output_token_ids` holds every token the
    request sampled so far for rows with bad words or a grammar (a token still in flight included); for
    other rows it may lag; `num_output_tokens` is always exact."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_output_tokens: int
    eos_token_id: int | None = None


def on_device(like: torch.Tensor, values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list on `like`'s device without a stream sync (a blocking copy would wait for the GPU)."""
    return torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)


class RowPool:
    """Rows of a [capacity, vocab] device tensor lent to live requests; capacity doubles when full."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.data: torch.Tensor | None = None
        self.rows: dict[str, int] = {}
        self.free: list[int] = []

    def get(self, rid: str, vocab: int, device: torch.device) -> tuple[int, bool]:
        """(row of `rid`, whether it is new: zeroed, for the caller to fill)."""
        row = self.rows.get(rid)
        if row is not None:
            return row, False
        if not self.free:
            old = self.data
            cap = 0 if old is None else old.shape[0]
            self.data = torch.zeros(max(8, 2 * cap), vocab, dtype=self.dtype, device=device)
            if old is not None:
                self.data[:cap] = old
            self.free = list(range(self.data.shape[0] - 1, cap - 1, -1))
        row = self.rows[rid] = self.free.pop()
        self.data[row].zero_()
        return row, True

    def release(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.free.append(row)


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(tokens, dtype=np.int64)).to(device, non_blocking=True)


class LogitsProcessors:
    """Applies every processing step to the rows that need it and keeps their per-request device state."""

    def __init__(self, load_tokenizer: Callable | None = None) -> None:
        self.counts = RowPool(torch.int32)
        self.prompt_seen = RowPool(torch.bool)
        self.allowed: dict[str, torch.Tensor] = {}
        self.grammars = GrammarStates(load_tokenizer or _no_tokenizer)
        self._penalised: tuple[torch.Tensor, torch.Tensor] | None = None  # (local rows, pool rows) of the last apply

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.counts.release(rid)
            self.prompt_seen.release(rid)
            self.allowed.pop(rid, None)
        self.grammars.forget(request_ids)

    def apply(self, x: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[str],
              contexts: Sequence[RowContext]) -> torch.Tensor:
        """Process float32 logits x [n, vocab] of n rows (every one needs processing) in place; returns x."""
        n, vocab = x.shape
        dev = x.device
        inf = float("-inf")
        g = [j for j, p in enumerate(params) if p.structured_outputs is not None]
        if g:
            mask = self.grammars.bitmask([request_ids[j] for j in g], [params[j] for j in g],
                                         [contexts[j].output_token_ids for j in g],
                                         [contexts[j].eos_token_id for j in g], vocab, pin=dev.type == "cuda")
            allowed = unpack_bitmask(mask.to(dev, non_blocking=True), vocab)
            self._mask_rows(x, g, allowed)
        a = [j for j, p in enumerate(params) if p.allowed_token_ids]
        if a:
            self._mask_rows(x, a, torch.stack([self._allowed(request_ids[j], params[j], vocab, dev) for j in a]))
        rows: list[int] = []
        toks: list[int] = []
        for j, p in enumerate(params):
            c = contexts[j]
            if p.bad_words_token_ids:
                longest = max(len(q) for q in p.bad_words_token_ids) - 1
                out = list(c.output_token_ids[max(len(c.output_token_ids) - longest, 0):]) if longest else []
                for q in p.bad_words_token_ids:
                    k = len(q) - 1
                    if k == 0 or (len(out) >= k and out[len(out) - k:] == q[:-1]):
                        rows.append(j)
                        toks.append(q[-1])
            if p.min_tokens and c.num_output_tokens < p.min_tokens:  # stop tokens wait until min_tokens are out
                stops = list(p.stop_token_ids) + ([c.eos_token_id] if c.eos_token_id is not None else [])
                rows.extend([j] * len(stops))
                toks.extend(stops)
        if rows:
            x[on_device(x, rows), on_device(x, toks)] = inf
        rows, toks, vals = [], [], []
        for j, p in enumerate(params):
            if p.logit_bias:
                rows.extend([j] * len(p.logit_bias))
                toks.extend(p.logit_bias)
                vals.extend(p.logit_bias.values())
        if rows:
            x.index_put_((on_device(x, rows), on_device(x, toks)), on_device(x, vals, torch.float32), accumulate=True)
        self._penalised = None
        pen = [j for j, p in enumerate(params) if p.needs_penalties]
        if pen:
            self._penalise(x, pen, params, request_ids, contexts)
        return x

    @staticmethod
    def _mask_rows(x: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> None:
        if len(rows) == x.shape[0]:
            x.masked_fill_(~allowed, float("-inf"))
        else:
            idx = on_device(x, rows)
            x[idx] = x.index_select(0, idx).masked_fill(~allowed, float("-inf"))

    def _allowed(self, rid: str, p: SamplingParams, vocab: int, dev: torch.device) -> torch.Tensor:
        m = self.allowed.get(rid)
        if m is None:
            m = self.allowed[rid] = torch.zeros(vocab, dtype=torch.bool, device=dev)
            m[_ids(p.allowed_token_ids, dev)] = True
        return m

    def _penalise(self, x: torch.Tensor, pen: list[int], params, request_ids, contexts) -> None:
        vocab, dev = x.shape[1], x.device
        slots = []
        for j in pen:
            rid, c = request_ids[j], contexts[j]
            row, new = self.counts.get(rid, vocab, dev)
            self.prompt_seen.get(rid, vocab, dev)
            if new:  # first step of this request here: its prompt, and whatever it generated before
                self.prompt_seen.data[self.prompt_seen.rows[rid], _ids(c.prompt_token_ids, dev)] = True
                if len(c.output_token_ids):
                    self.counts.data[row].index_add_(0, _ids(c.output_token_ids, dev),
                                                     torch.ones(len(c.output_token_ids), dtype=torch.int32,
                                                                device=dev))
            slots.append(row)
        idx = on_device(x, pen)
        rows = on_device(x, slots)
        prompt_rows = on_device(x, [self.prompt_seen.rows[request_ids[j]] for j in pen])
        counts = self.counts.data.index_select(0, rows)
        generated = counts > 0
        seen = self.prompt_seen.data.index_select(0, prompt_rows) | generated
        y = x.index_select(0, idx)
        rep = on_device(x, [params[j].repetition_penalty for j in pen], torch.float32).unsqueeze(1)
        freq = on_device(x, [params[j].frequency_penalty for j in pen], torch.float32).unsqueeze(1)
        pres = on_device(x, [params[j].presence_penalty for j in pen], torch.float32).unsqueeze(1)
        y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - freq * counts - pres * generated
        x[idx] = y
        self._penalised = (idx, rows)

    def record(self, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled for the penalised rows of the last `apply` (on the device)."""
        if self._penalised is None:
            return
        idx, rows = self._penalised
        self._penalised = None
        sampled = tokens.index_select(0, idx)
        self.counts.data.index_put_((rows, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True)


def _no_tokenizer():
    raise RuntimeError("structured outputs need the model's tokenizer; this worker has none (dummy weights?)")
