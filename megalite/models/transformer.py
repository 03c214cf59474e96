"""A transformer layer that reads like the math, x = x + dropout(attention(norm(x))), then
x = x + dropout(mlp(norm(x))), on sequence-first activations ``[s(/t), b, h]`` (docs/models.md,
"The block"); the parallel layers hide the TP collectives (tensor_parallel/mappings.py).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite import collective_record as R
from megalite import collectives as C
from megalite.compiled import compile_or_eager
from megalite.config import ExecutionConfig, ModelConfig, dtype_from_name
from megalite.context_parallel.attention import context_parallel_attention
from megalite.context_parallel.sharding import positions as cp_positions
from megalite.masks import Documents, causal_attention, document_attention, sink_attention
from megalite.models.linear_attention import GatedDeltaNet
from megalite.models.norms import ProjectionRMSNorm, RMSNorm, build_norm
from megalite.models.mla import MultiLatentQKV, softmax_scale
from megalite.models.rotary import apply_rotary, rotary_embedding
from megalite.moe.layer import MoEGroups, MoELayer
from megalite.param_meta import set_param_meta
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.random import checkpoint, get_rng_tracker
from megalite.tensor_parallel.utils import divide


@torch.compiler.disable  # dynamo cannot trace swapping the global RNG state (get/set_rng_state):
def _in_tracked_rng(fn, *args, **kwargs):  # one graph break here instead of one per swap
    """fn(*args) with its random draws taken from the tracked, per-TP-rank RNG stream."""
    with get_rng_tracker().fork():
        return fn(*args, **kwargs)


def hidden_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool):
    """Dropout of the hidden states (embedding and residual branches); under SP each rank holds a
    different sequence shard, so its mask comes from the tracked RNG stream."""
    if not training or p == 0.0:
        return x
    if sequence_parallel:
        return _in_tracked_rng(F.dropout, x, p, True)
    return F.dropout(x, p, True)


# --torch-compile: the CP attention stays eager (its sends, receives and byte counts would
# otherwise be traced and retraced as the counters change): one graph break per layer.
_cp_attention = torch.compiler.disable(context_parallel_attention)
# Likewise attention within documents: its loop runs over the micro-batch's host-side lengths.
_document_attention = torch.compiler.disable(document_attention)
_sink_attention = torch.compiler.disable(sink_attention)  # its kernel is chosen by a self-check


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "silu": F.silu,
                "relu": F.relu}


class SelfAttention(nn.Module):
    """Causal multi-head / grouped-query attention, each TP rank holding whole query groups of
    the fused QKV weight (docs/models.md, "Fused QKV, per query group")."""

    def __init__(self, config: ModelConfig, layer_number: int, tp_group=None, device=None,
                 sequence_parallel: bool = False, cp_group=None, cp_comm_type: str = "p2p",
                 execution: ExecutionConfig = ExecutionConfig()):
        super().__init__()
        self.config = config
        # context parallelism: this rank holds s/C tokens of a sequence (docs/context_parallel.md)
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        self.cp_size, self._cp_positions = C.group_size(cp_group), {}
        tp = C.group_size(tp_group)
        dtype = dtype_from_name(config.params_dtype)
        d = config.kv_channels
        self.head_dim = d
        self.num_heads_local = divide(config.num_attention_heads, tp, "--num-attention-heads")
        self.num_groups_local = divide(config.num_query_groups, tp, "--num-query-groups")
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        # per query group: its query heads, k, v (and, --attention-output-gate, a gate per head)
        self.gates = self.heads_per_group if config.attention_output_gate else 0
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * d
        qkv_out += config.num_attention_heads * d if config.attention_output_gate else 0
        sp = sequence_parallel
        out_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.mla = None
        if config.multi_latent_attention:  # q, k, v from low-rank latents (models/mla.py)
            self.mla = MultiLatentQKV(config, tp_group, device, sp, execution.use_apex)
        else:
            self.linear_qkv = ColumnParallelLinear(
                config.hidden_size, qkv_out, bias=config.add_qkv_bias, tp_group=tp_group,
                sequence_parallel=sp, init_std=config.init_method_std, params_dtype=dtype,
                device=device)
        v_dim = d if self.mla is None else config.v_head_dim
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * v_dim, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, tp_group=tp_group, sequence_parallel=sp, init_std=out_std,
            params_dtype=dtype, device=device)
        rope_dim = config.rotary_dim if self.mla is None else config.qk_pos_emb_head_dim
        self.rotary = (rotary_embedding(config, rope_dim)
                       if config.position_embedding_type == "rope" else None)
        self.softmax_scale = None if self.mla is None else softmax_scale(config)  # None: 1/sqrt(d)
        self.selective_recompute = execution.recompute_granularity == "selective"
        self.cp_attention_kernel = execution.cp_attention_kernel
        self.window = config.attention_window(layer_number)
        self.sinks = None
        if config.attention_sinks:  # GPT-OSS: one logit per head, split over TP as the heads
            self.sinks = nn.Parameter(torch.empty(self.num_heads_local, dtype=dtype, device=device))
            set_param_meta(self.sinks, tp_split=True,
                           init_method=("normal", config.init_method_std))
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm and config.qk_layernorm_scope == "projection":  # OLMoE
            self.q_layernorm, self.k_layernorm = (
                ProjectionRMSNorm(n * d, config.norm_epsilon, tp_group, dtype, device)
                for n in (config.num_attention_heads, config.num_query_groups))
        elif config.qk_layernorm:
            # one [d] weight replicated over TP, applied to each rank's own heads: its gradient
            # is partial over TP, with or without SP (docs/models.md, "q/k norm")
            self.q_layernorm, self.k_layernorm = (
                RMSNorm(d, config.norm_epsilon, grad_partial_over_tp=True, params_dtype=dtype,
                        device=device, use_apex=execution.use_apex,
                        one_plus=config.apply_layernorm_1p) for _ in range(2))

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: Optional[Documents] = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal, within this layer's window and, with
        ``documents``, within each token's document. q: [b, n, s, d]; k, v: [b, g, s, d] (MLA:
        v's d narrower, and its own softmax scale)."""
        gqa = {"enable_gqa": True} if self.heads_per_group > 1 else {}  # SDPA: heads -> groups
        if self.cp_size > 1:  # over the whole sequence; config.py refuses attention dropout here
            local = None  # a2a: this layer's attention over the whole sequence for its heads
            if documents is not None:
                local = partial(_document_attention, docs=documents, window=self.window,
                                scale=self.softmax_scale, **gqa)
            elif self.window is not None and self.window < q.shape[2] * self.cp_size:
                local = partial(causal_attention, window=self.window, scale=self.softmax_scale,
                                **gqa)
            if self.sinks is not None:  # a2a: the CP call hands it its heads' sinks (sink=)
                local = partial(_sink_attention, window=self.window, docs=documents,
                                scale=self.softmax_scale, kernel=self.cp_attention_kernel)
            dv = v.shape[-1]
            if self.cp_comm_type != "a2a" and dv < k.shape[-1]:
                # the ring and all-gather move K and V as one stacked tensor (and the CPU flash
                # kernel wants one width): V padded with zeros, its zero output columns dropped
                v = F.pad(v, (0, k.shape[-1] - dv))
            return _cp_attention(q, k, v, self.cp_group, self.cp_comm_type, self.softmax_scale,
                                 local_attention=local, kernel=self.cp_attention_kernel,
                                 documents=documents, window=self.window,
                                 sink=self.sinks)[..., :dv]
        if self.sinks is not None:  # config.py: no dropout
            return _sink_attention(q, k, v, self.sinks, self.window, documents, self.softmax_scale,
                                   self.cp_attention_kernel)
        p = self.config.attention_dropout if self.training else 0.0
        kw = dict(dropout_p=p, scale=self.softmax_scale, window=self.window, **gqa)
        attend = causal_attention
        if documents is not None:
            attend = partial(_document_attention, docs=documents)
        if p == 0.0:  # nothing random drawn: no RNG fork (under --torch-compile, no graph break)
            return attend(q, k, v, **kw)
        # Each TP rank holds different heads: their dropout masks must differ (tracked RNG).
        return _in_tracked_rng(attend, q, k, v, **kw)

    def _qkv(self, x: torch.Tensor, position_ids: Optional[torch.Tensor]):
        """q [s, b, n, d] and k, v [s, b, g, d] from the fused projection, normed and rotated."""
        qkv = self.linear_qkv(x)  # [s, b, g_local * (heads_per_group + 2) * d]
        s, b = qkv.shape[0], qkv.shape[1]
        d, g, hpg = self.head_dim, self.num_groups_local, self.heads_per_group
        qk, v, gate = qkv.view(s, b, g, hpg + 2 + self.gates, d).split([hpg + 1, 1, self.gates],
                                                                         dim=3)
        if self.q_layernorm is not None:  # Qwen3 per head, OLMoE per projection; before RoPE
            q, k = qk.split([hpg, 1], dim=3)
            qk = torch.cat([self.q_layernorm(q), self.k_layernorm(k)], dim=3)
        if self.rotary is not None:  # q and k rotated together: one pass over both
            cos, sin = self._rope(s, x.device, qkv.dtype, position_ids)
            qk = apply_rotary(qk, cos.unsqueeze(2), sin.unsqueeze(2))
        q, k = qk.split([hpg, 1], dim=3)
        q = q.reshape(s, b, g * hpg, d)
        return q, k.squeeze(3), v.squeeze(3), gate.reshape(s, b, -1) if self.gates else None

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """``position_ids`` [b, s]: this rank's tokens' positions when not 0..s-1 (documents
        restart them); ``documents``: attend within them (docs/data.md, "Packed documents")."""
        # [s, b, n, d] each (k, v: the query groups' heads; MLA: its own widths)
        gate = None
        if self.mla is None:
            q, k, v, gate = self._qkv(x, position_ids)
        else:
            q, k, v = self.mla(x, partial(self._rope, position_ids=position_ids))
        s, b = q.shape[0], q.shape[1]
        # [s, b, n, d] -> [b, n, s, d] for SDPA
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if not (self.selective_recompute and self.training):
            ctx = self.core_attention(q, k, v, documents)
        elif torch.compiler.is_compiling() and self.config.attention_dropout == 0.0:
            # The compiler's own checkpoint region, traced into the layer's graph: random.py's
            # checkpoint saves and replays RNG states, which dynamo cannot trace (a graph break),
            # and without dropout there is no RNG state to replay.
            ctx = torch.utils.checkpoint.checkpoint(self.core_attention, q, k, v, documents,
                                                    use_reentrant=False)
        else:
            ctx = checkpoint(self.core_attention, x.device, q, k, v, documents)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)
        if gate is not None:  # --attention-output-gate: each head's output times its gate
            ctx = ctx * torch.sigmoid(gate)
        return self.linear_proj(ctx)

    def _rope(self, s: int, device, dtype, position_ids: Optional[torch.Tensor] = None):
        """cos, sin_signed [s, 1 or b, 1, d_rope] for this rank's s tokens."""
        if position_ids is not None:  # [b, s]: each below the whole sequence's length
            return self.rotary.at(position_ids.t(), s * self.cp_size, device, dtype)
        if self.cp_size > 1:  # this rank's tokens sit at their global positions
            return self.rotary.at(self._global_positions(s, device), s * self.cp_size, device,
                                  dtype)
        return self.rotary(s, device, dtype)

    def _global_positions(self, s_local: int, device) -> torch.Tensor:
        key = (s_local, torch.device(device))
        if key not in self._cp_positions:  # built once per length, not per layer call
            self._cp_positions[key] = cp_positions(s_local * self.cp_size, C.group_rank(
                self.cp_group), self.cp_size, device)
        return self._cp_positions[key]


