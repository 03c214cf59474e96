"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5 (Yang et al.,
"Gated Delta Networks", arXiv:2412.06464): a matrix state per value head, decayed and corrected
by the delta rule at every token, read by the query (docs/models.md, "Hybrid linear attention";
the chunked form and its cost: docs/theory.md, "Linear attention").

Weights are kept per key-head group, so a TP rank holds whole groups of every one of them: the
input projection's rows per group are [q (dk), k (dk), v (r·dv), z (r·dv), b (r), a (r)] with r
value heads per key head, the convolution's channels [q, k, v] of each group."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite import collectives as C
from megalite.compiled import self_checked
from megalite.config import ModelConfig, dtype_from_name
from megalite.context_parallel.attention import reshard_to_heads
from megalite.param_meta import set_param_meta
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.utils import divide

CHUNK = 64  # tokens per chunk of the chunked delta rule (O(s·c) work and memory per head)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the eps inside the root, as fla and HF)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """o_t = H_t^T q_t for H_t = e^{g_t} H_{t-1} + k_t u_t^T, u_t = beta_t (v_t - e^{g_t}
    H_{t-1}^T k_t), H_0 = 0, computed chunk by chunk: inside a chunk the corrections u solve
    one unit lower-triangular system, across chunks only the [dk, dv] state is carried.
    q, k [b, h, s, dk] (q already scaled), v [b, h, s, dv], g (log decay, <= 0) and beta
    [b, h, s]; at least fp32 inside, the result in v's dtype."""
    work = torch.promote_types(v.dtype, torch.float32)
    b, h, s, dk = k.shape
    pad = -s % chunk
    q, k, v = (F.pad(t.to(work), (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for t in (q, k, v))
    g, beta = (F.pad(t.to(work), (0, pad)).unflatten(2, (-1, chunk)) for t in (g, beta))
    gamma = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    # (I + A) u = beta v - beta e^gamma k H0, A[i, j] = beta_i decay[i, j] k_i.k_j for j < i
    system = (kb @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, device=q.device,
                                                                      dtype=work)
    u_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                        unitriangular=True)
    u_h = torch.linalg.solve_triangular(system, kb * gamma.exp().unsqueeze(-1), upper=False,
                                        unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay  # within the chunk, decays included
    q_h = q * gamma.exp().unsqueeze(-1)  # reads the chunk's initial state
    k_end = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # writes to the chunk's end
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for c in range(q.shape[2]):
        u = u_v[:, :, c] - u_h[:, :, c] @ state
        out.append(q_h[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * gamma[:, :, c, -1:, None].exp() + k_end[:, :, c].transpose(-1, -2) @ u
    return torch.stack(out, 2).flatten(2, 3)[:, :, :s].to(v.dtype)


def delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """:func:`gated_delta_rule`, or on CUDA fla's fused kernel (``pip install megalite[fla]``)
    once it has matched the exact rule here (docs/models.md, "Hybrid linear attention")."""
    if q.is_cuda and _fla_matches(q.device, v.dtype, q.shape[-1], v.shape[-1]):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        heads_second = [t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta)]
        o, _ = chunk_gated_delta_rule(*heads_second, scale=1.0)  # q arrives scaled
        return o.transpose(1, 2).to(v.dtype)
    return gated_delta_rule(q, k, v, g, beta)


_FLA_CHECKED: dict = {}  # (device, dtype, dk, dv) -> fla's kernel matched the exact rule


def _fla_matches(device, dtype, dk: int, dv: int) -> bool:
    """Whether fla is importable and its kernel equals :func:`gated_delta_rule` on a small random
    problem (relative 2e-2 in 16 bits, 2e-3 in fp32); one warning line when it does not."""
    key = (device, dtype, dk, dv)
    if key not in _FLA_CHECKED:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            _FLA_CHECKED[key] = False  # not installed: the torch rule, silently
            return False
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (1, 2, 200)
        q, k = (l2_normalize(torch.randn(*shape, dk, device=device, generator=gen))
                for _ in range(2))
        v = torch.randn(*shape, dv, device=device, generator=gen)
        g = -torch.rand(shape, device=device, generator=gen)
        beta = torch.rand(shape, device=device, generator=gen)
        ref = gated_delta_rule(q * dk ** -0.5, k, v, g, beta)

        def error():
            args = [t.transpose(1, 2).to(dtype).contiguous() for t in (q * dk ** -0.5, k, v)]
            o, _ = chunk_gated_delta_rule(*args, g.transpose(1, 2).contiguous(),
                                          beta.transpose(1, 2).contiguous(), scale=1.0)
            return float((o.transpose(1, 2).float() - ref).abs().max() / ref.abs().max())

        _FLA_CHECKED[key] = self_checked(
            "linear attention: fla's chunk_gated_delta_rule", "the torch rule", error,
            2e-3 if dtype == torch.float32 else 2e-2)
    return _FLA_CHECKED[key]


class GatedDeltaNet(nn.Module):
    """in projection -> causal depthwise conv + SiLU on q, k, v -> L2-normed q, k -> the gated
    delta rule with decay g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b) -> RMSNorm
    gated by SiLU(z) -> out projection. Under a2a context parallelism each rank runs the
    recurrence over the whole sequence for its share of the groups."""

    def __init__(self, config: ModelConfig, tp_group=None, device=None,
                 sequence_parallel: bool = False, cp_group=None):
        super().__init__()
        dtype = dtype_from_name(config.params_dtype)
        tp = C.group_size(tp_group)
        self.groups = divide(config.linear_num_key_heads, tp, "--linear-num-key-heads")
        self.r = config.linear_num_value_heads // config.linear_num_key_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.cp_group, self.eps = cp_group, config.norm_epsilon
        dk, dv, r, G = self.dk, self.dv, self.r, config.linear_num_key_heads
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, G * (2 * dk + 2 * r * dv + 2 * r), bias=False,
            tp_group=tp_group, sequence_parallel=sequence_parallel,
            init_std=config.init_method_std, params_dtype=dtype, device=device)
        width = config.linear_conv_kernel_dim

        def split(shape, init):  # a parameter split over TP with the groups, along dim 0
            p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            set_param_meta(p, tp_split=True, partition_dim=0, init_method=init)
            return p

        self.conv_weight = split((self.groups * (2 * dk + r * dv), width),
                                 ("normal", 1 / math.sqrt(width)))
        self.A_log = split((self.groups * r,), ("log_uniform", 1.0, 16.0))
        self.dt_bias = split((self.groups * r,), ("ones",))
        # one [dv] weight applied to each of this rank's value heads: partial over TP (as q/k norm)
        self.norm_weight = nn.Parameter(torch.empty(dv, dtype=dtype, device=device))
        set_param_meta(self.norm_weight, init_method=("ones",), grad_partial_over_tp=True)
        self.out_proj = RowParallelLinear(
            G * r * dv, config.hidden_size, bias=False, input_is_parallel=True,
            tp_group=tp_group, sequence_parallel=sequence_parallel,
            init_std=config.init_method_std / math.sqrt(2.0 * config.num_layers),
            params_dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, position_ids=None, documents=None) -> torch.Tensor:
        """x [s(/t), b, h] -> [s(/t), b, h]; no positions (the recurrence orders the tokens);
        config.py refuses documents here."""
        dk, dv, r = self.dk, self.dv, self.r
        proj = self.in_proj(x)  # [s, b, groups * per group]: the whole sequence of this rank
        s, b = proj.shape[:2]
        qkv, z, ba = proj.view(s, b, self.groups, -1).split([2 * dk + r * dv, r * dv, 2 * r], -1)
        mixed = torch.cat([qkv, ba], -1).permute(1, 2, 0, 3)  # [b, groups, s, channels]
        if C.group_size(self.cp_group) > 1:  # a2a: the whole sequence, a share of the groups
            mixed = reshard_to_heads(mixed, self.cp_group, to_heads=True)
        core = self._core(*mixed.split([2 * dk + r * dv, 2 * r], -1))
        if C.group_size(self.cp_group) > 1:
            core = reshard_to_heads(core, self.cp_group, to_heads=False)
        core = core.permute(2, 0, 1, 3).reshape(s, b, self.groups * r, dv)
        normed = F.rms_norm(core.float(), (dv,), eps=self.eps).to(core.dtype) * self.norm_weight
        gated = normed.float() * F.silu(z.reshape(s, b, -1, dv).float())
        return self.out_proj(gated.to(x.dtype).flatten(2))

    def _core(self, qkv: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """[b, G, s, 2dk + r·dv] and [b, G, s, 2r] of G groups over the whole sequence -> the
        rule's output [b, G, s, r·dv]."""
        dk, dv, r = self.dk, self.dv, self.r
        groups, s = qkv.shape[1], qkv.shape[2]
        first = self._first_group(groups)
        w = self.conv_weight.view(-1, 2 * dk + r * dv, self.conv_weight.shape[-1])
        w = w[first:first + groups].flatten(0, 1)
        conv = F.conv1d(qkv.transpose(2, 3).flatten(1, 2), w.unsqueeze(1),
                        padding=w.shape[-1] - 1, groups=w.shape[0])[..., :s]
        conv = F.silu(conv).unflatten(1, (groups, -1)).transpose(2, 3)
        q, k, v = conv.split([dk, dk, r * dv], -1)
        q, k = (l2_normalize(t.float()).repeat_interleave(r, 1) for t in (q, k))
        v = v.unflatten(-1, (r, dv)).transpose(2, 3).flatten(1, 2)  # [b, G·r, s, dv]
        heads = slice(first * r, (first + groups) * r)
        b_, a = ba.unflatten(-1, (2, r)).unbind(-2)
        beta = b_.float().sigmoid().transpose(2, 3).flatten(1, 2)
        g = -self.A_log[heads].float().exp()[:, None] * F.softplus(
            a.float().transpose(2, 3).flatten(1, 2) + self.dt_bias[heads].float()[:, None])
        o = delta_rule(q * dk ** -0.5, k, v, g, beta)  # [b, G·r, s, dv]
        return o.unflatten(1, (groups, r)).transpose(2, 3).flatten(3)

    def _first_group(self, groups: int) -> int:
        """The first of this CP rank's groups among this TP rank's (a2a splits them)."""
        return C.group_rank(self.cp_group) * groups if C.group_size(self.cp_group) > 1 else 0
