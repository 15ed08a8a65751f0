"""Structured outputs through xgrammar (vLLM V1's default backend): compile a request's constraint once,
keep one matcher per request, and mask each step's logits with the matcher's token bitmask.

The bitmask is packed 32 tokens to an int32 (bit set = allowed), filled on the host by xgrammar for the
rows that carry a grammar, copied to the logits' device in one transfer and unpacked there with tensor
ops: the same batched path on GPU and CPU. A matcher advances lazily: before each fill it accepts the
request's tokens it has not seen yet (the caller passes every token sampled so far). Once it accepted
the end of its grammar (a stop token), its row is no longer constrained, as in vLLM (ignore_eos goes on
freely). The constraint's translation into xgrammar, and the front-ends' torch-free check of it, are in
grammar_compile.py.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from testbed.engine.params import StructuredOutputsParams
from testbed.worker.grammar_compile import compile_constraint, xgrammar


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, ceil(V / 32)] (bit j of word w = token 32 w + j allowed) -> bool [n, V], on packed's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()


class _State:
    __slots__ = ("matcher", "accepted")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.accepted = 0  # output tokens the matcher has consumed


class GrammarStates:
    """Per-request xgrammar matchers of one worker, created the first time a request's row is masked."""

    def __init__(self, load_tokenizer: Callable[[], Any]) -> None:
        self.load_tokenizer = load_tokenizer
        self.states: dict[str, _State] = {}
        self._xgr = None
        self._compiler = None
        self._vocab = 0

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def _matcher(self, so: StructuredOutputsParams, vocab_size: int, eos_token_id: int | None):
        if self._compiler is None or self._vocab != vocab_size:
            xgr = self._xgr = xgrammar()
            stop = [eos_token_id] if eos_token_id is not None else None
            info = xgr.TokenizerInfo.from_huggingface(self.load_tokenizer(), vocab_size=vocab_size,
                                                      stop_token_ids=stop)
            self._compiler, self._vocab = xgr.GrammarCompiler(info), vocab_size
        return self._xgr.GrammarMatcher(compile_constraint(so, self._compiler))

    def bitmask(self, request_ids: Sequence[str], params: Sequence, outputs: Sequence[Sequence[int]],
                eos_token_ids: Sequence[int | None], vocab_size: int, pin: bool = False) -> torch.Tensor:
        """Host int32 bitmask [len(request_ids), ceil(vocab / 32)] of the next token of each request, after
        advancing its matcher over `outputs` (every token it sampled so far). Rows whose grammar has ended
        allow everything."""
        words = -(-vocab_size // 32)
        mask = torch.full((len(request_ids), words), -1, dtype=torch.int32, pin_memory=pin)
        for k, (rid, p, out, eos) in enumerate(zip(request_ids, params, outputs, eos_token_ids)):
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = _State(self._matcher(p.structured_outputs, vocab_size, eos))
            m = st.matcher
            for t in out[st.accepted:]:
                if m.is_terminated():
                    break
                if not m.accept_token(int(t)):
                    raise RuntimeError(f"request {rid!r}: the grammar refused token {int(t)}, which its own mask "
                                       "allowed (xgrammar matcher out of step with the output)")
            st.accepted = len(out)
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, k)
        return mask
