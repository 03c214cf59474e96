"""Mixture of experts in parallel layouts equals one process (docs/moe.md): pretrain.py's losses
and grad norms, 4 steps in fp32 within 1e-5 (bf16 and fp16 looser), for expert parallelism
folded over data, tensor (with SP), context and pipeline ranks (1F1B and a V schedule), experts
split by tensor parallelism (ETP), both token dispatchers, and for the router's variants (sigmoid scores with the
loss-free balancing bias, a gated shared expert, capacity drops, grouped GEMMs, recomputation);
and the shapes of two imported families: DeepSeek-V3's (multi-latent attention, YaRN, a dense
first layer, group-limited sigmoid routing) at TP2 + SP, PP2 and CP2 (p2p and a2a), each x EP2,
and Qwen3-MoE's at EP4 with ZeRO-3.
Every multi-rank run is in strict mode (it emulates a GPU: docs/design.md, contract 1)."""

import pytest

from dist_utils import run_distributed

ITERS = 4
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--num-layers", "2"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear"]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
SIGMOID = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-bias-update-rate", "0.01"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
# (micro-batches of one: a V schedule at PP 2 needs 4 per DP rank)
FOUR_LAYERS = ["--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]", "--micro-batch-size", "1"]
DENSE_FIRST = ["--moe-layer-freq", "[0,1]", "--micro-batch-size", "1"]  # PP 2: stage 0 dense
PP2, OVERLAP = ["--pipeline-model-parallel-size", "2"], ["--overlap-moe-expert-parallel-comm"]
# DeepSeek-V3's shape: multi-latent attention with a q latent and YaRN, a dense first layer of its
# own width, 8 experts chosen by sigmoid scores plus the balancing bias within 2 of 4 groups
# (HF's group score, the sum of each group's top 2), gates scaled by 2.5, a shared expert
DEEPSEEK = LLAMA + [
    "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16", "--qk-head-dim",
    "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rope-type", "yarn",
    "--rotary-scaling-factor", "4", "--rope-original-max-position-embeddings", "4",
    "--mscale", "0.8", "--mscale-all-dim", "0.6", "--num-experts", "8", "--moe-layer-freq",
    "[0,1]", "--ffn-hidden-size", "48", "--moe-router-num-groups", "4",
    "--moe-router-group-topk", "2", "--moe-router-group-score", "top2_sum",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "24",
    *SIGMOID]
# Qwen3-MoE's: per-head q/k norm, grouped queries, a dense first layer (mlp_only_layers [0])
QWEN3 = LLAMA + ["--qk-layernorm", "--group-query-attention", "--num-query-groups", "2",
                 "--moe-layer-freq", "[0,1]"]
