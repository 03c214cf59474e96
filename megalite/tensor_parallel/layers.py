"""Tensor-parallel layers, sequence-first ``[s, b, h]``, and the linear function whose weight
gradient is its own step (docs/tensor_parallel.md)."""

from __future__ import annotations

from typing import Optional

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
from megalite.overlap import WeightGradStore
from megalite.tensor_parallel.cross_entropy import linear_cross_entropy
from megalite.param_meta import set_param_meta
from megalite.tensor_parallel.utils import divide


@torch.no_grad()  # a deferred W runs outside backward: its matmul must not record a graph
def _weight_grad(grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    go = grad_output.reshape(-1, grad_output.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    return go.t().matmul(x)


class LinearWithDeferrableWeightGrad(torch.autograd.Function):
    """y = x W^T + b on this rank's weight, the weight gradient as its own step. ``local_x``
    (SP): x is the all-gather of this shard, which alone is saved and re-gathered for ``dW``."""

    @staticmethod
    def forward(ctx, x, weight, bias, local_x, group, store):
        ctx.group, ctx.store = group, store
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
        if ctx.store is not None and ctx.store.capturing:  # marked, and this backward is a B
            ctx.store.put(ctx.weight, lambda: _weight_grad(grad_output, total_input))
            grad_weight = None
        else:
            grad_weight = _weight_grad(grad_output, total_input)
        return grad_input, grad_weight, grad_bias, None, None, None


def linear(x, weight, bias=None, local_x=None, group=None, store=None):
    if local_x is None and store is None:  # native autograd: the function costs ~20 µs of Python
        return F.linear(x, weight, bias)
    return LinearWithDeferrableWeightGrad.apply(x, weight, bias, local_x, group, store)


def enable_weight_grad_deferral(modules, store: WeightGradStore) -> None:
    """Route the linear layers under ``modules`` through the function, so that a backward inside
    ``store.capture()`` queues their weight gradients (docs/tensor_parallel.md)."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.weight_grad_store = store


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns. Input ``[s, b, h]`` (``[s/t, b, h]`` under SP), output
    ``[s, b, o/t]`` (``gather_output``: all o); ``stride`` > 1: fused blocks split apart."""
    weight_grad_store = None  # set by enable_weight_grad_deferral

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

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None,
                target: Optional[torch.Tensor] = None, **loss) -> torch.Tensor:
        """``target`` (an output layer without bias): the per-token loss instead of the logits,
        which are never whole (cross_entropy.linear_cross_entropy; ``loss``: its keywords)."""
        weight = self.weight if weight is None else weight
        if target is not None:  # a module call still, so that ZeRO-3's hooks see it
            return linear_cross_entropy(x, weight, target, self.tp_group, **loss,
                                        sequence_parallel=self.sequence_parallel,
                                        store=self.weight_grad_store)
        if self.sequence_parallel:  # SP's g: all-gather along s, reduce-scatter dX in backward
            total = gather_from_sequence_parallel_region(x, self.tp_group)
            out = linear(total, weight, self.bias, local_x=x, group=self.tp_group,
                         store=self.weight_grad_store)
        else:  # f: identity, all-reduce dX in backward
            out = linear(copy_to_tensor_model_parallel_region(x, self.tp_group), weight, self.bias,
                         store=self.weight_grad_store)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)
        return out


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows. Input ``[s, b, i/t]`` (or full, then scattered); the partial
    products are all-reduced (reduce-scattered along ``s`` under SP), then the bias added."""
    weight_grad_store = None  # set by enable_weight_grad_deferral

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
        partial = linear(x, self.weight, store=self.weight_grad_store)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocab split across TP ranks: rank r owns ids
    [r*Vp/t, (r+1)*Vp/t), zeroes the others' rows, and the partial embeddings are all-reduced
    (reduce-scattered along s under SP). Ids ``[b, s]`` -> ``[s, b, h]`` (docs/theory.md)."""

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
