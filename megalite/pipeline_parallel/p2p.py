"""Point-to-point between pipeline ranks (docs/pipeline_parallel.md, "Point-to-point"): shapes
known ahead, one batch per ``post``, its ops in one order on every rank."""

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
    received: list  # the receive buffers, in the order the receives were asked for
    sent: list  # the tensors being sent, kept alive until the batch completes

    def wait(self) -> list:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], []
        return self.received

    def done(self) -> bool:
        if all(w.is_completed() for w in self.works):
            self.works, self.sent = [], []
        return not self.works


class PipelineP2P:
    """Sends and receives between this rank and other pipeline ranks, named by pipeline rank."""

    def __init__(self, parallel_state, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.group = parallel_state.pp_group
        self.ranks = parallel_state.pp_ranks  # pipeline rank -> global rank

    @property
    def independent_ops(self) -> bool:
        """Whether each send and receive completes on its own, matched by (peer, tag) in posting
        order (gloo: the eager program); NCCL runs batches in order on one stream."""
        return self.group is not None and dist.get_backend(self.group) == "gloo"

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.shape:
            raise RuntimeError(f"pipeline {what} has shape {tuple(t.shape)} but every stage "
                               f"boundary carries {self.shape} ([s(/t), b, h]); check "
                               f"--seq-length and --micro-batch-size")
        return t.detach().to(self.dtype).contiguous()

    def post(self, sends: Sequence[Tuple[int, int, torch.Tensor]] = (),
             recvs: Sequence[Tuple[int, int]] = ()) -> Optional[P2PBatch]:
        """Post one batch: ``sends`` are (peer, tag, tensor), ``recvs`` (peer, tag); the batch's
        ``received`` lists the receive buffers in the order of ``recvs``. None when empty."""
        ops: List[Tuple[int, int, dist.P2POp]] = []
        received, sent = [], []
        for peer, tag, t in sends:
            t = self._check(t, "activation" if tag == TAG_ACTIVATION else "gradient")
            sent.append(t)
            ops.append((tag, 0, dist.P2POp(dist.isend, t, self.ranks[peer], self.group, tag)))
            C.count_p2p(t.numel() * t.element_size(), "pp_p2p")
        for peer, tag in recvs:
            received.append(torch.empty(self.shape, dtype=self.dtype, device=self.device))
            ops.append((tag, 1, dist.P2POp(dist.irecv, received[-1], self.ranks[peer],
                                           self.group, tag)))
        if not ops:
            return None
        # activation ops before gradient ops, sends before receives, on every rank (module doc)
        ops.sort(key=lambda o: o[:2])
        return P2PBatch(C.batch_isend_irecv([o[2] for o in ops], tag="pp_p2p"), received, sent)