# name: (world size, model flags, layout flags); the model flags alone are the one-process run
CASES = {
    "dp2": (2, [], []),  # experts replicated: their gradients over the expert-DP group = DP
    "dp2_zero2": (2, [], ["--zero-stage", "2"]),  # EP 1: the experts' buffer shards over DP
    "dp2_zero3": (2, [], ["--zero-stage", "3"]),
    "ep2": (2, [], EP2),
    # the combined 1F1B (2 micro-batches per rank: F1, the pair (F2, B1), B2); bit for bit ep2
    "ep2_overlap": (2, [], EP2 + ["--overlap-moe-expert-parallel-comm"]),
    # and the experts' weight gradients deferred into its all-to-all waits; bit for bit ep2;
    # the per-expert loop's too (the one-process run takes the grouped GEMM: within 1e-5)
    "ep2_overlap_delay_wgrad": (2, [], EP2 + ["--overlap-moe-expert-parallel-comm",
                                              "--delay-wgrad-compute"]),
    # (with ZeRO-2's overlapped reduce-scatter: a deferred W marks its expert weight ready)
    "ep2_loop_overlap_delay_wgrad": (2, [], EP2 + ["--overlap-moe-expert-parallel-comm",
                                                   "--delay-wgrad-compute",
                                                   "--no-moe-grouped-gemm", "--zero-stage", "2",
                                                   "--overlap-grad-reduce"]),
    # Llama shapes with sigmoid routing and its bias, a gated shared expert, seq_aux_loss and
    # the per-expert loop (the other runs take grouped GEMMs), under full recomputation
    "ep2_llama_variants": (2, LLAMA + SIGMOID + [
        "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--no-moe-grouped-gemm",
        "--recompute-granularity", "full"], EP2),
    "ep2_capacity": (2, ["--moe-expert-capacity-factor", "1.0"], EP2),
    # padded to capacity: fixed blocks, no count exchange
    "ep2_capacity_padded": (2, ["--moe-expert-capacity-factor", "1.0",
                                "--moe-pad-expert-input-to-capacity"], EP2),
    # low precision (bf16 weights with fp32 masters; fp16 with loss scaling, the expert
    # gradients in its overflow check): equal one process in that precision, within TOLERANCE
    "ep2_bf16": (2, ["--bf16"], EP2),
    "ep2_fp16": (2, ["--fp16", "--initial-loss-scale", "1024"], EP2),
    # compiled up to the experts (aot_eager: dynamo's capture, the ops run eagerly)
    "ep2_compiled": (2, [], EP2 + ["--torch-compile", "aot_eager"]),
    "ep4": (4, [], EP4),
    "ep2_edp2": (4, [], EP2),
    "ep2_tp2_sp": (4, [], EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--expert-tensor-parallel-size", "1"]),
    # ETP = TP (the default): each expert split over the TP pair, EDP 1
    "ep2_tp2_sp_etp2": (4, LLAMA, EP2 + TP2_SP),
    # ETP folded over data-parallel ranks (TP 1), ZeRO-2's expert shards over EDP 1
    "etp2_over_dp_zero2": (2, LLAMA, ["--expert-tensor-parallel-size", "2", "--zero-stage", "2"]),
    # the allgather dispatcher: at EP 1 (experts split over TP) it reads nothing per layer; at
    # EP 2 (biases, GPT-2 shapes) each rank picks its experts' rows out of the gathered tokens
    "allgather_tp2_sp": (2, LLAMA, ALLGATHER + TP2_SP),
    "allgather_ep2": (2, [], ALLGATHER + EP2),
    "ep2_cp2": (4, [], EP2 + ["--context-parallel-size", "2"]),
    # the first stage is dense: its ranks hold no expert
    "ep2_pp2_dense_first": (4, DENSE_FIRST, EP2 + PP2),
    # F&B pairs (docs/pipeline_parallel.md): bit for bit the same schedule without them
    "ep2_pp2_dense_first_overlap": (4, DENSE_FIRST, EP2 + PP2 + OVERLAP),
    # global_aux_loss: the two DP ranks' micro-batches of 2 are one round of 4 tokens' worth
    # of sequences, so the one-process run takes micro-batches of 4 (docs/moe.md)
    "global_aux_dp2_ep2_tp2_sp": (4, LLAMA + ["--moe-router-load-balancing-type",
                                              "global_aux_loss", "--micro-batch-size", "4"],
                                  EP2 + TP2_SP + ["--micro-batch-size", "2"]),
    # a V schedule: each rank holds the first chunk (a dense layer) and the last (experts)
    "ep2_pp2_dualpipev": (4, FOUR_LAYERS, EP2 + PP2 + ["--pipeline-schedule", "dualpipev"]),
    # (its op timeline logged: test_a_run_logs_its_exposed_all_to_all_time)
    "ep2_pp2_dualpipev_overlap": (4, FOUR_LAYERS, EP2 + PP2 + OVERLAP + [
        "--pipeline-schedule", "dualpipev", "--timing-log-level", "1"]),
    "ep2_pp2_dualpipev_overlap_delay_wgrad": (4, FOUR_LAYERS, EP2 + PP2 + OVERLAP + [
        "--pipeline-schedule", "dualpipev", "--delay-wgrad-compute"]),
    # the other schedules' pairs: ZB-V's (its W ops deferred too; ZeRO-2 whose gradient
    # reduce-scatters the pairs' backwards launch), interleaved's (v 2)
    "ep2_pp2_zbv_overlap": (4, FOUR_LAYERS, EP2 + PP2 + OVERLAP + [
        "--pipeline-schedule", "zb-v", "--zero-stage", "2", "--overlap-grad-reduce"]),
    "ep2_pp2_interleaved_overlap": (4, FOUR_LAYERS, EP2 + PP2 + OVERLAP + [
        "--num-layers-per-virtual-pipeline-stage", "1"]),
    # DeepSeek-V3-shaped: MLA's replicated latents over TP, its V padded for the CP ring (p2p)
    "deepseek_ep2_tp2_sp": (4, DEEPSEEK, EP2 + TP2_SP + ["--expert-tensor-parallel-size", "1"]),
    "deepseek_ep2_pp2": (4, DEEPSEEK, EP2 + ["--pipeline-model-parallel-size", "2"]),
    "deepseek_ep2_cp2_p2p": (4, DEEPSEEK, EP2 + ["--context-parallel-size", "2",
                                                 "--cp-comm-type", "p2p"]),
    "deepseek_ep2_cp2_a2a": (4, DEEPSEEK, EP2 + ["--context-parallel-size", "2",
                                                 "--cp-comm-type", "a2a"]),
    # Qwen3-MoE-shaped at EP4 (EDP 1) with every parameter sharded over DP 4
    "qwen3_ep4_zero3": (4, QWEN3, EP4 + ["--zero-stage", "3"]),
}


# relative; 1e-5 (fp32) for the others. Low precision rounds differently where the layout
# changes the order of a sum (the combine, the gradient reductions), and a near-tie can then
# route a token elsewhere: the load imbalance (a max over experts) is not compared there.
TOLERANCE = {"ep2_bf16": 2e-2, "ep2_fp16": 2e-3}
KEYS = ("lm_loss", "grad_norm", "moe_load_balancing_loss", "moe_max_imbalance",
        "moe/layer1/z_loss")


def _argv(model, layout, metrics):
    from pretrain_utils import flags

    return flags(*MOE, *model, *layout, train_iters=ITERS, metrics_file=metrics,
                 attention_dropout=0.0, hidden_dropout=0.0, eval_iters=0)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from pretrain_utils import pretrain_cases, single_process_refs

    d = tmp_path_factory.mktemp("moe")
    for world in (2, 4):
        runs = [_argv(model, layout, d / f"{name}.jsonl")
                for name, (w, model, layout) in CASES.items() if w == world]
        assert all(run_distributed(pretrain_cases, world, runs, timeout=600))
    refs = single_process_refs((m for _w, m, _l in CASES.values()),
                               lambda m, out: _argv(m, [], out), d)
    return d, refs


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layout_matches_one_process(moe_runs, name):
    from pretrain_utils import read_metrics

    d, refs = moe_runs
    ref, got = read_metrics(refs[tuple(CASES[name][1])]), read_metrics(d / f"{name}.jsonl")
    assert [r["iteration"] for r in ref] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in got] == [r["iteration"] for r in ref]
    for a, b in zip(ref, got):
        # the MoE metrics too: per-micro-batch balancing loss and load imbalance over the whole
        # global batch, whatever splits the tokens
        for key in KEYS[:3] if name in TOLERANCE else KEYS:
            rel = abs(b[key] - a[key]) / abs(a[key])
            assert rel <= TOLERANCE.get(name, 1e-5), f"{name} iteration {a['iteration']} {key}: {b[key]} vs one " \
                                f"process {a[key]} (rel {rel:.2e})"
    assert len({round(r["lm_loss"], 4) for r in ref}) >= ITERS - 1  # the losses do move


