"""Sampling for one step: greedy, temperature, top-k, top-p, per-request seeds, and logprobs.

Rows are independent: a request with a seed draws from its own torch.Generator, so its tokens
do not depend on what else is in the batch. Logprobs are of the model's raw distribution (before
temperature / top-k / top-p), as vLLM reports them.
"""
from __future__ import annotations

import torch

from testbed.engine.request import SamplingParams


def _on(like: torch.Tensor, values: list) -> torch.Tensor:
    """A small host list on `like`'s device without a stream sync (a blocking copy would wait for the GPU)."""
    return torch.tensor(values).to(like.device, non_blocking=True)


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


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.request_generators.pop(rid, None)

    def _generator(self, rid: str, seed: int) -> torch.Generator:
        g = self.request_generators.get(rid)
        if g is None:
            g = self.request_generators[rid] = torch.Generator(device=self.device)
            g.manual_seed(seed)
        return g

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
                 ) -> tuple[list[int], list | None]:
        """logits [n, vocab] float32 -> (token per row, per-row logprobs or None)."""
        return self.to_lists(self.sample(logits, params, request_ids), params)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
               ) -> tuple[torch.Tensor, tuple | None]:
        """Draw on the device without reading anything back: (tokens [n], logprob tensors or None).
        The logprob tensors are (chosen [n], top values [n, k], top ids [n, k]) with k the largest asked.
        Greedy rows take the argmax of the logits as they come (upcasting is exact, so bf16 and float32
        agree); probabilities are computed in float32."""
        tokens = argmax(logits)
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if random_rows or any(p.logprobs is not None for p in params):
            logits = logits.float()
        if random_rows:
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
        if all(p.logprobs is None for p in params):
            return tokens, None
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(p.logprobs or 0 for p in params)
        top = logprobs.topk(k, dim=-1) if k > 0 else None
        return tokens, (chosen, top.values if top else None, top.indices if top else None)

    @staticmethod
    def to_lists(sampled: tuple[torch.Tensor, tuple | None], params: list[SamplingParams]
                 ) -> tuple[list[int], list | None]:
        """Host lists from `sample`'s tensors (waits for them): tokens and, per row, None or
        (token logprob, [(token id, logprob), ...] of the row's top `logprobs`)."""
        tokens, lp = sampled
        token_list = tokens.tolist()
        if lp is None:
            return token_list, None
        chosen = lp[0].tolist()
        top_v = lp[1].tolist() if lp[1] is not None else None
        top_i = lp[2].tolist() if lp[2] is not None else None
        out: list = []
        for r, p in enumerate(params):
            w = p.logprobs
            if w is None:
                out.append(None)
            else:
                out.append((chosen[r], list(zip(top_i[r][:w], top_v[r][:w])) if w > 0 else []))
        return token_list, out

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask logits outside each row's top-k and nucleus (top-p) to -inf. The most likely token always
        stays (a top_p below float32's smallest number would otherwise mask every token)."""
        vocab = logits.shape[-1]
        ks = [min(p.top_k, vocab) for p in params]
        ps = [p.top_p for p in params]
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
