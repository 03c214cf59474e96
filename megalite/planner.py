"""Layout planner: memory per GPU and step time for a TP x SP x PP x VPP x DP x ZeRO layout.

docs/planner.md has the derivations, every constant's source and the validation. In short:

* Memory per GPU = model states (megalite.memory's ZeRO accounting, stage by stage) + the
  activations the schedule keeps in flight on a stage (Korthikanti et al. 2022, Table 2, as
  megalite's layers save them; ``layer_activation_bytes``) + the largest transient working set
  (logits and cross entropy, a layer's gradients, the recomputed layer, ZeRO-3's gathered units).
* Step time = compute (GEMMs at a size-dependent fraction of peak, attention, memory-bound
  element-wise work at HBM bandwidth) + exposed TP collectives + pipeline bubble (and p2p) +
  exposed DP/ZeRO collectives; collectives cost latency + bytes / (bandwidth x efficiency).
* FLOPs come from megalite.logging.model_flops_per_sequence (the FLOPs pretrain.py logs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megalite.config import ConfigError, ModelConfig
from megalite.distributed.ddp import DEFAULT_BUCKET_SIZE
from megalite.logging import model_flops_per_sequence
from megalite.memory import theoretical_model_state_bytes

GiB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    """Datasheet figures (dense 16-bit tensor-core peak, HBM, NVLink per GPU per direction, one
    NIC per GPU) and the sustained fraction of peak large GEMMs reach inside training."""
    name: str
    peak_tflops: float
    memory_gib: float
    hbm_gbps: float  # GB/s
    intra_node_bandwidth_gbps: float  # GB/s per GPU, one direction (NVLink)
    inter_node_bandwidth_gbps: float  # Gb/s per GPU (InfiniBand NIC)
    gemm_efficiency: float


GPUS = {
    "A100-80GB": GPU("A100-80GB", 312.0, 80.0, 2039.0, 300.0, 200.0, 0.70),
    "H100-80GB": GPU("H100-80GB", 989.0, 80.0, 3350.0, 450.0, 400.0, 0.62),
    "H200": GPU("H200", 989.0, 141e9 / GiB, 4800.0, 450.0, 400.0, 0.62),
}
# Efficiency constants (docs/planner.md "Constants" gives each one's source).
GEMM_HALF_DIM = 96          # a GEMM whose smallest dimension is n runs at n / (n + 96) of the max
FLASH_ATTENTION_EFFICIENCY = 0.55   # fused attention, counted (non-causal) FLOPs vs GEMM max
UNFUSED_SOFTMAX_BYTES = 13  # bytes moved per score element fwd (scores, softmax, dropout, bmm read)
HBM_EFFICIENCY = 0.90       # streaming kernels reach ~90% of datasheet HBM bandwidth
COLLECTIVE_EFFICIENCY = 0.80  # NCCL bus bandwidth / link bandwidth for large messages
COLLECTIVE_LATENCY_S = {"intra": 10e-6, "inter": 25e-6}  # per collective (ring start-up)
USABLE_MEMORY_FRACTION = 0.92  # CUDA context, NCCL/cuBLAS workspaces, allocator fragmentation


@dataclass
class Cluster:
    num_gpus: int
    gpus_per_node: int
    gpu: GPU


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
    pipeline_schedule: str = "1f1b"  # 1f1b | interleaved | zb-h1

    def key(self) -> dict:
        return {k: getattr(self, k) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "data_parallel_size", "zero_stage",
            "sequence_parallel", "recompute_granularity", "micro_batch_size")}

    def short(self) -> str:
        v = self.virtual_pipeline_model_parallel_size
        return (f"TP{self.tensor_model_parallel_size}{'+SP' if self.sequence_parallel else ''} "
                f"PP{self.pipeline_model_parallel_size}{f'x{v}' if v > 1 else ''}"
                f"{' ZB-H1' if self.pipeline_schedule == 'zb-h1' else ''} "
                f"DP{self.data_parallel_size} ZeRO{self.zero_stage} mb{self.micro_batch_size} "
                f"recompute {self.recompute_granularity}")


@dataclass
class Model:
    """What the planner needs of a model: its ModelConfig plus how activations are stored."""
    cfg: ModelConfig
    bytes_per_value: int = 2      # 16-bit activations (4 in fp32)
    mask_bytes: int = 1           # dropout masks: bool on CUDA; CPU dropout keeps a float mask
    flash_attention: bool = True  # fused attention keeps no a*s^2 score matrix
    device: str = "cuda"          # cpu: megalite's unfused path is SDPA's math fallback
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # FLOPs, layer size

    @classmethod
    def from_config(cls, cfg: ModelConfig, device: str = "cuda",
                    attention_backend: str = "flash") -> "Model":
        e = 4 if cfg.params_dtype == "float32" else 2
        # On CPU, SDPA takes its flash kernel only without attention dropout.
        flash = attention_backend == "flash" and (device == "cuda" or cfg.attention_dropout == 0)
        return cls(cfg, e, 1 if device == "cuda" else e, flash, device)


def model_from_args(num_layers, hidden_size, num_attention_heads, seq_length, vocab_size=51200,
                    **kw) -> Model:
    """A Model from the flags' values (tests and docs); ``kw``: ModelConfig fields and Model's."""
    extra = {k: kw.pop(k) for k in ("bytes_per_value", "mask_bytes", "flash_attention")
             if k in kw}
    cfg = ModelConfig(num_layers=num_layers, hidden_size=hidden_size,
                      num_attention_heads=num_attention_heads, seq_length=seq_length,
                      vocab_size=vocab_size, params_dtype=kw.pop("params_dtype", "bfloat16"),
                      hidden_dropout=kw.pop("hidden_dropout", 0.1),
                      attention_dropout=kw.pop("attention_dropout", 0.1), **kw)
    m = Model.from_config(cfg)
    return dataclasses.replace(m, **extra)


# ------------------------------------------------------------------------------------ FLOPs
def flops_per_sequence(m: Model, t: int) -> Dict[str, float]:
    """megalite.logging's model FLOPs split into layers / attention core / logits (fwd + bwd).

    Only model_flops_per_sequence is evaluated (no second copy of the formula): the logits part
    is what remains with no layers, and the attention core is the part quadratic in s.
    """
    if ("flops", t) in m.memo:
        return m.memo[("flops", t)]
    cfg, V = m.cfg, m.cfg.padded_vocab_size(t)
    total = model_flops_per_sequence(cfg, V)
    logits = model_flops_per_sequence(dataclasses.replace(cfg, num_layers=0), V)
    s = cfg.seq_length
    one = model_flops_per_sequence(dataclasses.replace(cfg, seq_length=1), V)
    quad = (total / s - one) / (s - 1) if s > 1 else 0.0  # per-token FLOPs grow linearly in s
    attention = quad * s * s
    m.memo[("flops", t)] = {"total": total, "logits": logits, "attention": attention,
                            "gemm": total - logits - attention}
    return m.memo[("flops", t)]


def recompute_flops(f: Dict[str, float], recompute: str) -> float:
    """Extra forward FLOPs of recomputation (forward = 1/3 of forward + backward)."""
    if recompute == "full":
        return (f["gemm"] + f["attention"]) / 3
    if recompute == "selective":
        return f["attention"] / 3
    return 0.0


# ----------------------------------------------------------------------------------- memory
def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer layer (ModelConfig.num_parameters, one layer's worth)."""
    one = dataclasses.replace(cfg, num_layers=1).num_parameters(include_embeddings=False)
    return one - dataclasses.replace(cfg, num_layers=0).num_parameters(include_embeddings=False)


