"""Sampling for one step: logits processing, greedy, temperature, min-p, top-k, top-p, per-request seeds,
and logprobs.

Rows are independent: a request with a seed draws from its own torch.Generator, so its tokens
do not depend on what else is in the batch. Rows that need processing (penalties, logit_bias,
allowed_token_ids, bad words, min_tokens, a grammar: SamplingParams.needs_processing) go through
LogitsProcessors first, greedy ones included; the others take the fast path untouched. Logprobs are of
the model's raw distribution (before processing, temperature, top-k, top-p, min-p), as vLLM reports
them, each with the token's rank in it (1 = most likely). A processed row left with no token (its
constraints exclude every one) is drawn from a uniform row instead, so the device never sees NaN
probabilities, and reported as token -1.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from testbed.engine.params import SamplingParams
from testbed.worker.logits_processors import LogitsProcessors, RowContext, on_device as _on


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index of the maximum) in two passes over power-of-2 chunks of the vocabulary:
    a single-row argmax over a 128k vocabulary otherwise runs as one slow block-wide reduction."""
    n, vocab = logits.shape
    chunks = min(64, vocab & -vocab)  # the largest power of two <= 64 dividing the vocabulary
    if chunks < 8 or n > 64:
        return logits.argmax(dim=-1)
    best, where = logits.view(n, chunks, vocab // chunks).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (where.gather(1, chunk) + chunk * (vocab // chunks)).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple:
    """(logprob of each row's token [n], its rank [n] (how many tokens are at least as likely, itself included:
    1 for the most likely, as vLLM counts), top-k values [n, k] and ids [n, k], both None when k == 0)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    rank = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    return chosen.squeeze(1), rank, top.values if top else None, top.indices if top else None


def logprob_lists(lp: tuple, widths: Sequence[int | None]) -> list:
    """Host rows of `gather_logprobs` tensors (waits for them): per row None (width None) or
    (token logprob, rank, [(token id, logprob), ...] of its top `width`)."""
    chosen, rank = lp[0].tolist(), lp[1].tolist()
    top_v = lp[2].tolist() if lp[2] is not None else None
    top_i = lp[3].tolist() if lp[3] is not None else None
    return [None if w is None else (chosen[r], rank[r], list(zip(top_i[r][:w], top_v[r][:w])) if w > 0 else [])
            for r, w in enumerate(widths)]


class Sampler:
    """Draws each step's tokens; holds the per-request state sampling needs across steps (seeded
    generators, penalty counts, allowed-token masks, grammar matchers) until `forget`.
    `load_tokenizer`: gives the model's tokenizer, which grammars need (loaded on first use)."""

    def __init__(self, device: torch.device, seed: int = 0, load_tokenizer: Callable | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.processors = LogitsProcessors(load_tokenizer)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.request_generators.pop(rid, None)
        self.processors.forget(request_ids)

    def _generator(self, rid: str, seed: int) -> torch.Generator:
        g = self.request_generators.get(rid)
        if g is None:
            g = self.request_generators[rid] = torch.Generator(device=self.device)
            g.manual_seed(seed)
        return g

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                 contexts: Sequence[RowContext | None] | None = None) -> tuple[list[int], list | None]:
        """logits [n, vocab] -> (token per row (-1: no token left), per-row logprobs or None)."""
        return self.to_lists(self.sample(logits, params, request_ids, contexts), params)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
               contexts: Sequence[RowContext | None] | None = None
               ) -> tuple[torch.Tensor, tuple | None, torch.Tensor | None]:
        """Draw on the device without reading anything back: (tokens [n], logprob tensors or None, the rows
        processing left with no token [n] bool or None). The logprob tensors are `gather_logprobs'` with k
        the largest asked. `contexts`: a RowContext for
        each row that needs processing (None elsewhere), or None when no row does (the fast path: no scan).
        Greedy rows take the argmax of the logits as they come (upcasting is exact, so bf16 and float32
        agree); processing and probabilities are in float32."""
        raw = logits
        proc = [] if contexts is None else [j for j, p in enumerate(params) if p.needs_processing]
        stuck = None
        if proc:
            logits = self._process(raw, proc, params, request_ids, contexts)
            stuck = (logits == float("-inf")).all(dim=-1)
            logits = logits.masked_fill(stuck.unsqueeze(1), 0.0)  # a valid draw, discarded by to_lists
        tokens = argmax(logits)
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if random_rows:
            logits = logits.float()
            idx = _on(logits, random_rows)
            sub = logits.index_select(0, idx)
            temps = _on(logits, [params[i].temperature for i in random_rows])
            sub = self._filter(sub / temps.unsqueeze(1), [params[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            drawn = torch.empty(len(random_rows), dtype=torch.long, device=logits.device)
            unseeded = [j for j, i in enumerate(random_rows) if params[i].seed is None]
            if unseeded:
                u = _on(logits, unseeded)
                drawn[u] = torch.multinomial(probs.index_select(0, u), 1, generator=self.generator).squeeze(1)
            for j, i in enumerate(random_rows):
                seed = params[i].seed
                if seed is not None:
                    g = self._generator(request_ids[i], seed)
                    drawn[j] = torch.multinomial(probs[j], 1, generator=g)[0]
            tokens[idx] = drawn
        if proc:
            self.processors.record(tokens if len(proc) == len(params) else tokens.index_select(0, _on(tokens, proc)))
        if all(p.logprobs is None for p in params):
            return tokens, None, stuck
        k = max(p.logprobs or 0 for p in params)
        return tokens, gather_logprobs(torch.log_softmax(raw.float(), dim=-1), tokens, k), stuck

    def _process(self, logits: torch.Tensor, proc: list[int], params, request_ids, contexts) -> torch.Tensor:
        """float32 logits with the rows in `proc` processed (a copy: the raw logits stay for logprobs)."""
        x = logits.float()
        if x is logits:
            x = x.clone()
        sub_params = [params[j] for j in proc]
        ids, ctx = [request_ids[j] for j in proc], [contexts[j] for j in proc]
        if any(c is None for c in ctx):
            raise ValueError("every row that needs logits processing needs a RowContext")
        if len(proc) == x.shape[0]:
            return self.processors.apply(x, sub_params, ids, ctx)
        idx = _on(x, proc)
        x[idx] = self.processors.apply(x.index_select(0, idx), sub_params, ids, ctx)
        return x

    @staticmethod
    def to_lists(sampled: tuple[torch.Tensor, tuple | None, torch.Tensor | None], params: list[SamplingParams]
                 ) -> tuple[list[int], list | None]:
        """Host lists from `sample`'s tensors (waits for them): tokens (-1 where no token was left) and, per
        row, None or (token logprob, rank, [(token id, logprob), ...] of the row's top `logprobs`)."""
        tokens, lp, stuck = sampled
        token_list = tokens.tolist()
        if stuck is not None:
            token_list = [-1 if s else t for t, s in zip(token_list, stuck.tolist())]
        if lp is None:
            return token_list, None
        return token_list, logprob_lists(lp, [p.logprobs for p in params])

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask logits (already divided by the temperature) below each row's min_p times its most likely
        token's probability, then outside its top-k and nucleus (top-p), to -inf (vLLM's order). The most
        likely token always stays (a top_p below float32's smallest number would otherwise mask every token)."""
        vocab = logits.shape[-1]
        ks = [min(p.top_k, vocab) for p in params]
        ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        if any(min_ps):
            probs = torch.softmax(logits, dim=-1)
            floor = _on(logits, min_ps).to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if all(k <= 0 for k in ks) and all(p >= 1.0 for p in ps):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k_t = _on(logits, [k if k > 0 else vocab for k in ks]).unsqueeze(1)
        mask = ranks >= k_t
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        p_t = _on(logits, ps).to(probs.dtype).unsqueeze(1)
        mask |= before >= p_t  # keep the smallest prefix whose mass reaches top_p
        mask[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