@pytest.mark.parametrize("plain, overlap", [
    ("ep2", "ep2_overlap"),  # PP 1: the combined 1F1B
    ("ep2", "ep2_overlap_delay_wgrad"),  # and the experts' W deferred
    ("ep2_pp2_dense_first", "ep2_pp2_dense_first_overlap"),  # 1F1B's F&B pairs
    ("ep2_pp2_dualpipev", "ep2_pp2_dualpipev_overlap"),  # DualPipeV's
    ("ep2_pp2_dualpipev", "ep2_pp2_dualpipev_overlap_delay_wgrad"),
])
def test_moe_overlap_is_bit_for_bit_the_run_without_it(moe_runs, plain, overlap):
    """--overlap-moe-expert-parallel-comm reorders when ops run, never what they compute: every
    logged figure of the EP2 run, losses and grad norms included, is exactly the plain run's;
    with --delay-wgrad-compute too (the experts' weight gradients run later, in order)."""
    from pretrain_utils import read_metrics

    d, _ = moe_runs
    plain, paired = read_metrics(d / f"{plain}.jsonl"), read_metrics(d / f"{overlap}.jsonl")
    assert len(plain) == ITERS and [{k: r[k] for k in KEYS} for r in paired] == [
        {k: r[k] for k in KEYS} for r in plain]


