"""The planner's cost model: memory per GPU and step time of a parallel layout (docs/planner.md).
A tool: tools/plan.py searches with it; a run imports it only to print its memory estimate."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megalite.checkpoint.layout import Layout as FileLayout
from megalite.config import V_SCHEDULES, ExecutionConfig, ModelConfig, default_schedule
from megalite.distributed.ddp import DEFAULT_BUCKET_SIZE
from megalite.logging import attention_flops, causal_pairs, model_flops_per_sequence
from megalite.memory import theoretical_model_state_bytes
from megalite.models.linear_attention import CHUNK
from megalite.pipeline_parallel.schedules import schedule_order
from megalite.tensor_parallel.cross_entropy import CPU_BLOCK_ELEMENTS

GiB = 2 ** 30


# Datasheet: dense 16-bit TFLOP/s, GiB, HBM GB/s, NVLink GB/s per direction, network Gb/s per
# GPU; and the fraction of peak large GEMMs sustain in training (docs/planner.md).
GPU = collections.namedtuple("GPU", "name peak_tflops memory_gib hbm_gbps "
                             "intra_node_bandwidth_gbps inter_node_bandwidth_gbps gemm_efficiency")
GPUS = {g.name: g for g in (GPU("A100-80GB", 312.0, 80.0, 2039.0, 300.0, 200.0, 0.70),
                            GPU("H100-80GB", 989.0, 80.0, 3350.0, 450.0, 400.0, 0.64),
                            GPU("H200", 989.0, 141e9 / GiB, 4800.0, 450.0, 400.0, 0.64))}
# docs/planner.md, "Constants and where they come from"
GEMM_HALF_DIM = 96            # a GEMM with smallest dimension n runs at n / (n + 96) of the max
FLASH_ATTENTION_EFFICIENCY = 0.55  # fused attention (counted FLOPs) relative to a large GEMM
UNFUSED_SOFTMAX_BYTES = 13    # bytes per score element, forward, of the unfused softmax path
HBM_EFFICIENCY = 0.90         # streaming kernels vs datasheet HBM bandwidth
COLLECTIVE_EFFICIENCY = 0.80  # NCCL bus bandwidth vs link bandwidth, large messages
COLLECTIVE_LATENCY_S = {"intra": 10e-6, "inter": 25e-6}
USABLE_MEMORY_FRACTION = 0.92  # CUDA context, NCCL/cuBLAS workspaces, fragmentation
MOE_IMBALANCE = 1.25  # dropless EP > 1: the busiest rank's received rows over the mean
GROUPED_GEMM_EFFICIENCY = 1.0  # grouped expert GEMMs against a dense GEMM of their shape
# exposed host seconds per per-expert kernel of a dropless MoE layer at EP > 1 (the layer reads
# its split sizes on the host, so the host cannot run ahead); fitted on the MoE fit set only
MOE_EXPERT_KERNEL_HOST_S = 54e-6
# --optimizer-cpu-offload (docs/offload.md): host-device copies (PCIe 4.0 x16, per direction,
# as measured of pinned copies) and torch's fused CPU AdamW (elements per second, one socket)
PCIE_BANDWIDTH_GBPS = 25.0
HOST_ADAMW_ELEMENTS_PER_S = 1e9


@dataclass
class Cluster:
    num_gpus: int
    gpus_per_node: int
    gpu: GPU

    def link(self, span: int):
        """(latency key, GB/s) of a group spanning ``span`` consecutive ranks."""
        if span <= self.gpus_per_node:
            return "intra", self.gpu.intra_node_bandwidth_gbps
        return "inter", self.gpu.inter_node_bandwidth_gbps / 8


@dataclass
class Layout:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute_granularity: str = "none"  # none | selective | full
    micro_batch_size: int = 1
    pipeline_schedule: str = "1f1b"  # 1f1b | interleaved | zb-h1 | zb-v | dualpipev (v = 2)
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # p2p | allgather | a2a (docs/context_parallel.md)
    recompute_method: Optional[str] = None  # full only: uniform (None) | block
    recompute_num_layers: Optional[int] = None  # k (None: 1)
    decoder_first_pipeline_num_layers: Optional[int] = None  # uneven stages (None: L/p)
    decoder_last_pipeline_num_layers: Optional[int] = None
    # the folded expert grid of an MoE model (docs/moe.md): EP x ETP of each stage's ranks
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    optimizer_offload_fraction: float = 0.0  # --optimizer-cpu-offload's fraction (0: off)
    num_distributed_optimizer_instances: int = 1  # R: HSDP, ZeRO over DP x CP / R

    def files(self) -> FileLayout:
        """The file cut this plan's checkpoints have: the loader's and the resharder's type."""
        v_shape = self.pipeline_schedule in V_SCHEDULES
        return FileLayout(self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                          decoder_first=self.decoder_first_pipeline_num_layers,
                          decoder_last=self.decoder_last_pipeline_num_layers,
                          v_schedule=self.pipeline_schedule if v_shape else None,
                          virtual_stages=None if v_shape else
                          self.virtual_pipeline_model_parallel_size)


@functools.lru_cache(maxsize=4096)
def _chunk_ranges(files: FileLayout, L: int) -> tuple:
    return tuple(tuple(range(s, x) for s, x in rank) for rank in files.ranges(L))


