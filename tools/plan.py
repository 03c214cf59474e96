"""Which layout for my model on my cluster? Rank TP x SP x PP x VPP x DP x ZeRO x micro-batch x
recompute layouts by predicted step time, with memory per GPU (docs/planner.md).

    python tools/plan.py --num-layers 80 --hidden-size 12288 --num-attention-heads 96 \
        --seq-length 2048 --vocab-size 51200 --global-batch-size 2304 --bf16 \
        --num-gpus 1536 --gpus-per-node 8 --gpu A100-80GB [--json] [--top 10]

Model flags are pretrain.py's (same spellings and checks). Give --tensor-model-parallel-size and
--pipeline-model-parallel-size (optionally --num-layers-per-virtual-pipeline-stage, --zero-stage
or --use-distributed-optimizer, --sequence-parallel, --recompute-granularity,
--micro-batch-size, --pipeline-schedule, including zb-v and dualpipev) to evaluate that layout;
flags not given are searched. --recompute-method/--recompute-num-layers (partial full recompute)
and --decoder-first/last-pipeline-num-layers (uneven stages) are evaluated where given.

A mixture-of-experts model takes pretrain.py's MoE flags (--num-experts, --moe-router-topk,
--moe-ffn-hidden-size, --moe-layer-freq, --moe-shared-expert-intermediate-size, capacity ...);
--expert-model-parallel-size and --expert-tensor-parallel-size pin the expert grid (searched
otherwise: EP dividing the experts, ETP 1 or TP) and --moe-imbalance-factor sets the dropless
receive headroom the memory model assumes (docs/planner.md, "Mixture of experts").

Planner-only inputs describe a stack other than megalite's, to plan published runs (the
cost model for them is tools/planner_stacks.py): --cross-entropy megatron, --activation-model
fused, --account-for-embedding/loss-in-pipeline-split and --precision fp8 (docs/planner.md,
"Inputs for other stacks"). --overlap-moe-expert-parallel-comm
is pretrain.py's flag (the combined 1F1B, PP 1 there); the planner prices it on any layout.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.arguments import build_parser, config_from_namespace, layout_flags  # noqa: E402
from megalite.config import (  # noqa: E402
    CP_COMM_TYPES,
    V_SCHEDULES,
    ConfigError,
    ExecutionConfig,
    MegaliteConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    check_expert_grid_divisible,
    check_zero3_schedule,
    default_schedule,
)
from megalite.planner import (  # noqa: E402
    GPUS,
    MOE_IMBALANCE,
    USABLE_MEMORY_FRACTION,
    Cluster,
    GiB,
    Layout,
    Model,
    memory,
    stage_chunks,
    step_time,
)
from tools.planner_stacks import Stack  # noqa: E402

# layout flags -> planner Layout fields (their declarations say which); only the flags present on
# the command line are pinned. --recompute-method/--recompute-num-layers and the uneven stages
# are not searched: evaluated where given.
_PINNED = layout_flags()
# the planner's own inputs (no pretrain.py flag) added since tests/fixtures/cli/flags_before.json
PLANNER_ONLY_FLAGS = ("--moe-imbalance-factor", "--activation-model",
                      "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split", "--precision",
                      "--mean-document-length")


def short(lay: Layout) -> str:
    """One line naming a layout."""
    t, p, v = (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size,
               lay.virtual_pipeline_model_parallel_size)
    c = lay.context_parallel_size
    uneven = "".join(f" {w}{n}" for w, n in (("first", lay.decoder_first_pipeline_num_layers),
                                              ("last", lay.decoder_last_pipeline_num_layers))
                     if n is not None)
    partial = (f" {lay.recompute_method or 'uniform'} {lay.recompute_num_layers or 1}"
               if lay.recompute_method or lay.recompute_num_layers else "")
    name = {"zb-h1": " ZB-H1", "zb-v": " ZB-V", "dualpipev": " DualPipeV"}
    ep, etp = lay.expert_model_parallel_size, lay.expert_tensor_parallel_size
    experts = f" EP{ep}{f' ETP{etp}' if etp > 1 else ''}" if ep > 1 or etp > 1 else ""
    return (f"TP{t}{'+SP' * lay.sequence_parallel}"
            f"{f' CP{c} {lay.cp_comm_type}' if c > 1 else ''} PP{p}{uneven}"
            f"{f'x{v}' if v > 1 and lay.pipeline_schedule == 'interleaved' else ''}"
            f"{name.get(lay.pipeline_schedule, '')} DP{lay.data_parallel_size}{experts} "
            f"ZeRO{lay.zero_stage} mb{lay.micro_batch_size} "
            f"recompute {lay.recompute_granularity}{partial}"
            f"{' optimizer offload' if lay.optimizer_offload_fraction else ''}"
            f"{f' HSDP R{r}' if (r := lay.num_distributed_optimizer_instances) > 1 else ''}")




def check_layout(m: Model, lay: Layout, cl: Cluster, gbs: int) -> Optional[str]:
    """Why pretrain.py would refuse this layout, or None."""
    t, p, v, d, b = (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size,
                     lay.virtual_pipeline_model_parallel_size, lay.data_parallel_size,
                     lay.micro_batch_size)
    c = lay.context_parallel_size
    # pretrain.py's config checks see neither DP nor the micro-batch: once per rest of the layout
    key = ("checks", cl.num_gpus, *(getattr(lay, f.name) for f in dataclasses.fields(Layout)
                                    if f.name not in ("data_parallel_size", "micro_batch_size")))
    if key not in m.memo:
        m.memo[key] = _config_checks(m, lay, cl.num_gpus)
    if m.memo[key] is not None:
        return m.memo[key]
    sched, num_micro = lay.pipeline_schedule, gbs // (d * b) if d * b else 0
    if (t * c * p * d != cl.num_gpus or (v > 1 and m.pipeline_slots(p) % (p * v))
            or gbs % (d * b) or (sched == "interleaved" and num_micro % p)
            or (lay.zero_stage and d * c == 1)
            or d % lay.num_distributed_optimizer_instances
            or (lay.num_distributed_optimizer_instances > 1 and not lay.zero_stage)
            or (sched in V_SCHEDULES and (v != 2 or p == 1 or num_micro < 2 * p))):
        return ("TP x CP x PP x DP must be the GPUs, PP x VPP divide the layers, DP x mb the "
                "batch, PP the micro-batches when interleaved, 2 PP of them in a V; ZeRO needs "
                "DP x CP > 1, and HSDP ZeRO and R dividing DP")
    return None


def _config_checks(m: Model, lay: Layout, world_size: int) -> Optional[str]:
    t, p = lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size
    ep, etp = lay.expert_model_parallel_size, lay.expert_tensor_parallel_size
    moe = m.cfg.num_experts is not None
    try:
        m.cfg.validate(t)
        ex = ExecutionConfig(recompute_granularity={"none": None}.get(
            lay.recompute_granularity, lay.recompute_granularity),
            recompute_method=lay.recompute_method,
            recompute_num_layers=lay.recompute_num_layers).validate()
        pc = ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                            sequence_parallel=lay.sequence_parallel,
                            context_parallel_size=lay.context_parallel_size,
                            cp_comm_type=lay.cp_comm_type, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=etp if moe or etp != 1 else None)
        pc.validate(world_size, m.cfg.seq_length)  # the world and expert grids too
        pc.check_context_parallel(m.cfg)
        if moe or (ep, etp) != (1, 1):  # pretrain.py's checks of the expert layout and its grid
            # (and of what the F&B pairs compose with: recompute, ZeRO-3, EP 1)
            MegaliteConfig(model=m.cfg, parallel=pc, optimizer=OptimizerConfig(
                zero_stage=lay.zero_stage), training=TrainingConfig(
                overlap_moe_expert_parallel_comm=m.moe_overlap), execution=ex)._check_experts()
        check_zero3_schedule(lay.zero_stage, lay.pipeline_schedule)
        stage_chunks(m, lay)  # pretrain.py's checks of the (uneven) layer placement
    except ConfigError as e:
        return str(e)
    return None


Plan = collections.namedtuple("Plan", "layout memory time fits")


def plan(m: Model, cl: Cluster, gbs: int, fixed: Optional[dict] = None) -> List[Plan]:
    """Every layout pretrain.py could run (``fixed`` pins Layout fields): those that fit first,
    by predicted step time (ties within 0.1% to the simpler one)."""
    fixed, out = fixed or {}, []
    div = [k for k in range(1, cl.num_gpus + 1) if cl.num_gpus % k == 0]

    def only(field: str, values):  # a pinned field's one value, before the products (speed)
        return [x for x in values if field not in fixed or x == fixed[field]]
    # what the search does not vary: partial recompute and uneven stages, pinned or absent
    extra = [fixed.get(f.name) for f in dataclasses.fields(Layout)[11:15]]
    num_experts = m.cfg.num_experts
    for t, p, c in itertools.product(only("tensor_model_parallel_size", div),
                                     only("pipeline_model_parallel_size", div),
                                     only("context_parallel_size", div)):
        if t > cl.gpus_per_node or t & (t - 1) or c & (c - 1) or cl.num_gpus % (t * p * c) \
                or (m.pipeline_slots(p) % p and not any(extra[2:])) or m.cfg.seq_length % (2 * c):
            continue
        d = cl.num_gpus // (t * p * c)
        # the expert grid: EP dividing the experts, ETP unsplit or as TP, ETP x EP dividing the
        # stage's t c d ranks (check_layout has pretrain.py's checks)
        grid = [(1, 1)] if num_experts is None else [
            (e, x) for x in ([fixed["expert_tensor_parallel_size"]]
                             if "expert_tensor_parallel_size" in fixed else sorted({1, t}))
            for e in only("expert_model_parallel_size", range(1, num_experts + 1))
            if num_experts % e == 0 and (t * c * d) % (e * x) == 0]
        vs = [(1, "1f1b")] + ([(1, "zb-h1"), (2, "zb-v"), (2, "dualpipev")]
                              + [(v, "interleaved") for v in range(2, 9)
                                 if (m.pipeline_slots(p) // p) % v == 0] if p > 1 else [])
        if fixed.get("virtual_pipeline_model_parallel_size", 0) > 8 and p > 1:  # pinned beyond
            vs.append((fixed["virtual_pipeline_model_parallel_size"], "interleaved"))  # the list
        for (v, sched), b, z, sp, rc, ct, (ep, etp) in itertools.product(
                vs, only("micro_batch_size", (1, 2, 4, 8, 16)), only("zero_stage", range(4)),
                only("sequence_parallel", (False, True)),
                only("recompute_granularity", ("none", "selective", "full")),
                CP_COMM_TYPES if c > 1 else ("p2p",), grid):
            lay = Layout(t, p, v, d, z, sp, rc, b, sched, c, ct, *extra, ep, etp,
                         optimizer_offload_fraction=fixed.get("optimizer_offload_fraction", 0.0),
                         num_distributed_optimizer_instances=fixed.get(
                             "num_distributed_optimizer_instances", 1))
            if all(getattr(lay, k) == x for k, x in fixed.items()) \
                    and (t > 1 or not sp) and check_layout(m, lay, cl, gbs) is None:
                usable, mem = cl.gpu.memory_gib * GiB * USABLE_MEMORY_FRACTION, memory(m, lay, gbs)
                if mem["total"] > usable and "optimizer_offload_fraction" not in fixed:
                    # too big: proposed with the optimizer state on the host (docs/offload.md)
                    off = dataclasses.replace(lay, optimizer_offload_fraction=1.0)
                    if memory(m, off, gbs)["total"] <= usable:
                        lay, mem = off, memory(m, off, gbs)
                out.append(Plan(lay, mem, step_time(m, lay, cl, gbs), mem["total"] <= usable))
                # HSDP: ZeRO inside each node, replicated across the nodes (data_parallel.md)
                r = t * c * d // cl.gpus_per_node
                if z and r > 1 and d % r == 0 and (t * c * d) % cl.gpus_per_node == 0 \
                        and num_experts is None and "num_distributed_optimizer_instances" \
                        not in fixed:
                    hs = dataclasses.replace(lay, num_distributed_optimizer_instances=r)
                    mem = memory(m, hs, gbs)
                    out.append(Plan(hs, mem, step_time(m, hs, cl, gbs), mem["total"] <= usable))
    rank = {"none": 0, "selective": 1, "full": 2}
    out.sort(key=lambda pl: (not pl.fits, round(math.log(pl.time["step_time_s"]) / 1e-3)
                             if pl.fits else pl.memory["total"], pl.layout.zero_stage,
                             rank[pl.layout.recompute_granularity],
                             pl.layout.tensor_model_parallel_size
                             * pl.layout.pipeline_model_parallel_size
                             * pl.layout.context_parallel_size))
    return out


def as_json(pl: Plan) -> dict:
    """The --json record of one layout (keys in docs/planner.md)."""
    out = dataclasses.asdict(pl.layout)
    out.update(fits=pl.fits, memory_gib={k: round(pl.memory[k] / GiB, 3) for k in (
        "params", "grads", "optimizer", "activations", "total")},
        step_time_s=round(pl.time["step_time_s"], 4),
        tflops_per_gpu=round(pl.time["tflops_per_gpu"], 1), mfu=round(pl.time["mfu"], 4),
        time_s={k: round(pl.time[k], 4) for k in ("compute_s", "tp_comm_s", "bubble_s",
                                                   "dp_comm_s", "cp_comm_s", "ep_comm_s",
                                                   "offload_s", "dp_replicate_s")})
    return out


def why_lost(pl: Plan, best: Plan, cl: Cluster) -> str:
    """One line, in the order the choice is made: memory first, then what costs the time (TP
    collectives beyond a node, the batch budget's pipeline bubble, DP traffic, recompute)."""
    lay, mem = pl.layout, pl.memory
    if not pl.fits:
        part = max(("params", "grads", "optimizer", "activations"), key=mem.get)
        return (f"does not fit: {mem['total'] / GiB:.1f} GiB > "
                f"{cl.gpu.memory_gib * USABLE_MEMORY_FRACTION:.1f} GiB usable (largest: {part} "
                f"{mem[part] / GiB:.1f} GiB)")
    dt = {k: pl.time[k] - best.time[k] for k in ("compute_s", "tp_comm_s", "bubble_s",
                                                  "dp_comm_s", "ep_comm_s")}
    k = max(dt, key=dt.get)
    t, ep = lay.tensor_model_parallel_size, lay.expert_model_parallel_size
    b = best.layout
    compute = (f"recompute '{lay.recompute_granularity}'"
               if lay.recompute_granularity != b.recompute_granularity else
               f"micro-batch {lay.micro_batch_size}: smaller GEMMs"
               if lay.micro_batch_size < b.micro_batch_size else
               f"ZeRO {lay.zero_stage}: a longer optimizer step"
               if lay.zero_stage != b.zero_stage else
               f"EP {lay.expert_model_parallel_size}: the host time of each local expert's kernels"
               if lay.expert_model_parallel_size > max(1, b.expert_model_parallel_size)
               and pl.time["compute_s"] > best.time["compute_s"] else "smaller GEMMs per GPU")
    why = {"compute_s": compute,
           "tp_comm_s": f"TP {t} collectives" + (" cross the node" if t > cl.gpus_per_node
                                                  else ""),
           "bubble_s": f"batch budget: PP {lay.pipeline_model_parallel_size} with "
                       f"{pl.time['num_micro']} micro-batches idles in the bubble",
           "dp_comm_s": f"DP {lay.data_parallel_size} / ZeRO {lay.zero_stage} traffic",
           "ep_comm_s": f"EP {ep} all-to-alls" + (
               " cross the node" if ep * lay.expert_tensor_parallel_size > cl.gpus_per_node
               else "")}[k]
    return (f"{100 * (pl.time['step_time_s'] / best.time['step_time_s'] - 1):.1f}% slower: "
            f"{why} (+{dt[k]:.3f} s)")


def check_expert_flags(cfg, given, num_gpus: int) -> None:
    """pretrain.py's one-line refusals of the expert layout that no searched layout can avoid:
    its checks (config._check_experts) with what the search may still choose chosen to pass
    (SP on where TP is searched, ETP 1 where it is), and the expert grid's divisibility at the
    pinned PP (1 if searched, the most permissive)."""
    par = cfg.parallel
    etp = par.expert_tensor_parallel_size if "--expert-tensor-parallel-size" in given else (
        1 if cfg.model.num_experts is not None else None)
    par = dataclasses.replace(par, expert_tensor_parallel_size=etp, sequence_parallel=(
        par.sequence_parallel or "--sequence-parallel" not in given))
    dataclasses.replace(cfg, parallel=par)._check_experts()
    check_expert_grid_divisible(num_gpus, par.expert_tp_size, par.expert_model_parallel_size,
                                par.pipeline_model_parallel_size)


def build_plan_parser():
    p = build_parser()
    p.prog = "plan.py"
    p.usage = "%(prog)s [model flags as pretrain.py] --global-batch-size N --num-gpus N [flags]"
    p.description = __doc__.splitlines()[0]
    g = p.add_argument_group("cluster (planner)")
    g.add_argument("--num-gpus", type=int, default=None)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu", choices=sorted(GPUS), default="H100-80GB")
    g.add_argument("--gpu-memory-gib", type=float, default=None)
    g.add_argument("--peak-tflops", type=float, default=None, help="dense 16-bit peak")
    g.add_argument("--intra-node-bandwidth-gbps", type=float, default=None,
                   help="GB/s per GPU per direction (NVLink)")
    g.add_argument("--inter-node-bandwidth-gbps", type=float, default=None,
                   help="Gb/s per GPU (network)")
    g.add_argument("--attention-backend", choices=["flash", "unfused"], default="flash",
                   help="unfused: softmax over a stored a*s^2 score matrix (Megatron before "
                        "fused attention)")
    g.add_argument("--cross-entropy", choices=["megalite", "megatron"], default="megalite",
                   help="megatron: Megatron-LM's unfused vocab-parallel cross entropy (fp32 "
                        "softmax kept, ~52 bytes moved per logit), as the published rows ran")
    g.add_argument("--moe-imbalance-factor", type=float, default=MOE_IMBALANCE,
                   help="dropless MoE at EP > 1: rows the busiest EP rank receives over the mean "
                        "(1: balanced, as --moe-router-force-load-balancing runs; a measured "
                        "max/mean; default %(default)s); planner only, no pretrain.py flag")
    g.add_argument("--activation-model", choices=["megalite", "fused"], default="megalite",
                   help="fused: each tensor of a layer saved once in 16 bits (Korthikanti et al.'s "
                        "Table 2 terms), as a fused stack (Transformer Engine, Meta's) saves them; "
                        "megalite: what megalite's layers save")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the embedding takes a layer's slot in the pipeline split (Megatron-LM's "
                        "flag; the Llama 3 report's balancing); planner only")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the output layer and loss take a layer's slot (as above)")
    g.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: the linear GEMMs at twice the 16-bit peak and the fp8 GEMM "
                        "efficiency, to compare with published FP8 rows; megalite runs 16 bits")
    g.add_argument("--mean-document-length", type=int, default=None,
                   help="packed documents (--reset-attention-mask): their mean length in "
                        "tokens; fused attention then costs s x L pairs a layer, not s^2 / 2")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--top", type=int, default=10, help="layouts to print")
    return p


