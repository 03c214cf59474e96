"""The MoE MLP (docs/moe.md): router -> permute -> [all-to-all over EP] -> experts -> back ->
combine, plus the always-on shared expert, on this rank's tokens [s_local, b, h]; the balancing
losses reach the backward through ``AuxLossScaler`` on the layer's output.
"""

from __future__ import annotations

import math
from typing import Callable, List, NamedTuple, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite import collectives as C
from megalite.config import ExecutionConfig, ModelConfig, dtype_from_name
from megalite.moe import router as R
from megalite.moe.alltoall import combine, dispatch
from megalite.moe.dispatch import permute, unpermute
from megalite.param_meta import set_param_meta
from megalite.overlap import WeightGradStore
from megalite.tensor_parallel.mappings import (
    gather_first_dim,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` gets the gradient ``scale`` (the main
    loss's own multiplier for one micro-batch, a 0-dim device tensor under fp16), so the model
    trains on main + scale x aux without the pipeline carrying aux (docs/moe.md)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.zeros_like(aux_loss).add_(ctx.scale), None


def grouped_expert_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                      grouped: bool, store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts`` [E_local] rows each) times ``weight[e]``
    ([E_local, in, out]): one grouped GEMM, or (``grouped`` False) the reference loop. ``store``
    (a marked layer's): the weight's gradient is queued while it captures (docs/moe.md)."""
    defer = store is not None
    w = weight.detach() if defer else weight
    if grouped:
        split = counts.cumsum(0).to(torch.int32)
        y = F.grouped_mm(x, w, offs=split)
    else:
        # unbind once: indexing weight[e] per expert would give each expert a zero-filled
        # gradient of the whole stack in backward (E full passes per projection); unbind's
        # backward is one stack
        split, per_expert = counts.tolist(), w.unbind(0)  # the loop reads the counts: a reference
        out, start = [], 0
        for e, n in enumerate(split):
            out.append(x[start:start + n] @ per_expert[e])
            start += n
        y = torch.cat(out) if out else x.new_zeros(0, weight.shape[-1])
    if defer:
        y = _ExpertWeightGrad.apply(y, x.detach(), weight, split, grouped, store)
    return y


@torch.no_grad()  # a deferred W runs outside backward: its matmuls must not record a graph
def _expert_weight_grad(x: torch.Tensor, grad: torch.Tensor, split, grouped: bool):
    """dW[e] = x_eᵀ dy_e over each expert's rows, in the form autograd's own backward of the
    unmarked product computes it (checked bit for bit in tests/test_moe_layer.py)."""
    if grouped:
        return F.grouped_mm(x.t(), grad, offs=split)
    return torch.stack([a.t().mm(g) for a, g in zip(x.split(split), grad.split(split))])


class _ExpertWeightGrad(torch.autograd.Function):
    """Identity on y = the product with a detached weight (whose graph gives x its gradient);
    backward adds the weight's: inline, or queued for a W pass while the store captures (the
    combined 1F1B's --delay-wgrad-compute, docs/moe.md)."""

    @staticmethod
    def forward(ctx, y, x, weight, split, grouped, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.split, ctx.grouped, ctx.store = weight, split, grouped, store
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        split, grouped = ctx.split, ctx.grouped
        if ctx.store.capturing:
            ctx.store.put(ctx.weight, lambda: _expert_weight_grad(x, grad, split, grouped))
            return grad, None, None, None, None, None
        return grad, None, _expert_weight_grad(x, grad, split, grouped), None, None, None


def enable_expert_weight_grad_deferral(modules, store: WeightGradStore) -> None:
    """Mark the MoE layers under ``modules``: a backward inside ``store.capture()`` then queues
    their experts' weight gradients (only theirs: docs/moe.md)."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoELayer):
                m.weight_grad_store = store


class MoEGroups(NamedTuple):
    """The process groups an MoE layer talks over (None: a group of one; parallel_state.py)."""
    tp: object = None  # under SP, the ranks that hold the rest of each sequence
    cp: object = None
    dp_cp: object = None  # with TP and CP: every rank of the stage that routes other tokens
    ep: object = None  # the ranks that share out the experts
    etp: object = None  # the ranks that hold slices of the same experts
    etp_ep: object = None  # the allgather dispatcher's

    @classmethod
    def of(cls, ps) -> "MoEGroups":
        return cls(ps.tp_group, ps.cp_group, ps.dp_cp_group, ps.ep_group, ps.etp_group,
                   ps.etp_ep_group)


class MoELayer(nn.Module):
    weight_grad_store = None  # set by enable_expert_weight_grad_deferral

    def __init__(self, config: ModelConfig, layer_number: int, activation: Callable,
                 shared_expert: Optional[nn.Module] = None, groups: MoEGroups = MoEGroups(),
                 sequence_parallel: bool = False, device=None,
                 execution: ExecutionConfig = ExecutionConfig()):
        super().__init__()
        c = config
        dtype = dtype_from_name(c.params_dtype)
        self.config, self.layer_number, self.act = c, layer_number, activation
        self.grouped_gemm = execution.moe_grouped_gemm
        self.dispatcher = execution.moe_token_dispatcher_type
        self.num_experts, self.topk = c.num_experts, c.moe_router_topk
        self.groups = groups
        ep, etp = C.group_size(groups.ep), C.group_size(groups.etp)
        self.num_local_experts = c.num_experts // ep
        self.local_expert_offset = C.group_rank(groups.ep) * self.num_local_experts
        h, f = c.hidden_size, c.moe_ffn_hidden_size
        fc1 = 2 * f if c.swiglu else f
        # the router: replicated; under SP each TP rank routes its own tokens, so its gradient
        # is a partial sum over TP (as a norm's). Its logits are computed in moe_router_dtype.
        self.router = nn.Parameter(torch.empty(c.num_experts, h, dtype=dtype, device=device))
        set_param_meta(self.router, grad_partial_over_tp=sequence_parallel,
                       init_method=("normal", c.init_method_std))
        self.router_bias = None
        if c.moe_router_linear_bias:  # GPT-OSS: replicated and reduced as the router
            self.router_bias = nn.Parameter(torch.zeros(c.num_experts, dtype=dtype, device=device))
            set_param_meta(self.router_bias, grad_partial_over_tp=sequence_parallel,
                           init_method=("zeros",))
        if c.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(c.num_experts, device=device))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(c.num_experts, device=device), persistent=False)
        else:
            self.expert_bias = None
        # this rank's experts, stacked: one [E_local, in, out] tensor per projection. Under ETP
        # each holds a slice of every expert, as the dense MLP's TP ranks do: weight1's columns
        # (SwiGLU's gate and up split separately, stride 2) and weight2's matching rows
        e, stride = self.num_local_experts, 2 if c.swiglu else 1
        out_std = c.init_method_std / math.sqrt(2.0 * c.num_layers)
        self.weight1 = nn.Parameter(torch.empty(e, h, fc1 // etp, dtype=dtype, device=device))
        self.weight2 = nn.Parameter(torch.empty(e, f // etp, h, dtype=dtype, device=device))
        # drawn expert by expert from (seed, name, global expert index), then sliced: any EP and
        # ETP give the same experts
        first, split = self.local_expert_offset, etp > 1
        set_param_meta(self.weight1, expert=True, tp_split=split, partition_dim=2,
                       partition_stride=stride,
                       init_method=("normal_experts", c.init_method_std, first))
        set_param_meta(self.weight2, expert=True, tp_split=split, partition_dim=1,
                       init_method=("normal_experts", out_std, first))
        self.bias1 = self.bias2 = None
        self.etp_rank = C.group_rank(groups.etp)
        if c.add_bias_linear:  # fc1's split with its columns, fc2's whole on every ETP rank
            self.bias1 = nn.Parameter(torch.zeros(e, fc1 // etp, dtype=dtype, device=device))
            self.bias2 = nn.Parameter(torch.zeros(e, h, dtype=dtype, device=device))
            set_param_meta(self.bias1, expert=True, tp_split=split, partition_dim=1,
                           partition_stride=stride, init_method=("zeros",))
            set_param_meta(self.bias2, expert=True, init_method=("zeros",))
        self.shared_expert = shared_expert
        self.shared_gate = None
        if shared_expert is not None and c.moe_shared_expert_gate:
            self.shared_gate = nn.Parameter(torch.empty(1, h, dtype=dtype, device=device))
            set_param_meta(self.shared_gate, grad_partial_over_tp=sequence_parallel,
                           init_method=("normal", c.init_method_std))
        self.aux_loss_scale = 1.0  # set each step by the trainer (see AuxLossScaler)
        # global_aux_loss: this step's tokens per expert summed over the stage's ranks, and the
        # micro-batches they came from (begin_step starts both again)
        self.register_buffer("step_tokens_per_expert", torch.zeros(c.num_experts, device=device),
                             persistent=False)
        self.step_micro_batches = 0
        self.metrics = {}  # the last micro-batch's detached values (tests, debugging)
        # since the last log line: [balancing loss, z loss, tokens per expert...], this rank's
        # shares; read by moe_interval_metrics at log steps only
        self.register_buffer("interval_stats", torch.zeros(2 + c.num_experts, device=device),
                             persistent=False)

    def _capacity(self, num_tokens: int) -> Optional[int]:
        """Tokens per expert with a capacity factor (this rank's tokens); None: dropless."""
        cf = self.config.moe_expert_capacity_factor
        return None if cf is None else R.expert_capacity(num_tokens, self.num_experts,
                                                         self.topk, cf)

    def _route(self, tokens: torch.Tensor):
        c = self.config
        dtype = torch.float64 if c.moe_router_dtype == "fp64" else torch.float32
        bias = None if self.router_bias is None else self.router_bias.to(dtype)
        logits = F.linear(tokens.to(dtype), self.router.to(dtype), bias)
        if c.moe_router_force_load_balancing:  # benchmarks: every expert equally likely
            logits = torch.randn_like(logits)
        probs, routing_map = R.route(
            logits, self.topk, c.moe_router_score_function, c.moe_router_pre_softmax,
            c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor,
            self.expert_bias, c.moe_router_group_score, c.moe_router_norm_topk_prob)
        cap = self._capacity(tokens.shape[0])
        if cap is not None:
            probs, routing_map = R.drop_over_capacity(probs, routing_map, cap,
                                                      c.moe_token_drop_policy,
                                                      c.moe_pad_expert_input_to_capacity)
        return logits, probs, routing_map

    def _over_sequence(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Sum over the ranks that hold other tokens of the same sequences (TP under SP, CP)."""
        C.all_reduce(t, group=self.groups.tp, tag=tag)
        C.all_reduce(t, group=self.groups.cp, tag=tag)
        return t

    def _aux_loss(self, logits: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's share of the balancing and z losses; the shares sum over TP x CP to the
        whole micro-batch's (docs/moe.md)."""
        c = self.config
        kind, loss = c.moe_router_load_balancing_type, logits.new_zeros(())
        split = C.group_size(self.groups.tp) * C.group_size(self.groups.cp)
        if kind != "none" and c.moe_aux_loss_coeff > 0:
            scores, top = R.scores_for_aux_loss(logits, self.topk, c.moe_router_score_function)
            s = logits.shape[0] // batch  # this rank's tokens of each sequence
            if kind == "seq_aux_loss":
                counts = self._over_sequence(top.view(s, batch, -1).sum(0).float(), "moe_aux")
                loss = R.seq_load_balancing_loss(scores.view(s, batch, -1), counts, s * split,
                                                 self.topk, c.moe_aux_loss_coeff)
            elif kind == "global_aux_loss":
                loss = self._global_aux_loss(scores, top, split)
            else:
                counts = self._over_sequence(top.sum(0).float(), "moe_aux")
                loss = R.switch_load_balancing_loss(scores, counts, logits.shape[0] * split,
                                                    self.topk, self.num_experts,
                                                    c.moe_aux_loss_coeff)
            self.metrics["load_balancing_loss"] = loss.detach()
        if c.moe_z_loss_coeff:  # a mean over the micro-batch's tokens: this rank's share
            z = R.z_loss(logits, c.moe_z_loss_coeff) / split
            self.metrics["z_loss"] = z.detach()
            loss = loss + z
        return loss

    def _global_aux_loss(self, scores: torch.Tensor, top: torch.Tensor, split: int):
        """global_aux_loss (Megatron's): the step's running token fractions over all DP ranks,
        with this micro-batch's scores, scaled by DP (docs/moe.md derives the scaling)."""
        c, g = self.config, self.groups
        counts = top.sum(0).float()
        C.all_reduce(counts, group=g.tp, tag="moe_aux")  # TP x DP x CP: the whole round
        C.all_reduce(counts, group=g.dp_cp, tag="moe_aux")
        dp = C.group_size(g.dp_cp) // C.group_size(g.cp)
        if self.training and torch.is_grad_enabled():  # (full recompute: the replay counts)
            self.step_tokens_per_expert += counts
            self.step_micro_batches += 1
            counts = self.step_tokens_per_expert / self.step_micro_batches
        return dp * R.switch_load_balancing_loss(scores, counts, scores.shape[0] * split * dp,
                                                 self.topk, self.num_experts,
                                                 c.moe_aux_loss_coeff)

    def _experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        grouped, store = self.grouped_gemm, self.weight_grad_store
        h = grouped_expert_mm(x, self.weight1, counts, grouped, store)
        if self.bias1 is not None:
            h = h + self.bias1.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        h = grouped_expert_mm(self.act(h), self.weight2, counts, grouped, store)
        if self.bias2 is not None:
            # under ETP these rows are partial sums that the combine (or the allgather
            # dispatcher's reduce-scatter) adds up: the bias enters on ETP rank 0 only. The
            # others add b - b.detach(), zero but with b's gradient: each ETP rank sees the same
            # rows and their gradients, so each holds the whole one (docs/moe.md)
            b2 = self.bias2 if self.etp_rank == 0 else self.bias2 - self.bias2.detach()
            h = h + b2.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return h

    def _allgather_experts(self, tokens, probs, routing_map, rows):
        """The allgather dispatcher (docs/moe.md, "The allgather dispatcher")."""
        group = self.groups.etp_ep
        n = C.group_size(group)
        local = slice(self.local_expert_offset, self.local_expert_offset + self.num_local_experts)
        tokens = gather_from_sequence_parallel_region(tokens, group)
        probs = gather_from_sequence_parallel_region(probs, group)[:, local]
        routing_map = gather_first_dim(routing_map.to(torch.uint8), group).bool()[:, local]
        # each source's rows are all local at EP 1; with EP > 1 how many are is data-dependent
        rows = rows * n if rows is not None and self.num_local_experts == self.num_experts \
            else None
        permuted, sorted_indices, rows_per_expert = permute(tokens, routing_map, rows)
        out = self._experts(permuted, rows_per_expert)
        y = unpermute(out, sorted_indices, probs.to(out.dtype), routing_map, rows)
        return reduce_scatter_to_sequence_parallel_region(y, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        logits, probs, routing_map = self._route(tokens)
        counts = routing_map.sum(0)  # [E] this rank's assignments per global expert
        self.metrics["tokens_per_expert"] = counts.detach()
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            # (under full recompute the first forward runs without grad: only the replay counts)
            self.local_tokens_per_expert += counts.detach()
        # rows to permute: known on the host when dropless (k per token) or padded to capacity
        # (C per expert), so the permutation needs no host read; capacity drops leave it unknown
        cap = self._capacity(tokens.shape[0])
        rows = (tokens.shape[0] * self.topk if cap is None else
                self.num_experts * cap if self.config.moe_pad_expert_input_to_capacity else None)
        if self.dispatcher == "allgather":
            y = self._allgather_experts(tokens, probs, routing_map, rows)
        else:
            permuted, sorted_indices, _ = permute(tokens, routing_map, rows)
            # over EP, each token block goes to the rank of its expert and its output comes
            # back (and over ETP, to every slice of it); with EP = ETP = 1 nothing moves
            padded = cap if self.config.moe_pad_expert_input_to_capacity else None
            received, rows_per_expert, handle = dispatch(permuted, counts, self.groups.ep,
                                                         self.num_local_experts, self.groups.etp,
                                                         padded)
            out = combine(self._experts(received, rows_per_expert), handle)
            y = unpermute(out, sorted_indices, probs.to(out.dtype), routing_map, rows)
        y = y.view(s, b, hidden)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_gate))
            y = y + shared
        aux = self._aux_loss(logits, b)
        if self.training and torch.is_grad_enabled():  # (full recompute: the replay counts)
            m = self.metrics
            self.interval_stats[0] += m.get("load_balancing_loss", 0.0)
            self.interval_stats[1] += m.get("z_loss", 0.0)
            self.interval_stats[2:] += counts.detach()
        if self.training and aux.requires_grad:
            y = AuxLossScaler.apply(y, aux, self.aux_loss_scale)
        return y


def moe_interval_metrics(layers: List[MoELayer], config: ModelConfig, micro_batches: int,
                         ps) -> dict:
    """Per MoE layer since the last log line: balancing and z losses per micro-batch, load
    imbalance, and their mean and worst over layers (docs/moe.md). Collective over the world
    (each layer lives on one stage); ``micro_batches``: the interval's, over every DP rank."""
    # (MTP's layers numbered after the model's: models/mtp.py)
    rows = torch.zeros(config.num_layers + (config.mtp_num_layers or 0), 2 + config.num_experts,
                       device=ps.device)
    for m in layers:
        rows[m.layer_number] = m.interval_stats
        m.interval_stats.zero_()
    C.all_reduce(rows, group=C.world_group(), tag="moe_metrics")
    out = {}
    for i, row in enumerate(rows.tolist()):
        if not config.is_moe_layer(i):
            continue
        counts = row[2:]
        mean = sum(counts) / len(counts)
        out[f"moe/layer{i}/load_balancing_loss"] = row[0] / micro_batches
        out[f"moe/layer{i}/z_loss"] = row[1] / micro_batches
        out[f"moe/layer{i}/imbalance"] = max(counts) / mean if mean else 0.0
    losses = [v for k, v in out.items() if k.endswith("load_balancing_loss")]
    if not losses:  # a pattern with no MoE layer
        return out
    out["moe_load_balancing_loss"] = sum(losses) / len(losses)
    out["moe_max_imbalance"] = max(v for k, v in out.items() if k.endswith("imbalance"))
    return out


def moe_layers(chunks) -> List[MoELayer]:
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def begin_step(layers: List[MoELayer], aux_loss_scale) -> None:
    """Each step, before the forward-backward: the balancing losses' gradient multiplier, and
    global_aux_loss's token counts start again."""
    for m in layers:
        m.aux_loss_scale = aux_loss_scale
        m.step_tokens_per_expert.zero_()
        m.step_micro_batches = 0


@torch.no_grad()
def update_expert_biases(layers: List[MoELayer], tp_group, dp_cp_group,
                         applied: Union[bool, torch.Tensor]) -> None:
    """Loss-free balancing after a step (DeepSeek-V3, docs/moe.md), loads summed over TP and
    DP x CP; a skipped step (``applied``, a device flag: no host read) leaves the biases."""
    layers = [m for m in layers if m.expert_bias is not None]
    if not layers:
        return
    counts = torch.stack([m.local_tokens_per_expert for m in layers])
    C.all_reduce(counts, group=tp_group, tag="moe_expert_bias")
    C.all_reduce(counts, group=dp_cp_group, tag="moe_expert_bias")
    for m, n in zip(layers, counts):
        new = R.expert_bias_update(m.expert_bias, n, m.config.moe_router_bias_update_rate)
        m.expert_bias.copy_(torch.where(torch.as_tensor(applied, device=new.device), new,
                                        m.expert_bias))
        m.local_tokens_per_expert.zero_()