def _layer_params(m: Model) -> int:
    if "layer" not in m.memo:
        m.memo["layer"] = layer_params(m.cfg)
    return m.memo["layer"]


def stage_params(m: Model, lay: Layout, stage: int) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds (its TP shard)."""
    cfg, t, p = m.cfg, lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size
    V, h = cfg.padded_vocab_size(t), cfg.hidden_size
    n = cfg.num_layers / p * _layer_params(m) / t
    if stage == 0:
        n += V * h / t + (cfg.max_position_embeddings * h
                          if cfg.position_embedding_type == "learned_absolute" else 0)
    if stage == p - 1:
        n += h * (2 if cfg.normalization == "LayerNorm" else 1)
        if cfg.untie_embeddings_and_output_weights or p > 1:
            n += V * h / t  # the output layer (a copy of the tied embedding when p > 1)
    return n


def layer_activation_bytes(m: Model, b: int, t: int, sp: bool, recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch of ``b`` sequences.

    Korthikanti et al. 2022, Table 2, term by term as megalite's layers save them (measured in
    docs/planner.md): [s, b, h] tensors outside the TP region are divided by t only under SP.
    """
    cfg, E = m.cfg, m.bytes_per_value
    s, h, f, a = cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    q = a * cfg.kv_channels
    kv = cfg.num_query_groups * cfg.kv_channels
    rep = t if sp else 1
    if recompute == "full":
        return s * b * h * E / rep  # the layer's input only
    mask = m.mask_bytes if cfg.hidden_dropout > 0 else 0
    # outside the TP region: 2 norm inputs, 2 norm outputs (the QKV / fc1 inputs), 2 masks
    outside = s * b * h * (4 * E + 2 * mask) / rep
    if cfg.normalization == "RMSNorm":  # megalite's RMSNorm also keeps its normalized x (fp32
        outside += 2 * s * b * h * 4 / rep  # in 16 bits, where it keeps x in fp32 instead of x)
    # attention's inputs and output (the projection's input): views of the fused QKV output
    # (q + 2kv) plus the output q; GQA copies q and repeats k and v to every head (4q, the fused
    # output is then not kept); RoPE's rotated q and k are new tensors
    rope = cfg.position_embedding_type == "rope"
    attn = 4 * q if kv < q else q + 2 * kv + q + (q + kv if rope else 0)
    if not m.flash_attention and m.device == "cpu" and recompute != "selective":
        attn += 2 * q  # SDPA's math fallback scales copies of q and k (recomputed if selective)
    mlp = 4 * f if cfg.swiglu else 2 * f  # fc1 output(s) and the fc2 input (SwiGLU: + silu out)
    inside = s * b * (attn + mlp) * E / t
    if m.flash_attention:
        scores = 0.0 if recompute == "selective" else s * b * a * 4 / t  # log-sum-exp, fp32
    elif recompute == "selective":
        scores = 0.0
    else:  # softmax output, dropout mask and output: 5as/h of Korthikanti's table at E = 2
        drop = cfg.attention_dropout > 0
        scores = a * s * s * b * (E + (m.mask_bytes + E if drop else 0)) / t
    return outside + inside + scores