def swiglu(h: torch.Tensor, act=F.silu) -> torch.Tensor:
    """act(gate) * up for h = [gate, up] along the last dim (the reference path)."""
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


_compiled_swiglu = compile_or_eager(swiglu, dynamic=True)  # eager if it cannot compile here


def swiglu_fused(h: torch.Tensor) -> torch.Tensor:
    """On CUDA, one inductor kernel each way (docs/performance.md, "Fast paths"); the CPU, and a
    layer already being compiled, run the reference."""
    if h.is_cuda and not torch.compiler.is_compiling():
        return _compiled_swiglu(h)
    return swiglu(h)


def clamped_swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU (docs/models.md, "GPT-OSS"): gate <= limit, up in [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


def mlp_activation(config: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """fc1's output -> fc2's input (dense MLP and experts): the activation, or act(gate) * up."""
    act = _ACTIVATIONS.get(config.activation)
    if act is None:
        raise ValueError(f"unknown activation {config.activation!r}")
    if config.swiglu_limit is not None:  # config.py: only with --swiglu
        return partial(clamped_swiglu, limit=config.swiglu_limit, alpha=config.swiglu_alpha)
    if config.swiglu and act is F.silu:
        return swiglu_fused
    return partial(swiglu, act=act) if config.swiglu else act


class MLP(nn.Module):
    """h -> ffn (column-parallel; SwiGLU's [gate; up] with stride 2) -> activation -> h
    (row-parallel). ``ffn_hidden_size``: the MoE shared expert's (default the config's)."""

    def __init__(self, config: ModelConfig, tp_group=None, device=None,
                 sequence_parallel: bool = False, ffn_hidden_size: Optional[int] = None):
        super().__init__()
        dtype = dtype_from_name(config.params_dtype)
        sp = sequence_parallel
        ffn = ffn_hidden_size or config.ffn_hidden_size
        fc1_out = 2 * ffn if config.swiglu else ffn
        out_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_out, bias=config.add_bias_linear, tp_group=tp_group,
            sequence_parallel=sp, init_std=config.init_method_std,
            stride=2 if config.swiglu else 1, params_dtype=dtype, device=device)
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, tp_group=tp_group, sequence_parallel=sp, init_std=out_std,
            params_dtype=dtype, device=device)
        self.act = mlp_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int, tp_group=None, device=None,
                 sequence_parallel: bool = False,  # ParallelConfig's, passed by GPTModel
                 cp_group=None, cp_comm_type: str = "p2p",
                 moe_groups: Optional[MoEGroups] = None,
                 execution: ExecutionConfig = ExecutionConfig()):
        super().__init__()
        dtype = dtype_from_name(config.params_dtype)
        sp = sequence_parallel and C.group_size(tp_group) > 1
        self.layer_number = layer_number  # global, 0-based
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sp
        self.input_layernorm = build_norm(config, sp, dtype, device, execution.use_apex)
        if config.is_linear_attention_layer(layer_number):  # the token mixer: linear attention
            self.self_attention = GatedDeltaNet(config, tp_group, device, sp, cp_group)
        else:
            self.self_attention = SelfAttention(config, layer_number, tp_group, device, sp,
                                                cp_group, cp_comm_type, execution)
        self.pre_mlp_layernorm = build_norm(config, sp, dtype, device, execution.use_apex)
        if config.is_moe_layer(layer_number):
            shared = (MLP(config, tp_group, device, sp, config.moe_shared_expert_intermediate_size)
                      if config.moe_shared_expert_intermediate_size else None)
            groups = moe_groups or MoEGroups(tp=tp_group, cp=cp_group)
            self.mlp = MoELayer(config, layer_number, mlp_activation(config), shared, groups,
                                sp, device, execution)
        else:
            self.mlp = MLP(config, tp_group, device, sp)
        # --torch-compile: only the layer's own forward is compiled, module hooks stay eager
        # around it; an MoE layer up to its MLP, whose block sizes are data-dependent
        # (docs/performance.md, "--torch-compile: one graph per layer"; docs/moe.md, "The layer")
        self._forward = self._layer_forward
        # Read by wrappers that hook modules (DDP's overlapped parameter gathers): a hook on a
        # submodule would run inside the graph, so they hook this layer as a whole.
        backend = execution.torch_compile
        self.compiled_forward = bool(backend)
        if backend and isinstance(self.mlp, MoELayer):
            self._before_mlp = torch.compile(self._before_mlp, backend=backend)
        elif backend:
            self._forward = torch.compile(self._layer_forward, backend=backend)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_dropout(x, self.hidden_dropout, self.training, self.sequence_parallel)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """``position_ids``, ``documents``: as SelfAttention.forward's."""
        with R.label(f"layer {self.layer_number}"):  # the collective record's (eager)
            return self._forward(x, position_ids, documents)

    def _before_mlp(self, x: torch.Tensor, position_ids=None, documents=None):
        """The attention block's output and its normalisation for the MLP."""
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), position_ids,
                                                  documents))
        return x, self.pre_mlp_layernorm(x)

    def _layer_forward(self, x: torch.Tensor, position_ids=None, documents=None) -> torch.Tensor:
        x, h = self._before_mlp(x, position_ids, documents)
        return x + self._dropout(self.mlp(h))