def test_a_run_logs_its_exposed_all_to_all_time(moe_runs, tmp_path):
    """pretrain.py at --timing-log-level 1 logs, per log line, the stages' op timelines with the
    pairs' all-to-all waits and issues, and the exposed all-to-all time (the slowest stage's);
    tools/plot_pipeline.py draws the run's last one."""
    import os
    import sys

    from pretrain_utils import ROOT, read_metrics

    d, _ = moe_runs
    path = d / "ep2_pp2_dualpipev_overlap.jsonl"
    recs = read_metrics(path, split="pipeline")
    assert len(recs) == ITERS
    for rec in recs:
        stages = rec["pipeline_timeline"]
        assert [t["pp_rank"] for t in stages] == [0, 1]
        kinds = [{e["kind"] for e in t["events"]} for t in stages]
        assert all({"F", "B", "A", "I"} <= k for k in kinds), kinds
        per_stage = [rec[f"moe_a2a_exposed_s_stage{g}"] for g in range(2)]
        assert 0 < rec["moe_a2a_exposed_s"] == max(per_stage)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plot_pipeline

    trace = plot_pipeline.load(str(path))
    assert {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= {"A", "I"}
    plot_pipeline.plot(trace, str(tmp_path / "pairs.png"))
    assert (tmp_path / "pairs.png").stat().st_size > 0


def _paired_timeline(rank, world_size):
    """benchmarks/moe_overlap.py's worker on a tiny model: its gradients with and without the
    overlap, and the op timeline of each."""
    import os
    import sys

    from pretrain_utils import ROOT

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import moe_overlap

    args = moe_overlap.parse_args([
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--seq-length", "16",
        "--micro-batches", "3", "--vocab-size", "128", "--warmup", "0", "--rounds", "1",
        "--imbalanced", "--all-timelines"])
    return moe_overlap.worker(rank, world_size, args)


def test_moe_overlap_interleaves_the_pair_and_hides_its_waits():
    """The pairs really run interleaved: B(j)'s span lies inside F(j+1)'s, each pair's
    all-to-alls are issued async ("I" events) by both sides, and the gradients equal the
    unpaired step's bit for bit (with --delay-wgrad-compute too, whose W's run after their B and
    before the next); the unpaired schedule records each all-to-all as one wait."""
    from dist_utils import run_distributed
    from megalite.pipeline_parallel.timeline import StageTimeline

    for r in run_distributed(_paired_timeline, 2, timeout=120):
        assert r["grads_bit_identical"]
        plain = StageTimeline.from_dict(r["timelines"]["plain"])
        paired = StageTimeline.from_dict(r["timelines"]["overlap"])
        # per micro-batch and MoE layer: counts, dispatch, combine forward; two backward
        assert [e.kind for e in plain.events].count("A") == 3 * 2 * 5 and not any(
            e.kind == "I" for e in plain.events)
        span = {(e.kind, e.microbatch): e for e in paired.events if e.kind in "FB"}
        for j in range(2):
            f, b = span["F", j + 1], span["B", j]
            assert f.start < b.start < b.end < f.end  # F(j+1) starts, B(j) runs in its gaps
        issued = {e.microbatch for e in paired.events if e.kind == "I"}
        assert issued == {0, 1, 2}  # both sides of both pairs issued async
        assert paired.peak_in_flight == 2
        # --delay-wgrad-compute: each pair's B(j) leaves its experts' W's (2 per MoE layer) to
        # run in all-to-all waits, first in first out, all before the last B (inline)
        delayed = StageTimeline.from_dict(r["timelines"]["overlap+delay_wgrad"])
        w = [e for e in delayed.events if e.kind == "W"]
        assert [e.microbatch for e in w] == [0] * 4 + [1] * 4
        span = {(e.kind, e.microbatch): e for e in delayed.events if e.kind in "FB"}
        assert all(span["B", e.microbatch].start < e.start and e.end <= span["B", 2].start
                   for e in w)


def _pipelined_timeline(rank, world_size):
    """benchmarks/moe_overlap_pipeline.py's worker (EP 2 x PP 2, DualPipeV) on a tiny model."""
    import os
    import sys

    from pretrain_utils import ROOT

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import moe_overlap_pipeline

    args = moe_overlap_pipeline.parse_args([
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--seq-length", "16",
        "--micro-batches", "4", "--vocab-size", "128", "--warmup", "0", "--rounds", "1",
        "--imbalanced", "--schedule", "dualpipev"])
    return moe_overlap_pipeline.worker(rank, world_size, args)


def test_pipelined_pairs_interleave_and_hide_their_waits():
    """At PP 2 (DualPipeV) the F&B pairs of schedules.paired_units really run interleaved on
    every stage: each pair's backward starts inside its forward's span, both issue their
    all-to-alls async ("I"), and the gradients equal the unpaired step's bit for bit."""
    from dist_utils import run_distributed
    from megalite.pipeline_parallel.schedules import paired_units, schedule_order
    from megalite.pipeline_parallel.timeline import StageTimeline

    for r in run_distributed(_pipelined_timeline, 4, timeout=180):
        assert r["grads_bit_identical"]
        plain = StageTimeline.from_dict(r["timelines"]["plain"])
        paired = StageTimeline.from_dict(r["timelines"]["overlap"])
        assert not any(e.kind == "I" for e in plain.events)
        ops = schedule_order("dualpipev", 2, r["pp_rank"], 4, 2, paired=True)
        span = {(e.kind, e.chunk, e.microbatch): e for e in paired.events if e.kind in "FBW"}
        pairs = [u for u in paired_units("dualpipev", 2, 4, 2)[r["pp_rank"]] if len(u) == 2]
        assert pairs
        for i, k in pairs:
            f, b = (span[o.kind, o.chunk, o.microbatch] for o in (ops[i], ops[k]))
            assert f.start < b.start < f.end  # B started while F was suspended at an all-to-all
        issued = {(e.chunk, e.microbatch) for e in paired.events if e.kind == "I"}
        assert {(ops[k].chunk, ops[k].microbatch) for _, k in pairs} <= issued
        # --delay-wgrad-compute: the pairs' backwards leave their experts' W's to the queue
        delayed = StageTimeline.from_dict(r["timelines"]["overlap+delay_wgrad"])
        w = [(e.chunk, e.microbatch) for e in delayed.events if e.kind == "W"]
        own = [(o.chunk, o.microbatch) for o in ops if o.kind == "W"]  # the schedule's W ops
        assert len(w) > len(own) and set(w) <= set(own) | {
            (ops[k].chunk, ops[k].microbatch) for _, k in pairs}


def test_moe_checkpoint_resumes_exactly_with_its_expert_bias(tmp_path):
    """Save at iteration 2, resume to 4: the same losses as the run that never stopped, the
    loss-free balancing bias (sigmoid routing chooses by it) restored from the checkpoint."""
    import torch

    from pretrain_utils import read_metrics, run_main

    whole, first, second = (tmp_path / f"{n}.jsonl" for n in ("whole", "first", "second"))
    assert run_main(_argv(SIGMOID, [], whole)) == 0
    assert run_main(_argv(SIGMOID, ["--exit-interval", "2", "--save", tmp_path / "ck"],
                          first)) == 0
    state = torch.load(tmp_path / "ck" / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt",
                       weights_only=False)
    bias = state["model"]["layers.0.mlp.expert_bias"]
    assert bias.abs().sum() > 0  # it moved during the first two steps, and it is saved
    assert run_main(_argv(SIGMOID, ["--load", tmp_path / "ck"], second)) == 0
    ref = [r["lm_loss"] for r in read_metrics(whole)]
    got = [r["lm_loss"] for r in read_metrics(first) + read_metrics(second)]
    assert got == ref
