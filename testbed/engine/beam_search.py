"""Beam search in the engine (sans-I/O): one step's choice of beams from the logprobs of the last ones.

A beam-search request is one unit for the scheduler (a group): it computes its prompt as one sequence, whose
top logprobs start `beam_width` beams; from then on every step computes one token of each beam, and
`step_beams` picks the next beams among every beam's top 2 x beam_width tokens (and the token drawn at the
request's temperature), as vLLM's `LLM.beam_search` does: by `beam_score`, best first; a candidate ending in
EOS (unless ignore_eos) joins the complete beams instead. The block manager gives each new beam its parent's
blocks by reference (`fork_tables`), and a beam that then writes into a block it shares copies it first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True)
class Beam:
    """One finished or running beam: its generated tokens, per token the logprobs it was chosen among
    ({token id: logprob}, the chosen one included), and the sum of its tokens' logprobs."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    finish_reason: str = "length"  # "stop": it ended with EOS


def beam_score(num_prompt_tokens: int, beam: Beam, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's beam score: cumulative logprob / length ** length_penalty, the length counting the prompt and not
    a final EOS."""
    n = num_prompt_tokens + len(beam.token_ids)
    if beam.token_ids and beam.token_ids[-1] == eos_token_id:
        n -= 1
    return beam.cum_logprob / (n ** length_penalty)


def candidates(parents: Sequence[Beam], rows: Sequence[tuple[int, tuple]]) -> list[tuple[int, int, float]]:
    """(parent index, token, its logprob) of every extension: each parent's top logprobs, plus the token its row
    drew when that one is not among them (temperature > 0), as vLLM's logprobs include the sampled token.
    `rows[i]`: parent i's (drawn token, (logprob, rank, [(token, logprob), ...]))."""
    out = []
    for p, (drawn, (lp, _, top)) in enumerate(rows):
        seen = set()
        for tok, l in top:
            seen.add(tok)
            out.append((p, tok, l))
        if drawn not in seen:
            out.append((p, drawn, lp))
    return out


def step_beams(parents: Sequence[Beam], rows: Sequence[tuple[int, tuple]], width: int, num_prompt_tokens: int,
               eos_token_id: int | None, ignore_eos: bool, length_penalty: float
               ) -> tuple[list[tuple[int, Beam]], list[Beam]]:
    """One beam-search step: (the next beams as (parent index, beam), best first, at most `width`; the
    candidates that ended with EOS, complete). Ties keep the candidates' order (parent, then rank)."""
    new: list[tuple[int, Beam]] = []
    for p, tok, l in candidates(parents, rows):
        par = parents[p]
        top = rows[p][1][2]
        new.append((p, Beam([*par.token_ids, tok], [*par.logprobs, {**dict(top), tok: l}], par.cum_logprob + l)))
    new.sort(key=lambda pb: beam_score(num_prompt_tokens, pb[1], eos_token_id, length_penalty), reverse=True)
    running, done = [], []
    for p, b in new:
        if b.token_ids[-1] == eos_token_id and not ignore_eos:
            b.finish_reason = "stop"
            done.append(b)
        elif len(running) < width:
            running.append((p, b))
    return running, done


def best_beams(beams: Sequence[Beam], width: int, num_prompt_tokens: int, eos_token_id: int | None,
               length_penalty: float) -> list[Beam]:
    """The final result: the best `width` of the complete and running beams, best first."""
    return sorted(beams, key=lambda b: beam_score(num_prompt_tokens, b, eos_token_id, length_penalty),
                  reverse=True)[:width]
