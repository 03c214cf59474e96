"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Shapes are sequence-first ``[s, b, h]`` (docs/design.md, contract 2). With sequence parallelism (SP)
the activations between blocks are sharded along ``s``; the column-parallel layer all-gathers them
on the way in and the row-parallel layer reduce-scatters on the way out (Korthikanti et al.,
arXiv:2205.05198 §4.2.2), so the total volume equals the two all-reduces of plain TP.

The layers call the mapping operators of mappings.py (f and g; under SP the paper's g and ḡ) for
every collective. The local matmul is native autograd (``F.linear``) except in two cases that need
the autograd function below: SP's column-parallel layer, which saves only its input shard, and
layers marked by :func:`enable_weight_grad_deferral`, whose weight gradient is its own step —
queued inside :meth:`WeightGradStore.capture` (for marked layers only: SP's unmarked ones compute
it inline), so a zero-bubble pipeline schedule can run the input-gradient half ("B") now and the
weight-gradient half ("W") later (Qi et al., arXiv:2401.10241).

Parameters are created empty and filled by :func:`megalite.models.init.initialize_parameters`
from a generator seeded by the parameter's full name, so the full model does not depend on the
layout (docs/design.md, contract 3). Each parameter's record (megalite/param_meta.py) says how.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite import collectives as C
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_first_dim,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalite.param_meta import grad_of, set_param_meta
from megalite.tensor_parallel.utils import divide


# ------------------------------------------------------------------------- deferred weight grads
class WeightGradStore:
    """Queue of deferred weight-gradient computations (the "W" of zero-bubble pipelining).

    ``with WeightGradStore.capture() as queue:`` runs a backward whose linear layers append a
    closure per weight to ``queue`` instead of computing the weight gradient; calling each closure
    later computes that gradient and accumulates it where the gradient lives (``main_grad`` when a
    gradient buffer owns the parameter, else ``.grad``).
    """

    _queue: Optional[List[Callable[[], None]]] = None

    @classmethod
    @contextlib.contextmanager
    def capture(cls, queue: Optional[List[Callable[[], None]]] = None):
        """``queue``: append to this list (which others may be emptying meanwhile)."""
        previous, cls._queue = cls._queue, [] if queue is None else queue
        try:
            yield cls._queue
        finally:
            cls._queue = previous

    @classmethod
    def is_capturing(cls) -> bool:
        return cls._queue is not None

    @classmethod
    def put(cls, param: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        """Queue ``param``'s weight gradient, ``compute()``, for the W pass (capturing only)."""
        # a gradient buffer waits for this part (ddp.py); accumulate_weight_grad counts it off
        param.weight_grads_queued = getattr(param, "weight_grads_queued", 0) + 1
        cls._queue.append(lambda: accumulate_weight_grad(param, compute()))


@torch.no_grad()  # the W closure runs outside backward; accumulation must not be recorded
def accumulate_weight_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add a deferred weight gradient to the parameter's gradient storage."""
    param.weight_grads_queued -= 1
    target = grad_of(param)
    if target is not None:
        target.add_(grad.to(target.dtype))
    else:
        param.grad = grad.to(param.dtype)
    hook = getattr(param, "deferred_grad_hook", None)
    if hook is not None:  # lets a gradient buffer learn that this parameter is ready
        hook(param)


@torch.no_grad()  # a deferred W runs outside backward: its matmul must not record a graph
def _weight_grad(grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    go = grad_output.reshape(-1, grad_output.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    return go.t().matmul(x)


class LinearWithDeferrableWeightGrad(torch.autograd.Function):
    """y = x W^T + b on this rank's weight: the matmuls only, with the weight gradient as its own
    step. The TP/SP collectives are the mapping operators the layers put around it (f, or SP's g, in
    front of a column-parallel layer, g or its SP form after a row-parallel one).

    ``local_x`` (sequence parallelism): x is g(local_x), SP's all-gather of this rank's sequence
    shard. Only the shard is saved and x is re-gathered for ``dW = dyᵀ x`` in backward: one extra
    all-gather buys s/t activation memory (Korthikanti et al. §4.2.2).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, local_x, group, defer):
        ctx.group, ctx.defer = group, defer
        ctx.gathered = local_x is not None
        ctx.has_bias = bias is not None
        ctx.weight = weight
        ctx.save_for_backward(local_x if ctx.gathered else x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        saved, weight = ctx.saved_tensors
        total_input = gather_first_dim(saved, ctx.group) if ctx.gathered else saved
        grad_input = grad_output.matmul(weight)
        grad_bias = None
        if ctx.has_bias:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        if ctx.defer and WeightGradStore.is_capturing():  # marked, and this backward is a B
            WeightGradStore.put(ctx.weight, lambda: _weight_grad(grad_output, total_input))
            grad_weight = None
        else:
            grad_weight = _weight_grad(grad_output, total_input)
        return grad_input, grad_weight, grad_bias, None, None, None


def linear(x, weight, bias=None, local_x=None, group=None, defer=False):
    if local_x is None and not defer:  # native autograd: the function costs ~20 µs of Python
        return F.linear(x, weight, bias)
    return LinearWithDeferrableWeightGrad.apply(x, weight, bias, local_x, group, defer)


def enable_weight_grad_deferral(modules) -> None:
    """Route the linear layers under ``modules`` through the function, so that a backward inside
    ``WeightGradStore.capture()`` queues their weight gradients (a forward cannot know whether its
    backward will be captured; unmarked layers' gradients are computed inline, not deferred)."""
    for module in (m for m in modules if not getattr(m, "_weight_grad_deferral", False)):
        for m in module.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.defer_weight_grad = True
        module._weight_grad_deferral = True  # later calls skip the walk


# ----------------------------------------------------------------------------------- the layers
class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: rank r holds A_r (output features [r*o/t, (r+1)*o/t)).

    Input: ``[s, b, h]`` replicated, or ``[s/t, b, h]`` under SP. Output: ``[s, b, o/t]``, or the
    full ``[s, b, o]`` with ``gather_output``. ``stride`` > 1 keeps fused blocks (SwiGLU's gate and
    up) split consistently (see tensor_parallel/utils.py).
    """
    defer_weight_grad = False  # set by enable_weight_grad_deferral

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, tp_group=None, sequence_parallel: bool = False,
                 init_std: float = 0.02, stride: int = 1, params_dtype=torch.float32,
                 device=None, skip_weight_param_allocation: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = C.group_size(tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if skip_weight_param_allocation:
            self.weight = None  # the caller passes the weight to forward (tied output layer)
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                   dtype=params_dtype, device=device))
            set_param_meta(self.weight, tp_split=True, partition_stride=stride,
                           init_method=("normal", init_std))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype,
                                                 device=device))
            set_param_meta(self.bias, tp_split=True, partition_stride=stride,
                           init_method=("zeros",))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:  # SP's g: all-gather along s, reduce-scatter dX in backward
            total = gather_from_sequence_parallel_region(x, self.tp_group)
            out = linear(total, weight, self.bias, local_x=x, group=self.tp_group,
                         defer=self.defer_weight_grad)
        else:  # f: identity, all-reduce dX in backward
            out = linear(copy_to_tensor_model_parallel_region(x, self.tp_group), weight, self.bias,
                         defer=self.defer_weight_grad)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)
        return out


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows: rank r holds A_r (input features [r*i/t, (r+1)*i/t)).

    Input: ``[s, b, i/t]`` (``input_is_parallel``) or full ``[s, b, i]`` (then scattered first).
    The partial products are summed by the g operator (all-reduce), or reduce-scattered along ``s``
    under SP (the paper's ḡ); the bias is added after the sum, once.
    """
    defer_weight_grad = False  # set by enable_weight_grad_deferral

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 input_is_parallel: bool = True, tp_group=None, sequence_parallel: bool = False,
                 init_std: float = 0.02, params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = C.group_size(tp_group)
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence parallelism needs input_is_parallel")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype, device=device))
        set_param_meta(self.weight, tp_split=True, partition_dim=1,
                       init_method=("normal", init_std))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
            # Under SP the bias is added to a sequence shard, so each rank sees only part of its
            # gradient: it must be all-reduced over TP like the norms' (finalize_model_grads).
            set_param_meta(self.bias, init_method=("zeros",),
                           grad_partial_over_tp=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        partial = linear(x, self.weight, defer=self.defer_weight_grad)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocab split across TP ranks (docs/theory.md, vocab-parallel).

    Rank r owns ids [r*Vp/t, (r+1)*Vp/t). Ids outside the range are looked up at row 0 and their
    output zeroed, then the partial embeddings are all-reduced — or reduce-scattered along the
    sequence when the next block runs sequence-parallel. Input ids ``[b, s]``, output ``[s, b, h]``.
    """

    def __init__(self, padded_vocab_size: int, embedding_dim: int, *, tp_group=None,
                 sequence_parallel: bool = False, init_std: float = 0.02,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = C.group_size(tp_group)
        self.tp_rank = C.group_rank(tp_group)
        self.padded_vocab_size = padded_vocab_size
        self.vocab_per_partition = divide(padded_vocab_size, self.tp_size, "padded vocab size")
        self.vocab_start = self.tp_rank * self.vocab_per_partition
        self.vocab_end = self.vocab_start + self.vocab_per_partition
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.weight = nn.Parameter(torch.empty(self.vocab_per_partition, embedding_dim,
                                               dtype=params_dtype, device=device))
        set_param_meta(self.weight, tp_split=True, init_method=("normal_vocab", init_std))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.t()  # [s, b]: sequence-first from here on
        if self.tp_size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)