def parse(argv):
    p = build_plan_parser()
    ns = p.parse_args(argv)
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    if ns.num_gpus is None or ns.num_gpus < 1:
        raise ConfigError("--num-gpus N (N >= 1) is required")
    if ns.gpus_per_node < 1 or (ns.num_gpus > ns.gpus_per_node
                                and ns.num_gpus % ns.gpus_per_node):
        raise ConfigError(f"--num-gpus ({ns.num_gpus}) must be a multiple of --gpus-per-node "
                          f"({ns.gpus_per_node}) >= 1")
    if ns.global_batch_size is None:
        raise ConfigError("--global-batch-size N is required to plan (DP and PP consume it)")
    if ns.top < 1:
        raise ConfigError(f"--top must be >= 1, got {ns.top}")
    if not ns.moe_imbalance_factor >= 1:
        raise ConfigError(f"--moe-imbalance-factor must be >= 1 (the busiest rank over the mean), "
                          f"got {ns.moe_imbalance_factor}")
    if ns.mean_document_length is not None and not 1 <= ns.mean_document_length:
        raise ConfigError(f"--mean-document-length must be >= 1 (tokens), got "
                          f"{ns.mean_document_length}")
    cfg = config_from_namespace(ns)
    if ns.mean_document_length is not None and any(cfg.model.linear_attention_pattern()):
        raise ConfigError("--mean-document-length with --linear-attention-freq: pretrain.py "
                          "refuses --reset-attention-mask with Gated DeltaNet layers; drop one")
    # --overlap-moe-expert-parallel-comm is pretrain.py's flag, but the planner prices it (from
    # ns) on any layout Megatron runs it on (PP > 1 with virtual stages): pretrain.py's refusals
    # of what its own combined 1F1B does not compose with are not the planner's
    cfg.training = dataclasses.replace(cfg.training, overlap_moe_expert_parallel_comm=False)
    # layout-free checks here; --sequence-parallel is checked against each layout's TP size
    cfg.model.validate(1)
    cfg.execution.validate()
    if cfg.model.num_experts is not None or given & {"--expert-model-parallel-size",
                                                      "--expert-tensor-parallel-size"}:
        check_expert_flags(cfg, given, ns.num_gpus)
    gpu = GPUS[ns.gpu]
    over = {"memory_gib": ns.gpu_memory_gib, "peak_tflops": ns.peak_tflops,
            "intra_node_bandwidth_gbps": ns.intra_node_bandwidth_gbps,
            "inter_node_bandwidth_gbps": ns.inter_node_bandwidth_gbps}
    for k, v in over.items():
        if v is not None and v <= 0:
            raise ConfigError(f"--{k.replace('_', '-')} must be positive, got {v}")
    gpu = gpu._replace(**{k: v for k, v in over.items() if v is not None})
    cluster = Cluster(ns.num_gpus, min(ns.gpus_per_node, ns.num_gpus), gpu)
    fixed = {}
    for flag, field in _PINNED.items():
        if flag in given:
            fixed[field] = {"zero_stage": cfg.optimizer.zero_stage,
                            "virtual_pipeline_model_parallel_size":
                            cfg.parallel.virtual_pipeline_model_parallel_size or 1,
                            "recompute_granularity": cfg.execution.recompute_granularity,
                            "pipeline_schedule": cfg.training.pipeline_schedule,
                            }.get(field, getattr(ns, field, None))
    if cfg.optimizer.optimizer_cpu_offload:  # pinned as given (docs/offload.md)
        fixed["optimizer_offload_fraction"] = cfg.optimizer.validate().optimizer_offload_fraction
    if "virtual_pipeline_model_parallel_size" in fixed and "pipeline_schedule" not in fixed:
        v = fixed["virtual_pipeline_model_parallel_size"]  # pretrain.py's default schedule for v
        fixed["pipeline_schedule"] = default_schedule(v)
    model = Stack.from_config(
        cfg.model, "cuda", ns.attention_backend, ns.moe_imbalance_factor,
        moe_overlap=ns.overlap_moe_expert_parallel_comm, cross_entropy=ns.cross_entropy,
        activation_model=ns.activation_model,
        embedding_slot=ns.account_for_embedding_in_pipeline_split,
        loss_slot=ns.account_for_loss_in_pipeline_split, precision=ns.precision,
        mean_document_length=ns.mean_document_length)
    if "pipeline_model_parallel_size" in fixed:  # an uneven split: pretrain.py's own checks
        stage_chunks(model, Layout(**fixed))
    return model, cluster, ns.global_batch_size, fixed, ns


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        model, cluster, gbs, fixed, ns = parse(argv)
        plans = plan(model, cluster, gbs, fixed)
        if not plans:
            pinned = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none"
            raise ConfigError(f"no layout of {cluster.num_gpus} GPUs runs this model with "
                              f"--global-batch-size {gbs} (pinned: {pinned}); check that "
                              f"TP x PP x DP = --num-gpus and the batch divides micro-batch x DP")
    except ConfigError as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    shown = plans[: ns.top]
    if ns.json:
        print(json.dumps({"layouts": [as_json(pl) for pl in shown]}))
        return 0
    gpu = cluster.gpu
    active = (f" ({model.cfg.num_active_parameters() / 1e9:.2f}B active)"
              if model.cfg.num_experts is not None else "")
    print(f"{model.cfg.num_parameters() / 1e9:.2f}B parameters{active} on {cluster.num_gpus} x "
          f"{gpu.name} ({gpu.peak_tflops:.0f} TFLOP/s, {gpu.memory_gib:.0f} GiB), global batch "
          f"{gbs}; {len(plans)} layouts, {sum(pl.fits for pl in plans)} fit")
    parts = "comp/tp/bubble/dp" + "/ep" * (model.cfg.num_experts is not None)
    print(f"{'#':>3} {'layout':<52} {'fits':<4} {'mem GiB (par/grad/opt/act)':<28} "
          f"{'step s (' + parts + ')':<30} {'TFLOP/s':>7} {'MFU':>5}")
    for i, pl in enumerate(shown):
        m, t = pl.memory, pl.time
        mem = (f"{m['total'] / GiB:5.1f} ({m['params'] / GiB:.1f}/{m['grads'] / GiB:.1f}/"
               f"{m['optimizer'] / GiB:.1f}/{m['activations'] / GiB:.1f})")
        tm = (f"{t['step_time_s']:6.3f} ({t['compute_s']:.2f}/{t['tp_comm_s']:.2f}/"
              f"{t['bubble_s']:.2f}/{t['dp_comm_s']:.2f}"
              f"{'/%.2f' % t['ep_comm_s'] if model.cfg.num_experts is not None else ''})")
        print(f"{i + 1:>3} {short(pl.layout):<52} {'yes' if pl.fits else 'no':<4} {mem:<28} "
              f"{tm:<30} {t['tflops_per_gpu']:7.1f} {100 * t['mfu']:4.1f}%")
        if i:
            print(f"{'':>4}why not first: {why_lost(pl, plans[0], cluster)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