@dataclass
class Model:
    """A ModelConfig as megalite's layers run it. The methods marked "stack" are what another
    stack does differently (tools/planner_stacks.py overrides them for the published rows)."""
    cfg: ModelConfig
    bytes_per_value: int = 2      # activations: 2 in 16 bits, 4 in fp32
    mask_bytes: int = 1           # dropout masks: bool on CUDA, the activation dtype on CPU
    flash_attention: bool = True  # fused attention keeps no a*s^2 score matrix
    device: str = "cuda"
    moe_imbalance: float = MOE_IMBALANCE  # dropless EP > 1 (moe_rows)
    # --overlap-moe-expert-parallel-comm: the all-to-alls behind the paired micro-batch's compute
    moe_overlap: bool = False
    mean_document_length: Optional[int] = None  # packed documents (--reset-attention-mask)
    # --cross-entropy-chunk-tokens: the logits of this many tokens at a time (0: whole logits)
    loss_chunk_tokens: int = ExecutionConfig.cross_entropy_chunk_tokens
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, device: str = "cuda", attention_backend: str = "flash",
                    moe_imbalance: float = MOE_IMBALANCE, **kw) -> "Model":
        e = 4 if cfg.params_dtype == "float32" else 2
        # CPU SDPA takes its flash kernel only without attention dropout
        flash = attention_backend == "flash" and (device == "cuda" or cfg.attention_dropout == 0)
        return cls(cfg, e, 1 if device == "cuda" else e, flash, device, moe_imbalance, **kw)

    def flops(self, t: int) -> Dict[str, float]:
        """model_flops_per_sequence (MTP's depths included) and the main model's split into
        logits (no layers), layers and attention core."""
        if t not in self.memo:
            V = self.cfg.padded_vocab_size(t)
            cfg = dataclasses.replace(self.cfg, mtp_num_layers=None)  # the main model
            main = model_flops_per_sequence(cfg, V)
            logits = model_flops_per_sequence(dataclasses.replace(
                cfg, num_layers=0, num_experts=None, moe_layer_freq="1"), V)  # no layer at all
            attn = attention_flops(cfg)
            self.memo[t] = {"total": model_flops_per_sequence(self.cfg, V), "logits": logits,
                            "attention": attn, "layers": main - logits}
        return self.memo[t]

    def attention_share(self) -> float:
        """The share of the causal mask's attention work a fused kernel does on packed documents
        of mean length L: s·L pairs a layer, at most the causal mask's (docs/planner.md, "Packed
        documents"); 1 without documents."""
        cfg, L = self.cfg, self.mean_document_length
        if L is None:
            return 1.0
        return _document_share(cfg.seq_length, L, tuple(cfg.attention_window(i)
                                                         for i in range(cfg.num_layers)))

    def layer_params(self) -> float:
        """Parameters of one dense layer (attention, norms, MLP): of a hybrid's layers, their mean
        (softmax and linear attention)."""
        if "layer" not in self.memo:
            dense = dataclasses.replace(self.cfg, num_experts=None)
            empty = dataclasses.replace(dense, num_layers=0, linear_attention_freq=None)
            self.memo["layer"] = (dense.num_parameters(False) - empty.num_parameters(False)) \
                / self.cfg.num_layers
        return self.memo["layer"]

    def moe_layer_params(self) -> Dict[str, float]:
        """One MoE layer's parameters by how they are split: ``common`` (over TP), ``router``
        (replicated) and ``expert`` (one expert's MLP, over ETP)."""
        if "moe" not in self.memo:
            # every layer MoE, per layer: attention as layer_params's mean
            one, L = dataclasses.replace(self.cfg, moe_layer_freq="1"), self.cfg.num_layers
            empty = dataclasses.replace(one, num_layers=0, linear_attention_freq=None) \
                .num_parameters(False)
            every, none = one.num_parameters(False), \
                dataclasses.replace(one, moe_router_topk=0).num_active_parameters(False)
            router = self.cfg.num_experts * self.cfg.hidden_size
            self.memo["moe"] = {"common": (none - empty) / L - router, "router": router,
                                "expert": (every - none) / L / self.cfg.num_experts}
        return self.memo["moe"]

    def moe_before(self) -> List[int]:
        """MoE layers before each layer number (0..L)."""
        if "moe_before" not in self.memo:
            self.memo["moe_before"] = [0, *itertools.accumulate(self.cfg.moe_layer_pattern())]
        return self.memo["moe_before"]

    # ------------------------------------------------------------------ stack
    def pipeline_slots(self, p: int) -> int:
        """Layer slots the pipeline split cuts."""
        return self.cfg.num_layers

    def stage_ranges(self, lay: Layout) -> tuple:
        """The layers (a range per model chunk) on each pipeline rank, as pretrain.py places them
        (the file layout's ranges, with its one-line ConfigError)."""
        return _chunk_ranges(lay.files(), self.cfg.num_layers)

    def saved_per_token(self, recompute: str) -> tuple:
        """What a layer keeps per token: (bytes of fp32 norm copies per h, attention channels,
        MLP channels), term by term in docs/planner.md, "Activation memory per layer"."""
        cfg = self.cfg
        q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
        rope = cfg.position_embedding_type == "rope"
        attn = 4 * q if kv < q else 2 * q + 2 * kv + (q + kv) * rope
        attn += 2 * q * (not self.flash_attention and self.device == "cpu"
                         and recompute != "selective")
        attn += 3 * q * cfg.attention_output_gate  # the gate's sigmoid, the output it scales
        mlp = 4 * cfg.ffn_hidden_size if cfg.swiglu else 2 * cfg.ffn_hidden_size  # (+ silu)
        return 8 * (cfg.normalization == "RMSNorm"), attn, mlp

    def moe_activation_bytes(self, tokens: float, ep: int, etp: int) -> float:
        """Bytes an MoE MLP keeps for backward per micro-batch beyond its input, for ``tokens``
        routed on this rank (docs/planner.md, "Mixture of experts", has each term's table)."""
        cfg, E, rb = self.cfg, self.bytes_per_value, _router_bytes(self.cfg)
        h, k, n_exp, fs = (cfg.hidden_size, cfg.moe_router_topk, cfg.num_experts,
                           cfg.moe_shared_expert_intermediate_size)
        sent, recv = moe_rows(self, tokens, ep)
        recv *= etp  # each ETP slice computes the rows its ETP peers received too
        router = tokens * (n_exp * rb + 12 * k + 8 * n_exp + h * rb * (E != rb)) \
            + n_exp * h * rb * (E != rb)
        if cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff > 0:
            router += tokens * (4 * n_exp + 8 * k)  # the balancing loss's scores and top-k
        router += 4 * tokens * bool(cfg.moe_z_loss_coeff)  # z-loss: the log-sum-exp
        if cfg.moe_expert_capacity_factor is not None:
            router += 9 * tokens * n_exp  # the drop's per-expert ranking (int64) and kept mask
        f = cfg.moe_ffn_hidden_size / etp
        experts = recv * ((h + (4 if cfg.swiglu else 2) * f) * E + 16 + 16 * (ep > 1)) \
            + 16 * recv * (etp > 1) + 8 * n_exp // ep
        back = sent * (2 * h * E + E + 8)
        shared = 0.0  # a dense MLP over TP; the gate keeps the shared output and its sigmoid
        if fs:
            shared = tokens * ((4 if cfg.swiglu else 2) * fs * E
                               + (h * E + E) * cfg.moe_shared_expert_gate)
        return router + experts + back + shared

    def cross_entropy_bytes(self, n: float, vt: float) -> tuple:
        """(peak bytes of the loss over n tokens of a V/t shard, bytes moved per logit) of
        tensor_parallel/cross_entropy.py (docs/planner.md, "Memory per GPU": loss head)."""
        E = self.bytes_per_value
        rows = min(n, max(1, CPU_BLOCK_ELEMENTS // vt))
        return n * (2 * vt * E + 21) + (self.device != "cuda") * rows * vt * 4 * (1 + (E != 4)), \
            3 * E

    def linear_gemms(self, gpu: GPU) -> tuple:
        """(the GPU as the layers' linear GEMMs see it, cast kernels per per-expert GEMM pass)."""
        return gpu, 0


@functools.lru_cache(maxsize=None)  # the search asks it for every layout
def _document_share(s: int, L: int, windows: tuple) -> float:
    causal = [causal_pairs([s], w) for w in windows]
    return sum(min(s * L, c) for c in causal) / sum(causal)


def head_rank(lay: Layout) -> int:
    """The pipeline rank with the final norm, output layer and loss: the last, or 0 in a V."""
    return 0 if lay.pipeline_schedule in V_SCHEDULES else lay.pipeline_model_parallel_size - 1


def mtp_layers(m: Model, lay: Layout, r: int) -> tuple:
    """(MTP depths, those MoE) on rank r: the head's, each a layer of the last one's kind."""
    d = (m.cfg.mtp_num_layers or 0) * (r == head_rank(lay))
    return d, d * m.cfg.is_moe_layer(m.cfg.num_layers)


def stage_chunks(m: Model, lay: Layout) -> tuple:
    """Layers of each model chunk on each pipeline rank."""
    return tuple(tuple(len(c) for c in rank) for rank in m.stage_ranges(lay))


def moe_layers(m: Model, layers: range) -> int:
    """How many of ``layers`` (consecutive) are MoE layers."""
    if m.cfg.num_experts is None or not layers:
        return 0
    return m.moe_before()[layers[-1] + 1] - m.moe_before()[layers[0]]


def recomputed(lay: Layout, n: int) -> int:
    """Layers of a model chunk of n whose forward full recompute runs again: all under uniform,
    the first k under block."""
    if lay.recompute_granularity != "full":
        return 0
    return min(lay.recompute_num_layers or 1, n) if lay.recompute_method == "block" else n


def chunk_activation_bytes(m: Model, lay: Layout, layers: range) -> float:
    """Bytes a model chunk of ``layers`` keeps per micro-batch: full recompute keeps each
    checkpoint's input and everything of the layers block does not recompute."""
    b, t, sp = lay.micro_batch_size, lay.tensor_model_parallel_size, lay.sequence_parallel
    experts = (lay.expert_model_parallel_size, lay.expert_tensor_parallel_size)

    def whole(layers: range, rc: str = "none") -> float:  # dense and MoE layers kept whole
        k = moe_layers(m, layers)
        return (len(layers) - k) * layer_activation_bytes(m, b, t, sp, rc) \
            + (k and k * layer_activation_bytes(m, b, t, sp, rc, experts))
    if lay.recompute_granularity != "full":
        return whole(layers, lay.recompute_granularity)
    n, k, inp = len(layers), lay.recompute_num_layers or 1, \
        layer_activation_bytes(m, b, t, sp, "full")
    if lay.recompute_method == "block":
        return min(k, n) * inp + whole(layers[min(k, n):])
    return -(-n // k) * inp


def stage_expert_params(m: Model, lay: Layout, r: int) -> float:
    """Expert parameters one GPU of pipeline stage r holds: E/EP experts per MoE layer, over ETP."""
    n = sum(moe_layers(m, c) for c in m.stage_ranges(lay)[r]) + mtp_layers(m, lay, r)[1]
    return n and n * m.cfg.num_experts / lay.expert_model_parallel_size \
        * m.moe_layer_params()["expert"] / lay.expert_tensor_parallel_size


def stage_params(m: Model, lay: Layout, r: int) -> float:
    """Parameters one GPU of pipeline stage r holds."""
    cfg, t, p = m.cfg, lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size
    vh, (d, d_moe) = cfg.padded_vocab_size(t) * cfg.hidden_size / t, mtp_layers(m, lay, r)
    layers = sum(stage_chunks(m, lay)[r]) + d
    n = layers * m.layer_params() / t
    if cfg.num_experts is not None:
        k, moe = sum(moe_layers(m, c) for c in m.stage_ranges(lay)[r]) + d_moe, m.moe_layer_params()
        n += k * ((moe["common"] - m.layer_params()) / t + moe["router"]) \
            + stage_expert_params(m, lay, r)
    emb = vh + (cfg.max_position_embeddings * cfg.hidden_size
                if cfg.position_embedding_type == "learned_absolute" else 0)
    n += emb * (r == 0)
    if r == head_rank(lay):  # final norm; output layer (the tied embedding's copy when p > 1);
        # MTP: per depth eh_proj (replicated) and 3 norms, an embedding of its own when p > 1
        untied, h = cfg.untie_embeddings_and_output_weights, cfg.hidden_size
        n += 2 * h + vh * (untied or (p > 1 and not d)) + emb * (p > 1 and d > 0) \
            + d * (2 * h * h + 6 * h)
    return n


def layer_activation_bytes(m: Model, b: int, t: int, sp: bool, recompute: str = "none",
                           moe: Optional[tuple] = None) -> float:
    """Bytes one layer keeps for backward per micro-batch: Korthikanti et al.'s Table 2 term by
    term as megalite saves them (docs/planner.md). ``moe``: (EP, ETP) of an MoE layer."""
    cfg, E = m.cfg, m.bytes_per_value
    s, h, a = cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads
    rep = t if sp else 1  # [s, b, h] tensors outside the TP region: sharded only under SP
    if recompute == "full":
        return s * b * h * E / rep  # the layer's input
    norm32, attn, mlp = m.saved_per_token(recompute)
    # 2 norm inputs, 2 norm outputs (the QKV / fc1 inputs), 2 dropout masks, fp32 norm copies
    outside = s * b * h * (4 * E + 2 * m.mask_bytes * (cfg.hidden_dropout > 0) + norm32) / rep
    if moe is not None:
        mlp, tokens = 0, s * b / rep
        outside += m.moe_activation_bytes(tokens, *moe)
        if E != _router_bytes(cfg) and not cfg.moe_shared_expert_intermediate_size:
            outside -= tokens * h * E  # the MLP norm's output: only its cast copy is kept
    if recompute == "selective":
        scores = 0.0
    elif m.flash_attention:
        scores = s * b * a * 4  # log-sum-exp per row, fp32
    else:  # softmax output, dropout mask and output: Korthikanti's 5as/h at E = 2
        scores = a * s * s * b * (E + (m.mask_bytes + E) * (cfg.attention_dropout > 0))
    mixer = (s * b * attn * E + scores) / t
    share = sum(cfg.linear_attention_pattern()) / cfg.num_layers
    if share:  # a hybrid: its layers' mean (exact for a stage holding whole periods of them)
        mixer = (1 - share) * mixer + share * linear_attention_bytes(m, b, t)
    return outside + s * b * mlp * E / t + mixer


def linear_attention_bytes(m: Model, b: int, t: int) -> float:
    """Bytes a Gated DeltaNet mixer keeps for backward per micro-batch on one of t TP ranks, as
    models/linear_attention.py saves them (docs/theory.md, "Linear attention"): its conv's
    input, output and SiLU in the activations' dtype; in fp32 the rule's 5 c x c matrices and
    6 k-wide, 3 v-wide and 4 scalar channels per value head and padded token, a state per chunk,
    and per token the q/k norms, gates and the output norm's 6 v-wide copies."""
    cfg, E = m.cfg, m.bytes_per_value
    s, G, H = cfg.seq_length, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, n = cfg.linear_key_head_dim, cfg.linear_value_head_dim, -(-cfg.seq_length // CHUNK)
    conv = (3 * s + cfg.linear_conv_kernel_dim - 1) * (2 * G * dk + H * dv) * E
    rule = n * H * (CHUNK * (5 * CHUNK + 6 * dk + 3 * dv + 4) + dk * dv)
    return b * (conv + 4 * (rule + s * (2 * G + 4 * H + 6 * H * dv))) / t


def _router_bytes(cfg: ModelConfig) -> int:
    return 8 if cfg.moe_router_dtype == "fp64" else 4


def moe_rows(m: Model, tokens: float, ep: int) -> tuple:
    """(rows this rank sends to the experts, rows its experts receive) per micro-batch of an MoE
    layer routing ``tokens`` (docs/planner.md, "Mixture of experts": dropless, capacity)."""
    cfg = m.cfg
    k, n_exp, cf = cfg.moe_router_topk, cfg.num_experts, cfg.moe_expert_capacity_factor
    most = ep * min(k, n_exp // ep) / k  # every token of every source on this rank's experts
    sent = k * tokens
    recv = sent * (min(m.moe_imbalance, most) if ep > 1 else 1)
    if cf is None:
        return sent, recv
    cap = n_exp * math.ceil(tokens * k / n_exp * cf)
    if cfg.moe_pad_expert_input_to_capacity:
        return cap, cap
    return min(sent, cap), min(recv, cap)


def loss_head_bytes(m: Model, b: int, t: int, sp: bool, kept: bool = False) -> float:
    """Peak bytes of one micro-batch's logits and cross entropy, a working set of its own; with
    ``kept``, what stays from its forward to its backward (an MTP depth's, held meanwhile)."""
    cfg, E = m.cfg, m.bytes_per_value
    n, h, vt = cfg.seq_length * b, cfg.hidden_size, cfg.padded_vocab_size(t) // t
    if m.loss_chunk_tokens:  # chunked: one chunk's cross entropy with its gradient made in
        # place of its logits, the others' per-token values, dX (+ the re-gathered input, SP) and
        # the weight gradient summed into
        c = min(n, m.loss_chunk_tokens)
        return (not kept) * (m.cross_entropy_bytes(c, vt)[0] - c * vt * E - 21 * c) + n * 21 \
            + n * h * E * (1 + sp) + vt * h * E
    # then the output layer's backward, the logits freed: their gradient, the [V/t, h] weight
    # gradient, the input gradient (+ the re-gathered input, SP)
    whole = m.cross_entropy_bytes(n, vt)[0]
    return whole if kept else max(whole, n * vt * E + vt * h * E + n * h * E * (1 + sp))


def in_flight(lay: Layout, num_micro: int, r: int = 0, paired: bool = False) -> float:
    """Micro-batches (in stage-equivalents) stage r holds at its peak as the schedules run;
    ``paired``: the F&B pairs of --overlap-moe-expert-parallel-comm."""
    p, v = lay.pipeline_model_parallel_size, lay.virtual_pipeline_model_parallel_size
    extra = int(paired and num_micro > 1)
    if p == 1:
        return 1.0 + extra
    if lay.pipeline_schedule in V_SCHEDULES:
        return max(x[0] for x in v_live_states(lay.pipeline_schedule, p, r, num_micro)) / 2
    if v > 1:
        return min(2 * (p - r - 1) + (v - 1) * p + 1 + extra, num_micro * v) / v
    return float(min(p - r + extra, num_micro))


@functools.lru_cache(maxsize=4096)
def interleaved_peak(p: int, r: int, m: int, v: int, weights: tuple,
                     paired: bool = False) -> float:
    """The most bytes rank r's live chunk forwards hold as order_interleaved runs, chunk c's
    forward holding weights[c] (unequal chunks are not in_flight's stage-equivalents)."""
    live, most = [0] * v, 0.0
    for o in schedule_order("interleaved", p, r, m, v, paired=paired):
        live[o.chunk] += 1 if o.kind == "F" else -1
        most = max(most, sum(n * w for n, w in zip(live, weights)))
    return most


@functools.lru_cache(maxsize=1024)
def v_live_states(schedule: str, p: int, r: int, m: int) -> frozenset:
    """Every (chunk forwards not yet backwarded, deferred W's pending of chunk 0, of chunk 1)
    rank r passes through in a V schedule's order (DualPipeV's peak grows with m)."""
    ops = schedule_order(schedule, p, r, m, 2)
    deferred = {(o.chunk, o.microbatch) for o in ops if o.kind == "W"}
    live, w, out = 0, [0, 0], set()
    for o in ops:
        live += {"F": 1, "B": -1}.get(o.kind, 0)
        if o.kind != "F" and (o.chunk, o.microbatch) in deferred:
            w[o.chunk] += 1 if o.kind == "B" else -1
        out.add((live, w[0], w[1]))
    return frozenset(out)


def cp_local(m: Model, c: int) -> Model:
    """The model as one CP rank sees its activations: s/C tokens of each sequence."""
    if c == 1:
        return m
    if ("cp", c) not in m.memo:  # one per C, so its own memo lasts over the search
        m.memo[("cp", c)] = dataclasses.replace(
            m, cfg=dataclasses.replace(m.cfg, seq_length=m.cfg.seq_length // c), memo={})
    return m.memo[("cp", c)]


def cp_kv_bytes(m: Model, lay: Layout) -> float:
    """K/V (and their gradients) in flight in one layer's CP attention beyond its own s/C tokens
    (``m`` is cp_local; docs/context_parallel.md measures each type)."""
    c, cfg = lay.context_parallel_size, m.cfg
    if c == 1:
        return 0.0
    n, E, t = cfg.seq_length * lay.micro_batch_size, m.bytes_per_value, \
        lay.tensor_model_parallel_size
    q, kv = cfg.num_attention_heads * cfg.kv_channels, 2 * cfg.num_query_groups * cfg.kv_channels
    per = {"p2p": 4 * kv, "allgather": 4 * c * kv, "a2a": 2 * (q + kv)}[lay.cp_comm_type]
    return n * per * E / t


def memory(m: Model, lay: Layout, gbs: int, stage: Optional[int] = None) -> Dict:
    """Bytes per GPU {params, grads, optimizer, activations, total} of the fullest stage (or of
    ``stage``). Even stages peak on the first or the last; uneven ones are each evaluated."""
    p, m = lay.pipeline_model_parallel_size, cp_local(m, lay.context_parallel_size)
    even = lay.decoder_first_pipeline_num_layers is None is lay.decoder_last_pipeline_num_layers
    return max((_stage_memory(m, lay, gbs, r) for r in ([stage] if stage is not None else
                                                        sorted({0, p - 1}) if even else range(p))),
               key=lambda d: d["total"])


def _stage_memory(m: Model, lay: Layout, gbs: int, r: int) -> Dict:
    cfg, E, t, p = m.cfg, m.bytes_per_value, lay.tensor_model_parallel_size, \
        lay.pipeline_model_parallel_size
    b, s, h, sp = lay.micro_batch_size, cfg.seq_length, cfg.hidden_size, lay.sequence_parallel
    ep, etp, d = lay.expert_model_parallel_size, lay.expert_tensor_parallel_size, \
        lay.data_parallel_size * lay.context_parallel_size
    psi, psi_e = stage_params(m, lay, r), stage_expert_params(m, lay, r)
    # ZeRO over DP x CP (HSDP: one of R instances); the experts over the expert-data-parallel
    # group, t d / (ETP x EP)
    shard = d // lay.num_distributed_optimizer_instances
    parts = [theoretical_model_state_bytes(n, size, lay.zero_stage, cfg.params_dtype)
             for n, size in ((psi - psi_e, shard), (psi_e, t * d // (etp * ep))) if n]
    st = {k: sum(x[k] for x in parts) for k in parts[0]}
    num_micro = max(gbs // (lay.data_parallel_size * b), 1)
    paired = m.moe_overlap and ep > 1  # the F&B pairs hold one micro-batch more (in_flight)
    live, ranges = in_flight(lay, num_micro, r, paired), m.stage_ranges(lay)[r]
    chunks, moe = tuple(len(c) for c in ranges), [moe_layers(m, c) for c in ranges]
    per_chunk = tuple(chunk_activation_bytes(m, lay, c) for c in ranges)
    act = live * sum(per_chunk)
    if lay.pipeline_schedule == "interleaved" and len(set(per_chunk)) > 1:
        act = interleaved_peak(p, r, num_micro, lay.virtual_pipeline_model_parallel_size,
                               per_chunk, paired)
    # what a deferred W pass keeps: each linear's input and output gradient (not grouped GEMMs')
    q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    w_layer, w_moe = (s * b * E * ((2 * q + 2 * kv + (2 + cfg.swiglu) * width) / t
                                   + (2 + 2 * (width > 0)) * h)
                      for width in (cfg.ffn_hidden_size, cfg.moe_shared_expert_intermediate_size
                                    or 0))
    vt = cfg.padded_vocab_size(t) / t
    w_head = s * b * E * (vt + h)
    w_chunk = [(n - k) * w_layer + k * w_moe for n, k in zip(chunks, moe)]
    if lay.pipeline_schedule in V_SCHEDULES:  # 2 chunks of L/(2p) layers; chunk 1 of rank 0
        one = max(per_chunk)  # holds the head
        act = max(fw * one + (w0 + w1) * max(w_chunk) + w1 * w_head * (r == 0)
                  for fw, w0, w1 in v_live_states(lay.pipeline_schedule, p, r, num_micro))
    if r == 0:  # token ids (int64) and the embedding's dropout mask
        act += live * s * b * (8 + h * m.mask_bytes * (cfg.hidden_dropout > 0) / (t if sp else 1))
    # transient working set: a layer's backward plus the recomputed checkpoint, or the loss head
    fl, n = (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size / t, max(chunks)
    again = min(lay.recompute_num_layers or 1, n) if lay.recompute_method != "block" else 1
    kinds = [None] * (sum(moe) < sum(chunks)) + [(ep, etp)] * (sum(moe) > 0) or [None]  # dense, MoE
    biggest = max(layer_activation_bytes(m, b, t, sp, "none", k) for k in kinds)
    layer_work = max(s * b * (2 * fl + 2 * h) * E + fl * h * E if k is None else
                     moe_backward_bytes(m, s * b / (t if sp else 1), ep, etp) for k in kinds)
    work = [layer_work + cp_kv_bytes(m, lay) + max(0, again - n + recomputed(lay, n)) * biggest]
    if r == head_rank(lay):  # the final norm's input and output are kept; per MTP depth its
        # layer, embedded tokens, [emb, h], norm output and its head's gradients (one micro-batch:
        # at the head, a forward meets its backward)
        d, d_moe = mtp_layers(m, lay, r)
        act += s * b * 2 * h * E / (t if sp else 1) + d * (layer_activation_bytes(
            m, b, t, sp, lay.recompute_granularity, (ep, etp) if d_moe else None)
            + s * b * 5 * h * E / (t if sp else 1) + loss_head_bytes(m, b, t, sp, kept=True))
        work.append(loss_head_bytes(m, b, t, sp))
    if lay.pipeline_schedule == "zb-h1":  # the r deferred W's stage r holds (order_zb_h1)
        act += r * (sum(w_chunk) + w_head * (r == p - 1))
    grads = st["grads_bytes"]
    if lay.zero_stage == 2:  # fp32 storage of the buckets being filled and reduced
        grads += 4 * min(2 * DEFAULT_BUCKET_SIZE, psi)
    if lay.zero_stage == 3:  # the gathered unit in use with its gradient, the next one prefetched
        unit = m.layer_params() / t
        if sum(moe):  # an MoE layer's (its experts a unit of their own at EP > 1, zero3.py)
            unit = max(unit, (m.moe_layer_params()["common"] / t + m.moe_layer_params()["router"]
                              + psi_e / sum(moe)))
        act += max(unit, vt * h * (r in (0, p - 1))) * (E + 4) + unit * E
    # offload: the moments and the 16-bit model's masters leave the device (ZeRO 0 keeps its
    # masters, the host step's landing); the host holds fp32 masters, moments and gradients
    f, local = lay.optimizer_offload_fraction, st["optimizer_states_bytes"] / 8
    moved = f * (st["optimizer_states_bytes"] + st["master_params_bytes"] * (lay.zero_stage > 0))
    out = {"params": st["params_bytes"], "grads": grads,
           "optimizer": st["master_params_bytes"] + st["optimizer_states_bytes"] - moved,
           "activations": act + max(work)}
    out["total"] = sum(out.values())
    if f:  # (ZeRO 1-3: a staging copy in the 16-bit model's dtype, the weights go up rounded)
        out["host_offload"] = f * local * (16 + E * (E < 4) * (lay.zero_stage > 0))
    return out


def moe_backward_bytes(m: Model, tokens: float, ep: int, etp: int) -> float:
    """The transient working set of an MoE MLP's backward: the received rows', their fc1
    output's and the sent rows' gradients, one projection's weight gradient of E/EP experts."""
    cfg, E = m.cfg, m.bytes_per_value
    sent, recv = moe_rows(m, tokens, ep)
    fc1, h = (2 if cfg.swiglu else 1) * cfg.moe_ffn_hidden_size / etp, cfg.hidden_size
    return (etp * recv * (2 * fc1 + 2 * h) + sent * h
            + cfg.num_experts // ep * fc1 * h) * E


def _gemm_s(flops: float, dims, gpu: GPU) -> float:
    n = min(dims)
    return flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * n / (n + GEMM_HALF_DIM))


def _coll_s(all_reduce: bool, nbytes: float, n: int, link) -> float:
    """Ring: all-reduce moves 2(n-1)/n of the bytes per GPU, all-gather/reduce-scatter (n-1)/n."""
    if n <= 1:
        return 0.0
    return COLLECTIVE_LATENCY_S[link[0]] + (1 + all_reduce) * (n - 1) / n * nbytes \
        / (link[1] * 1e9 * COLLECTIVE_EFFICIENCY)


def v_bubble(schedule: str, p: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time per rank of a V schedule with chunk op times F, B (input gradient), W: ZB-V's
    (p-1) max(F, 2(B - W)); DualPipeV's DeepSeek-V3 bound (docs/planner.md, "Step time")."""
    return (p - 1) * (max(t_f, 2 * (t_b - t_w)) if schedule == "zb-v" else t_f + 2 * t_b - 2 * t_w)


def _cp_layer_s(m: Model, lay: Layout, cl: Cluster, attn: float) -> float:
    """Exposed CP communication of one layer's forward, one micro-batch: the ring hides each
    step's K/V behind that step's attention (``attn``, C steps); all-gather and all-to-all wait."""
    c, cfg, t = lay.context_parallel_size, m.cfg, lay.tensor_model_parallel_size
    if c == 1:
        return 0.0
    lat, bw = cl.link(t * c)
    bw = bw * 1e9 * COLLECTIVE_EFFICIENCY
    kv = cfg.seq_length // c * lay.micro_batch_size * m.bytes_per_value / t  # per K/V channel
    q, kv = kv * cfg.num_attention_heads * cfg.kv_channels, kv * 2 * cfg.num_query_groups \
        * cfg.kv_channels
    if lay.cp_comm_type == "p2p":  # C - 1 steps, each a neighbour's K/V block
        return (c - 1) * max(0.0, COLLECTIVE_LATENCY_S[lat] + kv / bw - attn / c)
    if lay.cp_comm_type == "allgather":  # the whole sequence's K/V
        return _coll_s(False, c * kv, c, (lat, bw / 1e9 / COLLECTIVE_EFFICIENCY))
    # a2a: q, k, v to head shards and the output back, (C - 1)/C of each leaves the rank
    return (4 * COLLECTIVE_LATENCY_S[lat] + (c - 1) / c * (2 * q + kv) / bw)


def _moe_layer_s(m: Model, lay: Layout, cl: Cluster, M: float) -> Dict[str, float]:
    """One MoE MLP, one micro-batch, forward, on one GPU (``M`` tokens, s b / C): its compute,
    deferrable W, exposed exchanges, TP pairs and host time (planner.md, "Mixture of experts")."""
    cfg, gpu, E = m.cfg, cl.gpu, m.bytes_per_value
    t, ep, etp = (lay.tensor_model_parallel_size, lay.expert_model_parallel_size,
                  lay.expert_tensor_parallel_size)
    h, f, fs = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size
    tokens = M / t  # MoE with TP has SP: each TP rank routes its own tokens
    sent, recv = moe_rows(m, tokens, ep)
    rows, fc1 = etp * recv, f * (1 + cfg.swiglu)  # this ETP slice's rows: its peers' too
    per_expert = rows / (cfg.num_experts // ep)
    gg, casts = m.linear_gemms(gpu)
    experts = sum(_gemm_s(2 * rows * k * n, (per_expert, k, n), gg)
                  for k, n in ((h, fc1 / etp), (f / etp, h))) / GROUPED_GEMM_EFFICIENCY
    router = _gemm_s(2 * tokens * h * cfg.num_experts, (tokens, h, cfg.num_experts), gpu)
    shared = sum(_gemm_s(2 * M * k * n, (M, k, n), gg) for k, n in
                 ((h, fs * (1 + cfg.swiglu) / t), (fs / t, h))) if fs else 0.0
    hbm = gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY
    moved = (5 * sent + 4 * recv * (ep > 1) + 4 * rows * (etp > 1)) * h + tokens * h \
        + 3 * rows * fc1 / etp + (3 * M * fs * (1 + cfg.swiglu) / t if fs else 0)
    a2a = 0.0
    if ep > 1:  # the busiest rank moves its larger side, (EP - 1)/EP of its rows leave the rank
        lat, bw = cl.link(etp * ep)
        most, nodes = max(sent, recv), etp * ep // cl.gpus_per_node
        out = most * (ep - 1) / ep * h * E / (bw * 1e9 * COLLECTIVE_EFFICIENCY)
        if nodes > 1:  # across nodes: (nodes - 1)/nodes of the rows cross the network, the
            # rows to the rank's own node go over NVLink meanwhile
            intra = (most / nodes - most / ep) * h * E / (
                gpu.intra_node_bandwidth_gbps * 1e9 * COLLECTIVE_EFFICIENCY)
            out = max(intra, most * (nodes - 1) / nodes * h * E
                      / (bw * 1e9 * COLLECTIVE_EFFICIENCY))
        a2a = 2 * (COLLECTIVE_LATENCY_S[lat] + out)
    if etp > 1:
        a2a += 2 * _coll_s(False, rows * h * E, etp, cl.link(etp))
    host = 0.0
    if ep > 1 and cfg.moe_expert_capacity_factor is None and m.device == "cuda":
        host = cfg.num_experts // ep * MOE_EXPERT_KERNEL_HOST_S
    return {"compute": router + experts + shared + moved * E / hbm, "w": shared, "a2a": a2a,
            "tp": 1 if fs else 0, "host_f": (2 + casts) * host, "host_b": (4 + casts) * host}


def _layer_s(m: Model, lay: Layout, cl: Cluster) -> Dict[str, float]:
    """One layer, one micro-batch, forward, on this GPU's shard: its GEMMs, attention core, all
    of it; an MoE layer's, and its deferrable W; the output layer with the loss."""
    cfg, gpu, E = m.cfg, cl.gpu, m.bytes_per_value
    t, c, s, h = lay.tensor_model_parallel_size, lay.context_parallel_size, cfg.seq_length, \
        cfg.hidden_size
    f, q, kv = cfg.ffn_hidden_size, cfg.num_attention_heads * cfg.kv_channels, \
        cfg.num_query_groups * cfg.kv_channels
    fc1, M = f * (1 + cfg.swiglu), s * lay.micro_batch_size / c
    hbm = gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY
    gg = m.linear_gemms(gpu)[0]
    attn_gemms = sum(_gemm_s(2 * M * k * n, (M, k, n), gg) for k, n in ((h, (q + 2 * kv) / t),
                                                                        (q / t, h)))
    gemm = attn_gemms + sum(_gemm_s(2 * M * k * n, (M, k, n), gg)
                            for k, n in ((h, fc1 / t), (f / t, h)))
    attn_flops = m.flops(t)["attention"] / cfg.num_layers / 3 * lay.micro_batch_size / t / c
    if m.flash_attention:  # fused: skips what packed documents mask out (an unfused one cannot)
        attn = attn_flops * m.attention_share() / (
            gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * FLASH_ATTENTION_EFFICIENCY)
    else:  # two batched GEMMs (inner dimension d or s) and a memory-bound softmax
        attn = _gemm_s(attn_flops, (cfg.kv_channels, s), gpu) \
            + cfg.num_attention_heads / t * s * M * UNFUSED_SOFTMAX_BYTES / hbm
    norms = M * 12 * h / (t if lay.sequence_parallel else 1) * E / hbm
    out = {"gemm": gemm, "attn": attn, "fwd": gemm + attn + norms + M * 3 * fc1 / t * E / hbm}
    if cfg.num_experts is not None:  # attention as a dense layer's, its MLP _moe_layer_s
        out["moe"] = _moe_layer_s(m, lay, cl, M)
        out["fwd_moe"] = attn_gemms + attn + norms + out["moe"]["compute"]
        out["w_moe"] = attn_gemms + out["moe"]["w"]
    vt = cfg.padded_vocab_size(t) / t
    # chunked (docs/tensor_parallel.md): backward recomputes the logits, a fourth GEMM
    out["logits"] = (3 + (m.loss_chunk_tokens > 0)) * _gemm_s(2 * M * h * vt, (M, h, vt), gpu) \
        + m.cross_entropy_bytes(M, vt)[1] * M * vt / hbm
    return out


def offload_s(lay: Layout, local: float, E: int) -> float:
    """--optimizer-cpu-offload's seconds per step for ``local`` optimizer elements: gradients
    down in fp32, weights up in the model's dtype (ZeRO 0: into its fp32 masters), the host's
    AdamW; exposed, as the next forward needs the weights (docs/offload.md)."""
    return lay.optimizer_offload_fraction * local * (
        (4 + (E if lay.zero_stage else 4)) / (PCIE_BANDWIDTH_GBPS * 1e9)
        + 1 / HOST_ADAMW_ELEMENTS_PER_S)


def step_time(m: Model, lay: Layout, cl: Cluster, gbs: int) -> Dict[str, float]:
    """Seconds per step: compute, exposed TP, CP and EP comm, bubble (with p2p), exposed DP/ZeRO
    comm (docs/planner.md, "Step time"). Under CP a GPU computes s/C tokens."""
    cfg, gpu, E = m.cfg, cl.gpu, m.bytes_per_value
    t, p, v, d, b = (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size,
                     lay.virtual_pipeline_model_parallel_size, lay.data_parallel_size,
                     lay.micro_batch_size)
    c, rc, fl = lay.context_parallel_size, lay.recompute_granularity, m.flops(t)
    M, hbm = cfg.seq_length * b / c, gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY
    lt = _layer_s(m, lay, cl)
    fwd, gemm, moe, h = lt["fwd"], lt["gemm"], lt.get("moe"), cfg.hidden_size
    # MTP: per depth one more output head, and eh_proj (replicated: under SP on M/t tokens)
    toks, mtp = M / (t if lay.sequence_parallel else 1), cfg.mtp_num_layers or 0
    logits = (1 + mtp) * lt["logits"] + mtp * 3 * _gemm_s(4 * toks * h * h, (toks, 2 * h, h), gpu)
    sel = lt["attn"] if rc == "selective" else 0.0  # the attention core again, every layer
    # TP: 2 all-reduces per layer and pass (SP: all-gather + reduce-scatter, the same bytes)
    ar, cp_pass = _coll_s(True, M * cfg.hidden_size * E, t, cl.link(t)), \
        _cp_layer_s(m, lay, cl, lt["attn"])
    chunks, ranges = stage_chunks(m, lay), m.stage_ranges(lay)

    def stage(r):  # a micro-batch's F + B (backward = 2 x forward) + recompute, TP, CP, EP;
        # then the forward and the deferrable weight GEMMs of its layers
        dm, dm_moe = mtp_layers(m, lay, r)  # the head's MTP layers; k: full recompute
        n, k = sum(chunks[r]) + dm, sum(recomputed(lay, x) for x in chunks[r]) + dm * (rc == "full")
        out = [n * (3 * fwd + sel) + k * fwd + logits * (r == head_rank(lay)),
               (4 * n + 2 * k) * ar, (3 * n + k + n * (sel > 0)) * cp_pass, 0.0, n * fwd,
               n * gemm]
        n_moe = sum(moe_layers(m, x) for x in ranges[r]) + dm_moe
        if n_moe:  # MoE layers in place of dense ones (recomputed in proportion)
            k_moe, fwd_moe = k * n_moe / n, lt["fwd_moe"]
            out[0] += n_moe * 3 * (fwd_moe - fwd) + k_moe * (fwd_moe - fwd) \
                + n_moe * (moe["host_f"] + moe["host_b"]) + k_moe * moe["host_f"]
            out[1] += (n_moe * 2 + k_moe) * (moe["tp"] - 1) * ar
            out[3] = (2 * n_moe + k_moe) * moe["a2a"]
            if m.moe_overlap and lay.expert_model_parallel_size > 1:  # behind the paired
                out[3] = max(0.0, out[3] - 0.9 * 3 * n_moe * fwd_moe)  # micro-batch's compute
            out[4] += n_moe * (fwd_moe - fwd + moe["host_f"])
            out[5] += n_moe * (lt["w_moe"] - gemm)
        return out

    # the slowest stage sets the pipeline's pace: the head's, or the one with the most layers
    pace = max(range(p), key=lambda r: sum(stage(r)[:4]))
    per_micro, tp_micro, cp_micro, ep_micro, f_stage, w_stage = stage(pace)
    logits *= pace == head_rank(lay)
    num_micro = gbs // (d * b)
    compute, tp, cp, ep = (num_micro * x for x in (per_micro, tp_micro, cp_micro, ep_micro))
    # bubble: (p - 1)/v idle slots of a micro-batch's F + B; ZB-H1 fills them with W (the
    # weight-gradient GEMMs, one forward's worth); p2p of activations and their gradients
    slot = per_micro + tp_micro + cp_micro + ep_micro
    bubble = (p - 1) * (slot - w_stage) if lay.pipeline_schedule == "zb-h1" \
        else (p - 1) / v * slot
    if lay.pipeline_schedule in V_SCHEDULES:  # in chunk times (half a stage's): F, B, W
        f_c, w_c = (f_stage + tp_micro / 2 + ep_micro / 2 + logits / 3) / 2, w_stage / 2
        bubble = v_bubble(lay.pipeline_schedule, p, f_c, slot / 2 - f_c - w_c, w_c)
    if p > 1:
        link = cl.link(t * c * d * p)
        msg = M * cfg.hidden_size * E / (t if lay.sequence_parallel else 1)
        bubble += 2 * (num_micro + (p - 1) / v) * (COLLECTIVE_LATENCY_S[link[0]] / 2 + msg
                                                   / (link[1] * 1e9 * COLLECTIVE_EFFICIENCY))
    # DP/ZeRO over the largest stage's parameters (gradients reduced in fp32), overlapped with
    # the last backward (+ the first forward for the parameter gather); ZeRO-3 gathers twice and
    # reduce-scatters every micro-batch, hidden by prefetch but for each pass's first unit.
    # Expert parameters go over the expert-data-parallel group instead.
    # HSDP: ZeRO inside an instance of d/R ranks, then each rank's fp32 gradient shard
    # all-reduced across the R instances after the backward (docs/data_parallel.md, "HSDP")
    d, r_inst = d * c, lay.num_distributed_optimizer_instances  # over DP x CP
    big = max(range(p), key=lambda r: stage_params(m, lay, r))
    psi, psi_e, link = stage_params(m, lay, big), stage_expert_params(m, lay, big), \
        cl.link(t * d // r_inst)
    across = 4 * (psi - psi_e) * r_inst / d
    groups = [(n, size) for n, size in ((psi - psi_e, d // r_inst), (psi_e, t * d // (
        lay.expert_tensor_parallel_size * lay.expert_model_parallel_size))) if n]

    def over_groups(all_reduce: bool, per_param: int) -> float:
        return sum(_coll_s(all_reduce, per_param * n, size, link) for n, size in groups)
    if lay.zero_stage == 0:
        dp, overlap = over_groups(True, 4), per_micro - logits - f_stage
    elif lay.zero_stage <= 2:
        dp = over_groups(False, 4) + over_groups(False, E)
        overlap = per_micro - logits
    else:
        one = 2 * over_groups(False, E) + over_groups(False, 4)
        first = 2 * _coll_s(False, E * m.layer_params() / t, d // r_inst, link)
        dp, overlap = num_micro * (max(one, 0.9 * per_micro) + first), compute
    # (at ZeRO 1 it overlaps the backward with the buckets' reductions; at 2 and 3 it follows)
    replicate = _coll_s(True, across, r_inst, cl.link(t * d))
    hidden = replicate if lay.zero_stage == 1 else 0.0
    dp = max(0.0, dp + hidden - 0.9 * overlap) + replicate - hidden
    # optimizer step: one read and one write of this GPU's model states
    compute += 2 * sum(theoretical_model_state_bytes(n, size, lay.zero_stage, cfg.params_dtype)[
        "total_bytes"] for n, size in groups) / hbm
    offload = offload_s(lay, sum(n / (size if lay.zero_stage else 1) for n, size in groups), E)
    total = compute + tp + bubble + dp + cp + ep + offload
    extra = fl["attention"] / 3 if rc == "selective" else fl["layers"] / 3 / cfg.num_layers * (sum(
        recomputed(lay, x) for rank in chunks for x in rank) + mtp * (rc == "full"))  # + depths
    return {"compute_s": compute, "tp_comm_s": tp, "bubble_s": bubble, "dp_comm_s": dp,
            "cp_comm_s": cp, "ep_comm_s": ep, "offload_s": offload, "step_time_s": total,
            "dp_replicate_s": replicate, "dp_replicate_bytes": 2 * (r_inst - 1) / r_inst * across,
            "num_micro": num_micro,
            "tflops_per_gpu": (fl["total"] + extra) * gbs / cl.num_gpus / total / 1e12,
            "mfu": fl["total"] * gbs / cl.num_gpus / total / (gpu.peak_tflops * 1e12)}


# ------------------------------------------------------------------------------- pretrain.py
def estimate_for_run(cfg, world_size: int, device: str, stage: int,
                     moe_imbalance: float = MOE_IMBALANCE) -> Optional[Dict]:
    """The planner's memory for the layout pretrain.py runs, at pipeline stage ``stage``."""
    par, tr, opt, ex = cfg.parallel, cfg.training, cfg.optimizer, cfg.execution
    t, p, v = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
               2 if tr.pipeline_schedule in V_SCHEDULES
               else par.virtual_pipeline_model_parallel_size or 1)
    c, moe = par.context_parallel_size, cfg.model.num_experts is not None
    lay = Layout(t, p, v, world_size // (t * p * c), opt.zero_stage, par.sequence_parallel,
                 ex.recompute_granularity or "none", tr.micro_batch_size,
                 tr.pipeline_schedule or default_schedule(v), c, par.cp_comm_type,
                 ex.recompute_method, ex.recompute_num_layers,
                 tr.decoder_first_pipeline_num_layers, tr.decoder_last_pipeline_num_layers,
                 par.expert_model_parallel_size, par.expert_tp_size if moe else 1,
                 opt.optimizer_offload_fraction * opt.optimizer_cpu_offload,
                 opt.num_distributed_optimizer_instances)
    model = Model.from_config(cfg.model, device, moe_imbalance=moe_imbalance,
                              moe_overlap=tr.overlap_moe_expert_parallel_comm,
                              loss_chunk_tokens=ex.cross_entropy_chunk_tokens)
    return memory(model, lay, tr.global_batch_size, stage)
