"""This process's place in the PP x TP grid of workers, and the activations sent between pipeline stages.

Ranks: `pipeline_parallel_size` stages of `tensor_parallel_size` ranks each. Global ranks count the stages from
the LAST one back, `rank = (pp_size - 1 - pp_rank) * tp_size + tp_rank`, so global rank 0, the executor's own
process that holds the requests and drives the others, runs the last stage: the final norm, the LM head and
sampling stay with the requests, and no logits travel between processes. The first stage (the embedding) is a
worker process. Each stage's ranks form one tensor-parallel group (its all-reduces and the LM head's gather).

Activations: after its layers a stage sends the hidden states and the residual stream of every token of the
step ([2, tokens, hidden], one message) to the rank of the same tensor-parallel index in the next stage
(torch.distributed's point-to-point send/recv: NCCL on GPUs, gloo on CPU). Each pair of ranks sees the steps in
the same order, so messages pair up by order alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist


def global_rank(pp_rank: int, tp_rank: int, pp_size: int, tp_size: int) -> int:
    """The global rank of tensor-parallel rank `tp_rank` of stage `pp_rank` (the last stage's ranks first)."""
    return (pp_size - 1 - pp_rank) * tp_size + tp_rank


@dataclass(frozen=True)
class ParallelState:
    """Where this process sits: its stage, its tensor-parallel rank, its stage's group (None: the whole world,
    with one stage) and its neighbours' global ranks (None at the ends)."""

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tp_group: dist.ProcessGroup | None

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first else global_rank(self.pp_rank - 1, self.tp_rank, self.pp_size, self.tp_size)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last else global_rank(self.pp_rank + 1, self.tp_rank, self.pp_size, self.tp_size)


_STATE: ParallelState | None = None


def init_parallel_state(rank: int, tp_size: int, pp_size: int) -> ParallelState:
    """Set this process's place after torch.distributed is up (world = tp_size * pp_size); with several stages
    every rank creates every stage's group, in the same order (torch.distributed's rule for new_group)."""
    global _STATE
    pp_rank, tp_rank = pp_size - 1 - rank // tp_size, rank % tp_size
    group = None
    if pp_size > 1 and tp_size > 1:
        for stage in range(pp_size):
            ranks = [global_rank(stage, t, pp_size, tp_size) for t in range(tp_size)]
            g = dist.new_group(ranks)
            if stage == pp_rank:
                group = g
    _STATE = ParallelState(rank, tp_rank, tp_size, pp_rank, pp_size, group)
    return _STATE


def get_parallel_state() -> ParallelState | None:
    """This process's place, or None outside a multi-process executor."""
    return _STATE


def reset_parallel_state() -> None:
    global _STATE
    _STATE = None


def pipeline_stage() -> tuple[int, int]:
    """(pp_rank, pp_size) of this process: (0, 1) without pipeline parallelism."""
    return (0, 1) if _STATE is None else (_STATE.pp_rank, _STATE.pp_size)


class PendingActivations:
    """The previous stage's activations for one step, received into fresh buffers: posted at once (`irecv`, so
    the sender never waits for this rank to get to the step), read with `wait`."""

    def __init__(self, src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        self.work = dist.irecv(self.buf, src) if num_tokens else None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, residual) of the step's tokens."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buf[0], self.buf[1]


class StageLink:
    """One rank's point-to-point links: receives from the previous stage, sends to the next. A send returns at
    once; its buffer stays referenced until the send completes (at most `depth` are kept: then the oldest is
    waited for), so a stage can run the next step while the one after it still receives."""

    def __init__(self, state: ParallelState, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 depth: int) -> None:
        self.state, self.hidden_size, self.dtype, self.device = state, hidden_size, dtype, device
        self.depth = max(1, depth)
        self._sends: deque = deque()

    def post_recv(self, num_tokens: int) -> PendingActivations:
        return PendingActivations(self.state.prev_rank, num_tokens, self.hidden_size, self.dtype, self.device)

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        if hidden.shape[0] == 0:
            return
        buf = torch.stack((hidden, residual))
        while self._sends and (len(self._sends) >= self.depth or self._sends[0][0].is_completed()):
            self._sends.popleft()[0].wait()
        self._sends.append((dist.isend(buf, self.state.next_rank), buf))

    def flush(self) -> None:
        """Wait for every send still under way (before the process group goes)."""
        while self._sends:
            self._sends.popleft()[0].wait()
