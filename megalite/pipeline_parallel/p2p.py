"""Point-to-point communication between pipeline stages.

Activations flow forward (rank r -> r+1) and their gradients flow backward (r+1 -> r). Shapes are
known before the first message (``[s, b, h]``, or ``[s/t, b, h]`` under sequence parallelism), so
there is no shape handshake: the receiver allocates the buffer and posts the receive.

Everything one rank has to exchange between two consecutive compute units (the output of the unit
that just ran, and the input of the one that runs next; schedules.comm_units) goes out as ONE
``batch_isend_irecv`` batch. Why: a send completes only once its receive is posted (NCCL, and gloo
too), so a rank blocked on sending an activation while its neighbour is blocked on sending a
gradient deadlocks. Batching the send with the receive it pairs with
(``send_forward_recv_backward``) lets both sides' batches complete together. Within a batch the
ops are posted in a fixed order, activation ops before gradient ops, so when one peer is both
"next" and "prev" (p = 2 with interleaving) both ranks post their two messages to each other in the
same order. Activations and gradients also get different tags, which is how gloo matches messages
between the same pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite import collectives as C

# gloo matches point-to-point messages by (peer, tag); NCCL ignores the tag and relies on order.
TAG_ACTIVATION = 0
TAG_GRADIENT = 1


def tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int = 1,
                 sequence_parallel: bool = False) -> Tuple[int, int, int]:
    """Shape of the hidden states that cross a stage boundary (sequence-first, docs/design.md)."""
    s = seq_length // tp_size if sequence_parallel and tp_size > 1 else seq_length
    return (s, micro_batch_size, hidden_size)


@dataclass
class P2PBatch:
    """One posted batch: wait() blocks until every send and receive in it has completed."""

    works: list
    received: dict  # "activation" / "gradient" -> tensor being received
    sent: list  # the tensors being sent, kept alive until the batch completes

    def wait(self) -> dict:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], []
        return self.received

    def done(self) -> bool:
        """True once every op has completed (does not block)."""
        if all(w.is_completed() for w in self.works):
            self.works, self.sent = [], []
        return not self.works


class PipelineP2P:
    """Sends and receives between this rank and its pipeline neighbours (ring order, as the
    interleaved schedule sends the last rank's chunk-c output to rank 0's chunk c+1)."""

    def __init__(self, parallel_state, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device):
        self.ps = parallel_state
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        self.group = parallel_state.pp_group
        self.next_rank = parallel_state.pp_next_rank
        self.prev_rank = parallel_state.pp_prev_rank

    @property
    def independent_ops(self) -> bool:
        """Whether each send and receive completes on its own, matched by (peer, tag) in posting
        order, so that a rank may post early and wait only for what it needs (gloo). Under NCCL
        the ops of a batch and successive batches run in order on one stream: a posted receive
        that is not matched yet holds up every later send, so the executor keeps the batched
        program there (schedules.comm_units)."""
        return self.group is not None and dist.get_backend(self.group) == "gloo"

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.shape:
            raise RuntimeError(f"pipeline {what} has shape {tuple(t.shape)} but every stage "
                               f"boundary carries {self.shape} ([s(/t), b, h]); check "
                               f"--seq-length and --micro-batch-size")
        return t.detach().to(self.dtype).contiguous()

    def post(self, *, send_next: Optional[torch.Tensor] = None,
             send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
             recv_next: bool = False) -> Optional[P2PBatch]:
        """Post one batch: activation to the next stage and/or from the previous one, gradient to
        the previous stage and/or from the next one. Returns None when there is nothing to do."""
        ops: List[dist.P2POp] = []
        received, sent = {}, []
        # Activation direction first, gradient direction second, on every rank (see module doc).
        if send_next is not None:
            t = self._check(send_next, "activation")
            sent.append(t)
            ops.append(dist.P2POp(dist.isend, t, self.next_rank, self.group, TAG_ACTIVATION))
            C.count_p2p(t.numel() * t.element_size(), "pp_p2p")
        if recv_prev:
            received["activation"] = self._empty()
            ops.append(dist.P2POp(dist.irecv, received["activation"], self.prev_rank, self.group,
                                  TAG_ACTIVATION))
        if send_prev is not None:
            t = self._check(send_prev, "gradient")
            sent.append(t)
            ops.append(dist.P2POp(dist.isend, t, self.prev_rank, self.group, TAG_GRADIENT))
            C.count_p2p(t.numel() * t.element_size(), "pp_p2p")
        if recv_next:
            received["gradient"] = self._empty()
            ops.append(dist.P2POp(dist.irecv, received["gradient"], self.next_rank, self.group,
                                  TAG_GRADIENT))
        if not ops:
            return None
        return P2PBatch(C.batch_isend_irecv(ops, tag="pp_p2p"), received, sent)

    # Blocking conveniences with the names the literature uses (each is one batch).
    def send_forward(self, t: torch.Tensor) -> None:
        self.post(send_next=t).wait()

    def recv_forward(self) -> torch.Tensor:
        return self.post(recv_prev=True).wait()["activation"]

    def send_backward(self, g: torch.Tensor) -> None:
        self.post(send_prev=g).wait()

    def recv_backward(self) -> torch.Tensor:
        return self.post(recv_next=True).wait()["gradient"]

    def send_forward_recv_backward(self, t: torch.Tensor) -> torch.Tensor:
        return self.post(send_next=t, recv_next=True).wait()["gradient"]

    def send_backward_recv_forward(self, g: torch.Tensor) -> torch.Tensor:
        return self.post(send_prev=g, recv_prev=True).wait()["activation"]