def in_flight(lay: Layout, num_micro: int, stage: int = 0) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak, in units of the
    stage's layers (interleaved: chunks of L/(p v) layers), as the schedules run them
    (pipeline_parallel/schedules.py: 1F1B and ZB-H1 warm up p - r - 1 forwards, interleaved
    2(p - r - 1) + (v - 1)p)."""
    p, v = lay.pipeline_model_parallel_size, lay.virtual_pipeline_model_parallel_size
    if p == 1:
        return 1.0
    if v > 1:
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, num_micro * v) / v
    return float(min(p - stage, num_micro))


def memory(m: Model, lay: Layout, global_batch: int, stage: Optional[int] = None) -> Dict:
    """Bytes per GPU: {params, grads, optimizer, activations, total} of the fullest stage (or of
    ``stage``). 'activations' includes the transient working set at the peak."""
    p = lay.pipeline_model_parallel_size
    stages = [stage] if stage is not None else sorted({0, p - 1})
    return max((_stage_memory(m, lay, global_batch, r) for r in stages),
               key=lambda d: d["total"])


def _stage_memory(m: Model, lay: Layout, gbs: int, r: int) -> Dict:
    cfg, E = m.cfg, m.bytes_per_value
    t, p, d = lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size, \
        lay.data_parallel_size
    b, sp = lay.micro_batch_size, lay.sequence_parallel
    s, h = cfg.seq_length, cfg.hidden_size
    psi = stage_params(m, lay, r)
    V_h = cfg.padded_vocab_size(t) * h
    st = theoretical_model_state_bytes(psi, d, lay.zero_stage, cfg.params_dtype)
    num_micro = max(gbs // (d * b), 1)
    layers = cfg.num_layers / p
    act = layer_activation_bytes(m, b, t, sp, lay.recompute_granularity) * layers \
        * in_flight(lay, num_micro, r)
    sbh = s * b * h * E / (t if sp else 1)
    if r == 0:
        act += s * b * 8 * in_flight(lay, num_micro, r)  # token ids (int64) for the embedding
        if cfg.hidden_dropout > 0:
            act += sbh / E * m.mask_bytes * in_flight(lay, num_micro, r)
    # Transient working set at the peak, the largest of:
    f_local = (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size / t
    work = [s * b * (2 * f_local + 2 * h) * E + f_local * h * 4 / (1 if E == 4 else 2)]
    if lay.recompute_granularity == "full":  # one recomputed layer, live during its backward
        work[0] += layer_activation_bytes(m, b, t, sp, "none")
    if r == p - 1:  # logits [s, b, V/t], their fp32 copy and softmax (the softmax is kept)
        V = cfg.padded_vocab_size(t)
        logits = s * b * V / t
        act += logits * 4 + 2 * sbh  # cross entropy's softmax; final norm in/out
        work.append(logits * (E + 4 + (4 if E != 4 else 0)))
    grads = st["grads_bytes"]
    if lay.zero_stage == 2:  # full-size fp32 storage of the buckets being filled and reduced
        grads += 4 * min(2 * DEFAULT_BUCKET_SIZE, psi)
    if lay.zero_stage == 3:  # the gathered unit in use with its full gradient, the next one
        unit = _layer_params(m) / t  # prefetched; the embedding is a unit too
        big = max(unit, V_h / t if (r == 0 or r == p - 1) else 0)
        act += big * (E + 4) + unit * E
    out = {"params": st["params_bytes"], "grads": grads,
           "optimizer": st["master_params_bytes"] + st["optimizer_states_bytes"],
           "activations": act + max(work), "stage": r}
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"]
    return out


# ------------------------------------------------------------------------------------- time
def _gemm_s(flops: float, dims, gpu: GPU) -> float:
    n = min(dims)
    return flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * n / (n + GEMM_HALF_DIM))


def _collective_s(kind: str, nbytes: float, n: int, bw_gbps: float, where: str) -> float:
    """Ring all-reduce moves 2(n-1)/n of the bytes per GPU, all-gather/reduce-scatter (n-1)/n."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n
    return COLLECTIVE_LATENCY_S[where] + factor * nbytes / (bw_gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def step_time(m: Model, lay: Layout, cl: Cluster, gbs: int) -> Dict[str, float]:
    """Seconds per step: compute, exposed TP comm, bubble (+ p2p), exposed DP/ZeRO comm."""
    cfg, gpu, E = m.cfg, cl.gpu, m.bytes_per_value
    t, p, v, d = lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size, \
        lay.virtual_pipeline_model_parallel_size, lay.data_parallel_size
    b, rc = lay.micro_batch_size, lay.recompute_granularity
    s, h, a, L = cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers
    f, q = cfg.ffn_hidden_size, a * cfg.kv_channels
    kv = cfg.num_query_groups * cfg.kv_channels
    fc1 = 2 * f if cfg.swiglu else f
    fl = flops_per_sequence(m, t)
    M = s * b
    # one layer, one micro-batch, forward: four GEMMs of this GPU's shard
    gemm_f = sum(_gemm_s(2 * M * k * n, (M, k, n), gpu) for k, n in
                 ((h, (q + 2 * kv) / t), (q / t, h), (h, fc1 / t), (f / t, h)))
    attn_flops_f = fl["attention"] / L / 3 * b / t
    if m.flash_attention:
        attn_f = attn_flops_f / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency
                                 * FLASH_ATTENTION_EFFICIENCY)
    else:  # two batched GEMMs with inner dimension d or s, then a memory-bound softmax
        attn_f = _gemm_s(attn_flops_f, (cfg.kv_channels, s), gpu) + \
            a / t * s * s * b * UNFUSED_SOFTMAX_BYTES / (gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    # element-wise, forward: norms, bias-dropout-adds (h, /t under SP) and the activation (f/t)
    elem = M * (12 * h / (t if lay.sequence_parallel else 1) + 3 * fc1 / t) * E
    elem_f = elem / (gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    layer_f = gemm_f + attn_f + elem_f
    layer_b = 2 * layer_f
    recompute_f = layer_f if rc == "full" else attn_f if rc == "selective" else 0.0
    # TP: two all-reduces (SP: all-gather + reduce-scatter, the same bytes) per layer and pass
    where_tp = "intra" if t <= cl.gpus_per_node else "inter"
    bw_tp = gpu.intra_node_bandwidth_gbps if where_tp == "intra" \
        else gpu.inter_node_bandwidth_gbps / 8
    ar = _collective_s("all_reduce", M * h * E, t, bw_tp, where_tp)
    tp_layer = ar * (2 + 2 + (2 if rc == "full" else 0))
    # logits on the last stage: a GEMM and the memory-bound fp32 cross entropy (~6 passes)
    V = cfg.padded_vocab_size(t)
    logits = 3 * _gemm_s(2 * M * h * V / t, (M, h, V / t), gpu) + \
        6 * 4 * M * V / t / (gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    layers = L / p
    num_micro = gbs // (d * b)
    # the last stage also runs the logits; the pipeline runs at its pace
    per_micro = layers * (layer_f + layer_b + recompute_f) + logits
    compute = num_micro * per_micro
    tp = num_micro * layers * tp_layer
    # bubble: (p - 1)/v idle slots of one micro-batch's F + B (ZB-H1 fills it with W: the
    # weight-gradient half of the backward GEMMs), plus p2p of activations and their gradients
    slot = per_micro + layers * tp_layer
    if lay.pipeline_schedule == "zb-h1":
        bubble = (p - 1) * (slot - layers * gemm_f)
    else:
        bubble = (p - 1) / v * slot
    if p > 1:
        where_pp = "intra" if t * d * p <= cl.gpus_per_node else "inter"
        bw = gpu.intra_node_bandwidth_gbps if where_pp == "intra" \
            else gpu.inter_node_bandwidth_gbps / 8
        msg = M * h * E / (t if lay.sequence_parallel else 1)
        bubble += 2 * (num_micro * v + p - 1) * (COLLECTIVE_LATENCY_S[where_pp] / 2
                                                 + msg / (bw * 1e9 * COLLECTIVE_EFFICIENCY)) / v
    # DP / ZeRO: bytes of this GPU's stage; the group crosses nodes once t*d exceeds a node
    psi = stage_params(m, lay, 0)
    where_dp = "intra" if t * d <= cl.gpus_per_node else "inter"
    bw_dp = gpu.intra_node_bandwidth_gbps if where_dp == "intra" \
        else gpu.inter_node_bandwidth_gbps / 8
    grads = psi * 4  # gradients are reduced in fp32 (megalite and Megatron's default)
    if lay.zero_stage == 0:
        dp_comm = _collective_s("all_reduce", grads, d, bw_dp, where_dp)
        overlap = layers * (layer_b + recompute_f)  # the last micro-batch's backward
    elif lay.zero_stage <= 2:
        dp_comm = _collective_s("reduce_scatter", grads, d, bw_dp, where_dp) + \
            _collective_s("all_gather", psi * E, d, bw_dp, where_dp)
        overlap = layers * (layer_b + recompute_f + layer_f)  # + first forward (param gather)
    else:  # ZeRO-3: every micro-batch gathers the parameters twice and reduce-scatters grads;
        # prefetch hides them behind compute except each pass's first unit
        one = 2 * _collective_s("all_gather", psi * E, d, bw_dp, where_dp) + \
            _collective_s("reduce_scatter", grads, d, bw_dp, where_dp)
        first = 2 * _collective_s("all_gather", _layer_params(m) / t * E, d, bw_dp, where_dp)
        dp_comm = num_micro * (max(one, 0.9 * per_micro) + first)
        overlap = num_micro * per_micro
    dp_exposed = max(0.0, dp_comm - 0.9 * overlap)
    # optimizer step: memory-bound pass over this GPU's states (read + write)
    st = theoretical_model_state_bytes(psi, d, lay.zero_stage, cfg.params_dtype)
    compute += 2 * st["total_bytes"] / (gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    total = compute + tp + bubble + dp_exposed
    hw = (fl["total"] + recompute_flops(fl, rc)) * gbs / cl.num_gpus
    return {"compute_s": compute, "tp_comm_s": tp, "bubble_s": bubble, "dp_comm_s": dp_exposed,
            "step_time_s": total, "num_micro": num_micro, "tflops_per_gpu": hw / total / 1e12,
            "mfu": fl["total"] * gbs / cl.num_gpus / total / (gpu.peak_tflops * 1e12)}


# ----------------------------------------------------------------------------------- search
def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_layout(m: Model, lay: Layout, cl: Cluster, gbs: int) -> Optional[str]:
    """Why this layout cannot run (None if it can): the same rules pretrain.py enforces."""
    cfg, t, p = m.cfg, lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size
    v, d, b = lay.virtual_pipeline_model_parallel_size, lay.data_parallel_size, \
        lay.micro_batch_size
    if t * p * d != cl.num_gpus:
        return f"TP {t} x PP {p} x DP {d} != {cl.num_gpus} GPUs"
    try:
        dataclasses.replace(cfg, sequence_parallel=lay.sequence_parallel).validate(t)
    except ConfigError as e:
        return str(e)
    if cfg.num_layers % (p * v):
        return f"--num-layers ({cfg.num_layers}) is not divisible by PP {p} x VPP {v}"
    if gbs % (d * b):
        return f"--global-batch-size ({gbs}) is not a multiple of micro-batch {b} x DP {d}"
    if v > 1 and (gbs // (d * b)) % p:
        return f"interleaving needs the micro-batch count to be a multiple of PP {p}"
    if lay.zero_stage > 0 and d == 1:
        return "ZeRO needs DP > 1"
    return None


@dataclass
class Plan:
    layout: Layout
    memory: Dict
    time: Dict
    fits: bool
    why: str = ""

    def as_json(self) -> dict:
        out = self.layout.key()
        out["fits"] = self.fits
        out["memory_gib"] = {k: round(self.memory[k] / GiB, 3) for k in
                             ("params", "grads", "optimizer", "activations", "total")}
        out.update(step_time_s=round(self.time["step_time_s"], 4),
                   tflops_per_gpu=round(self.time["tflops_per_gpu"], 1),
                   mfu=round(self.time["mfu"], 4))
        return out


def evaluate(m: Model, lay: Layout, cl: Cluster, gbs: int) -> Plan:
    mem = memory(m, lay, gbs)
    usable = cl.gpu.memory_gib * GiB * USABLE_MEMORY_FRACTION
    return Plan(lay, mem, step_time(m, lay, cl, gbs), mem["total"] <= usable)


def candidates(m: Model, cl: Cluster, gbs: int, fixed: Optional[dict] = None) -> List[Layout]:
    """Every layout pretrain.py could run; ``fixed`` pins Layout fields (e.g. TP and PP)."""
    fixed = fixed or {}
    L, out = m.cfg.num_layers, []
    tps = [k for k in _divisors(cl.num_gpus) if k <= max(cl.gpus_per_node, 1) and k & (k - 1) == 0]
    for t in tps:
        for p in _divisors(cl.num_gpus // t):
            if L % p:
                continue
            d = cl.num_gpus // (t * p)
            vs = [v for v in _divisors(L // p) if v <= 8] if p > 1 else [1]
            for v in vs:
                scheds = ["1f1b", "zb-h1"] if (p > 1 and v == 1) else \
                    ["interleaved" if v > 1 else "1f1b"]
                for sched in scheds:
                    for b in (1, 2, 4, 8, 16):
                        if gbs % (d * b):
                            continue
                        for z in ((0, 1, 2, 3) if d > 1 else (0,)):
                            for sp in ((False, True) if t > 1 else (False,)):
                                for rc in ("none", "selective", "full"):
                                    lay = Layout(t, p, v, d, z, sp, rc, b, sched)
                                    if all(getattr(lay, k) == val for k, val in fixed.items()) \
                                            and check_layout(m, lay, cl, gbs) is None:
                                        out.append(lay)
    return out


def plan(m: Model, cl: Cluster, gbs: int, fixed: Optional[dict] = None) -> List[Plan]:
    """Layouts ranked: those that fit first, by predicted step time; each with a why-it-lost."""
    plans = [evaluate(m, lay, cl, gbs) for lay in candidates(m, cl, gbs, fixed)]
    # ties (to 0.1%) go to the simpler layout: lower ZeRO stage, less recompute, fewer GPUs in
    # TP x PP
    rc = {"none": 0, "selective": 1, "full": 2}
    plans.sort(key=lambda pl: (not pl.fits, round(math.log(pl.time["step_time_s"]) / 1e-3)
                               if pl.fits else pl.memory["total"], pl.layout.zero_stage,
                               rc[pl.layout.recompute_granularity],
                               pl.layout.tensor_model_parallel_size
                               * pl.layout.pipeline_model_parallel_size))
    if plans:
        for pl in plans[1:]:
            pl.why = why_lost(pl, plans[0], cl)
    return plans


def why_lost(pl: Plan, best: Plan, cl: Cluster) -> str:
    """One line, in the order the choice is made: memory, TP inside the node, batch budget."""
    lay = pl.layout
    if not pl.fits:
        part = max(("params", "grads", "optimizer", "activations"), key=lambda k: pl.memory[k])
        return (f"does not fit: {pl.memory['total'] / GiB:.1f} GiB > "
                f"{cl.gpu.memory_gib * USABLE_MEMORY_FRACTION:.1f} GiB usable "
                f"(largest: {part} {pl.memory[part] / GiB:.1f} GiB)")
    if lay.tensor_model_parallel_size > cl.gpus_per_node:
        return "TP crosses the node: its collectives run over the inter-node network"
    dt = {k: pl.time[k] - best.time[k] for k in ("compute_s", "tp_comm_s", "bubble_s",
                                                  "dp_comm_s")}
    worst = max(dt, key=dt.get)
    slower = pl.time["step_time_s"] / best.time["step_time_s"] - 1
    reason = {
        "compute_s": (f"recompute '{lay.recompute_granularity}' / smaller GEMMs cost "
                      f"+{dt['compute_s']:.3f} s of compute"),
        "tp_comm_s": f"TP {lay.tensor_model_parallel_size} exposes +{dt['tp_comm_s']:.3f} s of "
                     f"collectives",
        "bubble_s": f"batch budget: PP {lay.pipeline_model_parallel_size} with "
                    f"{pl.time['num_micro']} micro-batches idles +{dt['bubble_s']:.3f} s in "
                    f"the bubble",
        "dp_comm_s": f"DP {lay.data_parallel_size} / ZeRO {lay.zero_stage} exposes "
                     f"+{dt['dp_comm_s']:.3f} s of gradient/parameter traffic",
    }[worst]
    return f"{100 * slower:.1f}% slower: {reason}"


# ------------------------------------------------------------------------------ pretrain.py
def estimate_for_run(cfg, world_size: int, device: str, stage: int) -> Dict:
    """The planner's memory for the layout pretrain.py is running (this rank's stage)."""
    par, tr, opt = cfg.parallel, cfg.training, cfg.optimizer
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    v = par.virtual_pipeline_model_parallel_size or 1
    d = world_size // (t * p)
    zero = opt.zero_stage or (1 if opt.use_distributed_optimizer else 0)
    sched = tr.pipeline_schedule or ("interleaved" if v > 1 else "1f1b")
    lay = Layout(t, p, v, d, zero, cfg.model.sequence_parallel,
                 cfg.model.recompute_granularity or "none", tr.micro_batch_size, sched)
    return memory(Model.from_config(cfg.model, device), lay, tr.global_batch_size, stage)


def measured_train_step(trainer, batches):
    """``trainer.train_step(batches)``; on one iteration, also the planner's memory estimate for
    this rank beside the measured peak of tensor memory (megalite.memory.PeakTensorMemory),
    printed and logged as ``estimated_memory_bytes`` / ``measured_memory_bytes``.

    The measured iteration is the first logged one after the first (whose lazily created
    optimizer states would make it unlike the rest), or the only one; measuring costs time on
    CPU (the profiler), so only that iteration is measured.
    """
    cfg, ps = trainer.cfg, trainer.ps
    it, n, every = trainer.iteration + 1, cfg.training.train_iters, cfg.logging.log_interval
    first_logged = next((i for i in range(2, n + 1) if i % every == 0 or i == n), 1)
    if it != first_logged:
        return trainer.train_step(batches)
    from megalite.memory import PeakTensorMemory

    with PeakTensorMemory(ps.device) as probe:
        out = trainer.train_step(batches)
    est = estimate_for_run(cfg, ps.world_size, ps.device.type, ps.pp_rank)
    rec = {"estimated_memory_bytes": int(est["total"]),
           "measured_memory_bytes": probe.peak_bytes,
           **{f"estimated_{k}_bytes": int(est[k])
              for k in ("params", "grads", "optimizer", "activations")}}
    trainer.logger.print(
        f" memory at iteration {it} (rank 0): planner estimate {est['total'] / GiB:.3f} GiB, "
        f"measured peak of tensor memory {probe.peak_bytes / GiB:.3f} GiB "
        f"({probe.peak_bytes / est['total'] - 1:+.1%} vs estimate)")
    trainer.logger.log(rec, it, split="memory")
    return out
