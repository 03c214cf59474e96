"""Pipeline parallelism equals one device (docs/design.md, contract 5), in the textbook op order.

Each multi-process run groups several layouts (to pay the process start-up once). Inside each
worker a few Adam steps run on the pipeline chunks and, in the same process, on the single-device
GPTModel built from the same seed (contract 3) on the same global batch: the per-iteration loss
must match (rel 1e-5) on every one of ITERS steps, every parameter's full gradient too, by its
layout-independent name (1e-5 of its norm on the first step, 1e-4 after Adam steps), and the
trained weights at the end (1e-4). The
model has no qkv bias: attention is invariant to the key bias, so its exact gradient is 0 and
what autograd returns is rounding noise that Adam turns into lr-sized steps, noise no two
summation orders agree on (tests/test_zero.py does the same).
"""

import importlib.util
import json
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, full_grads, full_params, tiny_config

from megalite.config import ConfigError
from megalite.distributed.finalize_model_grads import finalize_model_grads
from megalite.models import GPTModel
from megalite.parallel_state import ParallelState, initialize_model_parallel
from megalite.pipeline_parallel.executor import PipelineExecutor
from megalite.pipeline_parallel.partition import (
    build_model_chunks, stage_layer_counts, virtual_layer_ranges)
from megalite.config import SCHEDULES, V_SCHEDULES, check_layer_split, check_pipeline_args
from megalite.pipeline_parallel.executor import get_forward_backward_func
from megalite.pipeline_parallel.partition import virtual_stage
from megalite.pipeline_parallel.schedules import (
    eager_program, op_peers, p2p_program, paired_units, schedule_order)
from megalite.pipeline_parallel.timeline import (
    StageTimeline, bubble_stats, schedule_idle_times, write_chrome_trace)
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, MBS, ITERS = 16, 2, 4
EMB = "embedding.word_embeddings.weight"
ZERO_BUBBLE = ("zb-h1", "zb-v", "dualpipev")

# name: (tp, pp, sp, schedule, layers, layers_per_virtual_stage, first, last, m, tied)
LAYOUTS_4 = {
    "pp4_1f1b_m4_tied": (1, 4, False, "1f1b", 8, None, None, None, 4, True),
    "pp4_1f1b_m8_uneven_untied": (1, 4, False, "1f1b", 8, None, 1, 3, 8, False),
    "pp4_v2_interleaved_m4_tied": (1, 4, False, "interleaved", 8, 1, None, None, 4, True),
    "pp4_zbh1_m8_tied": (1, 4, False, "zb-h1", 4, None, None, None, 8, True),
    "pp4_zbh1_m12_untied": (1, 4, False, "zb-h1", 4, None, None, None, 12, False),
    "pp2_dp2_1f1b_m6_tied": (1, 2, False, "1f1b", 4, None, None, None, 6, True),
    "pp2_dp2_v2_interleaved_m4_untied": (1, 2, False, "interleaved", 4, 1, None, None, 4, False),
    "pp2_dp2_zbh1_m2_tied": (1, 2, False, "zb-h1", 4, None, None, None, 2, True),
    "tp2_pp2_sp_1f1b_m4_tied": (2, 2, True, "1f1b", 4, None, None, None, 4, True),
    "tp2_pp2_sp_v2_interleaved_m2_untied": (2, 2, True, "interleaved", 4, 1, None, None, 2, False),
    "pp4_zbv_m8_tied": (1, 4, False, "zb-v", 8, None, None, None, 8, True),
    "pp2_dp2_dualpipev_m6_untied": (1, 2, False, "dualpipev", 4, None, None, None, 6, False),
    "tp2_pp2_sp_zbv_m4_untied": (2, 2, True, "zb-v", 4, None, None, None, 4, False),
}
# These run the batched p2p program (NCCL's) on gloo; the others run gloo's eager one
# (schedules.eager_program). Both must give the same losses, gradients and op order.
BATCHED = {"pp4_v2_interleaved_m4_tied", "pp2_dp2_zbh1_m2_tied", "tp2_pp2_sp_1f1b_m4_tied",
           "tp2_pp2_dp2_sp_zbh1_m2_untied", "pp4_zbv_m8_tied", "pp2_dp2_dualpipev_m6_untied"}
LAYOUTS_8 = {
    "tp2_pp2_dp2_sp_1f1b_m4_tied": (2, 2, True, "1f1b", 4, None, None, None, 4, True),
    "tp2_pp2_dp2_sp_zbh1_m2_untied": (2, 2, True, "zb-h1", 4, None, None, None, 2, False),
}


def _global_batch(it, n):
    g = torch.Generator().manual_seed(1000 + it)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


W_RUNS = []  # (chunk, deferred weight-gradient closures) of each W op this process ran
_run_weight = PipelineExecutor.weight


def _counting_weight(self, op, unused):
    W_RUNS.append((op.chunk, len(self.weight_grads[op.chunk, op.microbatch])))
    return _run_weight(self, op, unused)


def _run_layout(name, layout, model=("gpt2", {})):
    """model: (tiny_config family, ModelConfig overrides) of the model trained."""
    tp, pp, sp, schedule, layers, per_v, first, last, m, tied = layout
    W_RUNS.clear()
    cfg = dict(num_layers=layers, untie_embeddings_and_output_weights=not tied,
               add_qkv_bias=False, **model[1])
    ps = initialize_model_parallel(tp, pp, backend="gloo", device="cpu", set_default=False)
    chunks = build_model_chunks(tiny_config(model[0], **cfg), ps, seed=7, sequence_parallel=sp,
                                num_layers_per_virtual_pipeline_stage=per_v,
                                decoder_first_pipeline_num_layers=first,
                                decoder_last_pipeline_num_layers=last,
                                v_shape=schedule in V_SCHEDULES)
    ref = GPTModel(tiny_config(model[0], **cfg), ParallelState(), seed=7)
    fb = get_forward_backward_func(pp, ps.vpp_size, schedule)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    n = m * MBS * ps.dp_size
    last_stage = ps.pp_rank == (0 if schedule in V_SCHEDULES else pp - 1)  # the loss's stage
    result = {"pp_rank": ps.pp_rank, "tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank}

    for it in range(ITERS):
        tokens, labels = _global_batch(it, n)
        ntok = labels.numel()
        ref_opt.zero_grad()
        ref_loss = ref(tokens, labels=labels).sum() / ntok
        ref_loss.backward()
        ref_grads = full_grads(ref, None)

        lo = ps.dp_rank * m * MBS
        mbs = [(tokens[lo + j * MBS: lo + (j + 1) * MBS], labels[lo + j * MBS: lo + (j + 1) * MBS])
               for j in range(m)]

        def forward_step(data_iterator, model):
            tok, lab = next(data_iterator)
            out = model(tok, labels=lab)

            def loss_func(per_token):
                s = per_token.sum()
                return s / ntok, {"lm_loss_sum": s.detach(), "num_tokens": lab.numel()}
            return out, loss_func

        opt.zero_grad()
        stats = fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=chunks,
                   num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, parallel_state=ps,
                   forward_only=False,
                   finalize_model_grads_func=lambda cs: finalize_model_grads(cs, ps),
                   timing_log_level=1, p2p_mode="batched" if name in BATCHED else None)
        where = f"{name} it={it} rank={dist.get_rank()}"
        if last_stage:
            assert len(stats) == m, f"{where}: {len(stats)} stats for {m} micro-batches"
            loss = torch.stack([s["lm_loss_sum"] for s in stats]).sum()
            if ps.dp_group is not None:
                dist.all_reduce(loss, group=ps.dp_group)
            rel = abs(loss.item() / ntok - ref_loss.item()) / abs(ref_loss.item())
            assert rel <= 1e-5, f"{where}: loss {loss.item() / ntok} vs {ref_loss.item()} rel {rel}"
        else:
            assert stats == [], f"{where}: a non-last stage returned stats"
        got = {}
        for c in chunks:
            for k, g in full_grads(c, ps.tp_group).items():
                got[EMB if (tied and k == "output_layer.weight") else k] = g
        # 1e-5 of each gradient's norm from identical weights (step 0); after Adam steps the
        # weights differ by the micro-batch summation order's round-off, normalised by Adam into
        # the small-norm biases, so later steps (and the trained weights below) get 2e-4 (pp4
        # zb-h1 m=12 reaches 1.05e-4 on the first layer's norm on AVX-512 CPUs)
        assert_grads_close(got, {k: ref_grads[k] for k in got}, 1e-5 if it == 0 else 2e-4, where)
        if it == 0:
            tl = fb.last_timeline()
            result["timeline"] = tl.to_dict()
            result["names"] = sorted(got)
        opt.step()
        ref_opt.step()

    # Zero-bubble: each W op computes the weight gradients of every linear layer of its chunk
    # (its B deferred them all: the linears ran on the deferrable function, not native F.linear).
    linears = [sum(isinstance(mod, (ColumnParallelLinear, RowParallelLinear))
                   for mod in c.modules()) for c in chunks]
    w_ops = sum(o.kind == "W" for o in schedule_order(schedule, pp, ps.pp_rank, m, len(chunks)))
    assert (w_ops > 0) == (schedule in ZERO_BUBBLE) and len(W_RUNS) == ITERS * w_ops, name
    assert all(n == linears[c] > 0 for c, n in W_RUNS), f"{name}: W ops ran {W_RUNS[:4]}"
    # Trained weights track the reference (norm-relative, as every parity test; 2e-4 as the
    # gradients after step 0, above) ...
    ref_params = full_params(ref, None)
    for c in chunks:
        for k, w in full_params(c, ps.tp_group).items():
            r = ref_params[EMB if (tied and k == "output_layer.weight") else k]
            rel = ((w - r).norm() / r.norm()).item()
            assert rel <= 2e-4, f"{name}: {k} drifted from the reference, rel {rel:.2e}"
    # ... and the two copies of a tied embedding stay bit-identical (their gradients are summed
    # over the embedding group every step, or on rank 0 under the V, so both get the same update).
    if tied and schedule in V_SCHEDULES and ps.pp_rank == 0:
        assert torch.equal(chunks[0].embedding.word_embeddings.weight,
                           chunks[1].output_layer.weight), f"{name}: tied embedding copies diverged"
    elif tied and pp > 1 and ps.in_embedding_group and schedule not in V_SCHEDULES:
        mine = (chunks[0].embedding.word_embeddings.weight if ps.pp_rank == 0
                else chunks[-1].output_layer.weight).detach().contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=ps.embedding_group)
        assert torch.equal(both[0], both[1]), f"{name}: tied embedding copies diverged"
    return result


def _parity_worker(rank, world_size, layouts, model=("gpt2", {})):
    with mock.patch.object(PipelineExecutor, "weight", _counting_weight):
        return {name: _run_layout(name, layout, model) for name, layout in layouts.items()}


def _check_names_cover_model(results, layout):
    """The stages together hold every parameter of the single-device model exactly once."""
    tp, pp, sp, schedule, layers, *_rest, tied = layout
    names = set()
    for res in results:
        if res["tp_rank"] == 0 and res["dp_rank"] == 0:
            stage_names = set(res["names"])
            assert not (names & stage_names) or tied, f"duplicated parameters {names & stage_names}"
            names |= stage_names
    ref = GPTModel(tiny_config("gpt2", num_layers=layers, add_qkv_bias=False,
                               untie_embeddings_and_output_weights=not tied), ParallelState())
    assert names == {k for k, _ in ref.named_parameters()}


@pytest.fixture(scope="module")
def results_4():
    return run_distributed(_parity_worker, 4, LAYOUTS_4, timeout=600)


def test_pp_1f1b_interleaved_zbh1_match_single_device(results_4):
    # the assertions on losses and gradients ran inside the workers; here: every layout ran
    # on every rank and the stages together cover the whole model
    for name, layout in LAYOUTS_4.items():
        _check_names_cover_model([r[name] for r in results_4], layout)


def _peak(order):
    """Most micro-batches (per chunk) with F done and B pending, along an order of op strings."""
    live = peak = 0
    for o in order:
        live += {"F": 1, "B": -1, "W": 0}[o[0]]
        peak = max(peak, live)
    return peak


def test_executor_runs_the_op_list_it_is_given(results_4):
    """Every stage executed exactly its schedule_order (whose shape the single-process tests
    below check against hand-written orders and properties), and its recorded peak of in-flight
    micro-batches is the order's."""
    for name, (tp, p, sp, schedule, layers, per_v, first, last, m, tied) in LAYOUTS_4.items():
        v = layers // (p * per_v) if per_v else (2 if schedule in V_SCHEDULES else 1)
        for res in results_4:
            tl = StageTimeline.from_dict(res[name]["timeline"])
            r = res[name]["pp_rank"]
            ops = schedule_order(schedule, p, r, m, v)
            want = [f"{o.kind}{o.microbatch + 1}" + (f".{o.chunk}" if v > 1 else "") for o in ops]
            assert tl.order() == want, f"{name} stage {r}: {tl.order()}"
            assert tl.peak_in_flight == _peak(want), f"{name} stage {r}: {tl.peak_in_flight}"
            if schedule in ("1f1b", "zb-h1"):  # 1F1B's memory: p - r micro-batches on stage r
                assert tl.peak_in_flight == p - r, f"{name} stage {r}: {tl.peak_in_flight}"
    # W really is separate work: the weight-gradient GEMMs take measurable time
    tls = [StageTimeline.from_dict(r["pp4_zbh1_m8_tied"]["timeline"]) for r in results_4]
    assert bubble_stats(tls)["t_w"] > 0


def test_timeline_trace_and_plot(results_4, tmp_path):
    tls = [StageTimeline.from_dict(r["pp4_zbh1_m8_tied"]["timeline"])
           for r in sorted(results_4, key=lambda r: r["pp4_zbh1_m8_tied"]["pp_rank"])]
    stats = bubble_stats(tls)
    assert 0.0 < stats["bubble_fraction"] < 1.0  # measured on a busy machine: only its range
    trace = tmp_path / "trace.json"
    write_chrome_trace(tls, str(trace))
    data = json.loads(trace.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 4 * 3 * 8 and {e["pid"] for e in xs} == {0, 1, 2, 3}
    png = tmp_path / "schedule.png"
    # in this process (its command line draws metrics.jsonl in test_pretrain_pipeline.py)
    spec = importlib.util.spec_from_file_location(
        "plot_pipeline", os.path.join(ROOT, "tools", "plot_pipeline.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main([str(trace), "-o", str(png)])
    assert png.stat().st_size > 1000


def test_tp2_pp2_dp2_sp_matches_single_device():
    results = run_distributed(_parity_worker, 8, LAYOUTS_8, timeout=600)
    for name, layout in LAYOUTS_8.items():
        _check_names_cover_model([r[name] for r in results], layout)


# ------------------------------------------------------------------------ single-process checks
def _orders(schedule, p, m, v=1):
    return [" ".join(str(o) for o in schedule_order(schedule, p, r, m, v)).replace(".0", "")
            for r in range(p)] if v == 1 else [
        " ".join(str(o) for o in schedule_order(schedule, p, r, m, v)) for r in range(p)]


def test_orders_match_hand_written_ones():
    """Small cases written out by hand from the papers' figures (not from the generators)."""
    assert _orders("1f1b", 2, 3) == ["F1 F2 B1 F3 B2 B3", "F1 B1 F2 B2 F3 B3"]
    assert _orders("1f1b", 4, 4) == ["F1 F2 F3 F4 B1 B2 B3 B4", "F1 F2 F3 B1 F4 B2 B3 B4",
                                     "F1 F2 B1 F3 B2 F4 B3 B4", "F1 B1 F2 B2 F3 B3 F4 B4"]
    assert _orders("zb-h1", 4, 8)[0] == (
        "F1 F2 F3 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 F8 B5 W5 B6 W6 B7 W7 B8 W8")
    assert _orders("zb-h1", 2, 3) == ["F1 F2 B1 W1 F3 B2 W2 B3 W3", "F1 B1 F2 B2 W1 F3 B3 W2 W3"]
    # p=2, v=2, m=4 (Narayanan et al. Fig. 4 pattern): chunks taken in groups of p micro-batches
    assert _orders("interleaved", 2, 4, 2) == [
        "F1.0 F2.0 F1.1 F2.1 F3.0 B1.1 F4.0 B2.1 F3.1 B1.0 F4.1 B2.0 B3.1 B4.1 B3.0 B4.0",
        "F1.0 F2.0 F1.1 B1.1 F2.1 B2.1 F3.0 B1.0 F4.0 B2.0 F3.1 B3.1 F4.1 B4.1 B3.0 B4.0"]
    # ZB-V, p=2, m=4: rank 0 fills the V with 2p-1 chunk-0 forwards; rank 1 (the V's tip) runs
    # chunk 1 straight after chunk 0; the steady phase is F, B, W per chunk; W's fill the drain
    assert _orders("zb-v", 2, 4, 2) == [
        "F1.0 F2.0 F3.0 F1.1 B1.1 W1.1 F2.1 B2.1 W2.1 F4.0 B1.0 W1.0 F3.1 B3.1 W3.1 B2.0 W2.0 "
        "F4.1 B4.1 W4.1 B3.0 W3.0 B4.0 W4.0",
        "F1.0 F1.1 F2.0 F2.1 B1.1 W1.1 F3.0 B1.0 W1.0 F3.1 B2.1 W2.1 F4.0 B2.0 W2.0 F4.1 B3.1 "
        "W3.1 B3.0 B4.1 B4.0 W3.0 W4.1 W4.0"]
    # DualPipeV, p=2, m=4: steady "F0 B1 F1 B0"; only the drain defers W
    assert _orders("dualpipev", 2, 4, 2) == [
        "F1.0 F2.0 F3.0 F1.1 B1.1 W1.1 F2.1 F4.0 B2.1 F3.1 B1.0 B3.1 F4.1 B2.0 B4.1 B3.0 W3.0 "
        "B4.0 W4.0",
        "F1.0 F1.1 F2.0 F2.1 F3.0 B1.1 F3.1 B1.0 F4.0 B2.1 F4.1 B2.0 B3.1 B3.0 B4.1 B4.0 W4.1 "
        "W4.0"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_order_properties(schedule):
    """For every rank of p in {2,3,4} and several m: each (kind, chunk, micro-batch) once; F
    before its B, B before its W; 1F1B-family warm-up p-r-1; in-flight bounded as claimed."""
    v = 2 if schedule in ("interleaved",) + V_SCHEDULES else 1
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p):
            for r in range(p):
                ops = schedule_order(schedule, p, r, m, v)
                keys = [(o.kind, o.chunk, o.microbatch) for o in ops]
                assert len(set(keys)) == len(keys)
                assert {(k, c, j) for k, c, j in keys if k != "W"} == {
                    (k, c, j) for k in "FB" for c in range(v) for j in range(m)}
                for k, c, j in keys:
                    if k != "F":
                        assert keys.index(("F" if k == "B" else "B", c, j)) < keys.index((k, c, j))
                first_b = next(i for i, o in enumerate(ops) if o.kind == "B")
                if schedule in ("1f1b", "zb-h1"):
                    assert first_b == p - r - 1 + 1 and _peak([str(o) for o in ops]) == p - r
                if schedule == "interleaved":  # 2(p-r-1)+(v-1)p warm-up forwards
                    assert first_b == 2 * (p - r - 1) + (v - 1) * p + 1
                if schedule == "zb-v":  # 1F1B's activation memory: 2p half-size chunks
                    assert _peak([str(o) for o in ops]) <= 2 * p
                if schedule == "dualpipev":  # DeepSeek-V3: PP+1 micro-batches on PP/2 ranks
                    assert _peak([str(o) for o in ops]) <= 2 * p + 1


def test_bubble_implied_by_each_order():
    """Run the orders with fixed op times and instant p2p (timeline.schedule_idle_times): each
    rank's idle time is the textbook bubble. A B with no deferred W is a full backward
    (T_B + T_W). Per stage: 1F1B (p-1)(T_F+T_B+T_W); interleaved 1/v of it; ZB-H1
    (p-1)(T_F+T_B-T_W) (Qi et al. 2024). The V schedules run chunks of half a stage (times t/2):
    with T_F = T_B = T_W they idle (p-1) chunk ops, half of ZB-H1, a sixth of 1F1B; DualPipeV
    stays within the DeepSeek-V3 report's (p-1)(T_F&B + T_B - 3T_W), T_F&B = T_F+T_B+T_W here
    (no overlap on one stream); ZB-V within ZB-H1's (both for T_W <= T_F)."""
    for p in (2, 3, 4):
        for m in (2 * p, 4 * p):
            for t_f, t_b, t_w in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0)):
                def idle(schedule, v=1, scale=1.0):
                    got = schedule_idle_times(schedule, p, m, v, t_f * scale, t_b * scale,
                                              t_w * scale)
                    assert max(got) - min(got) < 1e-9, (schedule, got)
                    return got[0]
                zb_h1 = (p - 1) * (t_f + t_b - t_w)
                assert idle("1f1b") == pytest.approx((p - 1) * (t_f + t_b + t_w))
                assert idle("zb-h1") == pytest.approx(zb_h1)
                assert idle("interleaved", 2, 0.5) == pytest.approx((p - 1) * (t_f + t_b + t_w) / 2)
                f, b, w = t_f / 2, t_b / 2, t_w / 2
                assert idle("dualpipev", 2, 0.5) <= (p - 1) * ((f + b + w) + b - 3 * w) + 1e-9
                assert idle("zb-v", 2, 0.5) <= zb_h1 + 1e-9
                if t_f == t_b == t_w:
                    assert idle("zb-v", 2, 0.5) == idle("dualpipev", 2, 0.5) == (p - 1) * f


def test_layer_partition():
    assert virtual_layer_ranges(8, 4) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    # chunk c of rank r holds virtual stage c*p + r
    assert virtual_layer_ranges(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    # the V: rank r holds virtual stages r and 2p-1-r
    assert virtual_layer_ranges(8, 2, v_shape=True) == [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    assert stage_layer_counts(8, 4, 1, 3) == [1, 2, 2, 3]
    assert stage_layer_counts(6, 2, 2, 4) == [2, 4]
    assert stage_layer_counts(7, 3, decoder_first_pipeline_num_layers=1) == [1, 3, 3]


@pytest.mark.parametrize("call, flag", [
    (lambda: check_layer_split(6, 4), "--num-layers (6) must be divisible"),
    (lambda: check_layer_split(2, 4), "exceeds --num-layers"),
    (lambda: virtual_layer_ranges(8, 2, 3), "--num-layers-per-virtual-pipeline-stage (3)"),
    (lambda: check_layer_split(8, 4, None, 1, 2), "must split evenly"),
    (lambda: check_layer_split(8, 2, None, 3, 4), "must equal --num-layers"),
    (lambda: check_pipeline_args(4, 6, 2, "interleaved"), "multiple of"),
    (lambda: check_pipeline_args(4, 2, None, "1f1b"), "fewer than"),
    (lambda: check_pipeline_args(2, 4, 2, "zb-h1"), "does not support virtual stages"),
    (lambda: check_pipeline_args(2, 4, None, "gpipe"), "--pipeline-schedule"),
    (lambda: check_pipeline_args(2, 3, 2, "zb-v"), "at least 2 x"),
    (lambda: virtual_layer_ranges(6, 2, v_shape=True), "divisible by 4"),
    (lambda: get_forward_backward_func(2, None, "interleaved"), "needs"),
    (lambda: build_model_chunks(tiny_config("gpt2", num_layers=3),
                                ParallelState(pp_size=2, pp_ranks=[0, 1])),
     "must be divisible"),
])
def test_bad_pipeline_config_is_one_clear_line(call, flag):
    with pytest.raises(ConfigError) as e:
        call()
    msg = str(e.value)
    assert flag in msg and "\n" not in msg




# --------------------------------------------------------------------- deadlock-freedom (no procs)
# Every rank runs its p2p program (schedules.p2p_program): "post" a batch of sends and receives,
# "wait" for a batch, "run" an op (or "pair" an F&B pair). Replayed here under the backend's
# rules: each send or receive is matched by the counterpart with the same index on its (src, dst,
# tag) channel, a batch completes once all its ops are matched, and a rank blocks at "wait" until
# its batch completes. NCCL (batched program) ignores tags (one channel per (src, dst), in posting
# order) and runs a rank's batches in order on one stream: a batch is not even posted until the
# rank's earlier batches have completed. The replay also checks that the k-th message on each
# channel is the (virtual stage, micro-batch) the receiver expects, and that a hand-over inside a
# rank (the V's tip) comes from an op that rank already ran.
#
# With ``ep`` > 1 each pipeline rank is ``ep`` ranks (an EP group, running the same program) and
# every F or B of an MoE chunk issues all-to-alls on its group: 3 per forward (counts, dispatch,
# combine), 2 per backward, a pair's alternating F, B, F, B, ... as the Pair hands over. The
# calling rank blocks until an all-to-all completes (the host reads the split sizes), which needs
# every peer of the group to have issued it, carrying the same (kind, micro-batch, piece); under
# NCCL, also the peers' earlier batches done (one stream: the all-to-all queues behind them).
A2A_PIECES = {"F": 3, "B": 2, "W": 0}


def _a2a_order(unit, ops, moe):
    """The all-to-alls a program step issues, in the order a Pair hands over between its sides."""
    sides = [[(ops[i].kind, ops[i].chunk, ops[i].microbatch, n)
              for n in range(A2A_PIECES[ops[i].kind] if moe(ops[i]) else 0)] for i in unit]
    out = []
    while any(sides):
        for side in sides:
            if side:
                out.append(side.pop(0))
    return out


def _replay(schedule, p, m, v=1, forward_only=False, mode="eager", lookahead=None,
            paired=False, ep=1, dense_first=False):
    v_shape = schedule in V_SCHEDULES
    progs = []
    paired = paired and not forward_only
    for r in range(p):
        ops = schedule_order(schedule, p, r, m, v, forward_only, paired)
        peers = [op_peers(op, schedule, p, r, v) for op in ops]
        if lookahead is None:
            prog = p2p_program(mode, schedule, p, r, m, v, forward_only, paired)
        else:
            prog = eager_program([s not in (None, r) for s, _ in peers],
                                 [d not in (None, r) for _, d in peers], lookahead)

        def moe(op, r=r):  # dense_first: the first virtual stage holds no expert
            return ep > 1 and not (dense_first and virtual_stage(p, r, op.chunk, v, v_shape) == 0)
        steps = []
        for step in prog:
            if step[0] in ("run", "pair"):
                steps.append(step)
                steps += [("a2a", piece) for piece in _a2a_order(step[1:], ops, moe)]
                continue
            if step[0] != "post":
                steps.append(step)
                continue
            msgs = []
            # p2p.post's order inside a batch: activations before gradients, sends first
            for i in sorted(step[2] + step[3], key=lambda i: (ops[i].kind != "F", i in step[3])):
                op, (src, dst) = ops[i], peers[i]
                vs = virtual_stage(p, r, op.chunk, v, v_shape)
                up = vs - 1 if op.kind == "F" else vs + 1
                tag = "any" if mode == "batched" else "act" if op.kind == "F" else "grad"
                if i in step[2]:
                    msgs.append(("send", (r, dst, tag), (vs, op.microbatch)))
                else:
                    msgs.append(("recv", (src, r, tag), (up, op.microbatch)))
            steps.append(("post", step[1], msgs))
        for i, op in enumerate(ops):  # hand-overs inside the rank come from earlier ops
            if peers[i][0] == r:
                src_op = (op.kind, 1 - op.chunk, op.microbatch)
                assert src_op in [(o.kind, o.chunk, o.microbatch) for o in ops[:i]], (r, op)
        progs.append(steps)

    ranks = [(r, e) for r in range(p) for e in range(ep)]  # (pipeline rank, EP rank)
    posted = {}  # (send|recv, channel) -> payloads in posting order
    batches = {q: {} for q in ranks}  # rank -> batch id -> [(kind, channel, index, payload)]
    issued = {q: [] for q in ranks}  # rank -> its all-to-alls: (payload, batch ids before it)
    pos = {q: 0 for q in ranks}

    def complete(op, e):
        kind, (src, dst, tag), k, pay = op
        ch = ((src, e), (dst, e), tag)
        other = posted.get(("recv" if kind == "send" else "send", ch), [])
        if len(other) <= k:
            return False
        sent, expected = (other[k], pay) if kind == "recv" else (pay, other[k])
        assert sent == expected, (f"{schedule} p={p} m={m}: message {k} on {ch} carries "
                                  f"{sent}, the receiver expects {expected}")
        return True

    def batch_done(q, b):
        return all(complete(o, q[1]) for o in batches[q][b])

    def a2a_done(r, k):
        for e in range(ep):
            if len(issued[r, e]) <= k:
                return False
            pay, before = issued[r, e][k]
            assert pay == issued[r, 0][k][0], f"{schedule}: all-to-all {k} of stage {r} differs"
            if mode == "batched" and not all(batch_done((r, e), b) for b in before):
                return False
        return True

    while True:
        progressed = False
        for q in ranks:
            r, e = q
            while pos[q] < len(progs[r]):
                step = progs[r][pos[q]]
                if step[0] == "post":
                    if mode == "batched" and not all(batch_done(q, b) for b in batches[q]):
                        break  # NCCL: the stream is still busy with an earlier batch
                    ops = []
                    for kind, ch, pay in step[2]:
                        chan = ((ch[0], e), (ch[1], e), ch[2])
                        lst = posted.setdefault((kind, chan), [])
                        ops.append((kind, ch, len(lst), pay))
                        lst.append(pay)
                    batches[q][step[1]] = ops
                elif step[0] == "wait" and not batch_done(q, step[1]):
                    break
                elif step[0] == "a2a":
                    k = sum(1 for s in progs[r][:pos[q]] if s[0] == "a2a")
                    if len(issued[q]) == k:
                        issued[q].append((step[1], list(batches[q])))
                    if not a2a_done(r, k):
                        break
                pos[q] += 1
                progressed = True
        if all(pos[q] == len(progs[q[0]]) for q in ranks):
            for q in ranks:  # the step's end waits every batch left: all must complete
                assert all(batch_done(q, b) for b in batches[q]), schedule
            return True
        if not progressed:
            return [(q, progs[q[0]][pos[q]]) for q in ranks if pos[q] < len(progs[q[0]])]


@pytest.mark.parametrize("schedule, v, mode", [
    (s, v, mode) for s, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3))
    for mode in ("eager", "batched")] + [(s, 2, mode) for s in V_SCHEDULES
                                         for mode in ("eager", "batched")])
def test_p2p_programs_cannot_deadlock_and_match(schedule, v, mode):
    for p in (2, 3, 4):
        v_ms = (2 * p, 2 * p + 1, 3 * p, 4 * p)
        for m in (v_ms if schedule in V_SCHEDULES else (p, 2 * p, 3 * p)):
            for forward_only in (False, True):
                res = _replay(schedule, p, m, v, forward_only, mode)
                assert res is True, f"{schedule} {mode} p={p} m={m} v={v}: deadlock at {res}"
                if mode == "eager":
                    res = _replay(schedule, p, m, v, forward_only, mode, lookahead=1)
                    assert res is True, f"{schedule} lookahead 1 p={p} m={m}: deadlock at {res}"


@pytest.mark.parametrize("mode", ["eager", "batched"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_paired_programs_with_all_to_alls_cannot_deadlock(schedule, mode):
    """The F&B pairs' programs (--overlap-moe-expert-parallel-comm) on EP groups of 2 per stage,
    each F and B issuing its all-to-alls, a pair's alternating: deadlock-free and matched under
    both backends' rules, with experts on every stage and with a dense first stage; and the
    pairs are really there, in every steady phase."""
    v = 2 if schedule in V_SCHEDULES or schedule == "interleaved" else 1
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p + (schedule != "interleaved")):  # interleaved: m a multiple of p
            for dense_first in (False, True):
                res = _replay(schedule, p, m, v, mode=mode, paired=True, ep=2,
                              dense_first=dense_first)
                assert res is True, f"{schedule} {mode} p={p} m={m}: deadlock at {res}"
            units = paired_units(schedule, p, m, v)
            assert all(any(len(u) == 2 for u in mine) for mine in units), (schedule, p, m)


def test_unpaired_programs_with_all_to_alls_cannot_deadlock():
    """Without pairs, the all-to-alls of every F and B between the schedule's p2p batches."""
    for schedule in SCHEDULES:
        v = 2 if schedule in V_SCHEDULES or schedule == "interleaved" else 1
        for mode in ("eager", "batched"):
            res = _replay(schedule, 3, 6, v, mode=mode, ep=2)
            assert res is True, f"{schedule} {mode}: deadlock at {res}"


def test_pairing_unties_a_knot_the_replay_finds(monkeypatch):
    """Both ranks of p = 2 given 1F1B's order of rank 0 (F1, F2 B1, F3 B2, F4 B3, B4: it runs).
    Pairing each F with the B after it knots them: rank 0's (F2, B1) waits for rank 1's B1,
    which rank 1 pairs with an F2 that waits for rank 0's. The replay finds the deadlock;
    ``paired_units`` splits every such pair, and its program runs."""
    import megalite.pipeline_parallel.schedules as S

    def same_order(schedule, p, r, m, v=1, forward_only=False, paired=False):
        return S.order_1f1b(p, 0, m)

    def every_pair(schedule, p, m, v=1):
        return tuple(((0,), (1, 2), (3, 4), (5, 6), (7,)) for _ in range(p))

    for mod, name in ((S, "schedule_order"), (S, "p2p_program"), (S, "paired_units")):
        monkeypatch.setattr(mod, name, getattr(S, name).__wrapped__ if name != "schedule_order"
                            else same_order)
    monkeypatch.setitem(globals(), "schedule_order", same_order)
    monkeypatch.setitem(globals(), "p2p_program", S.p2p_program)
    untied = S.paired_units("1f1b", 2, 4)
    assert untied == tuple(tuple((i,) for i in range(8)) for _ in range(2))
    for mode in ("eager", "batched"):
        assert _replay("1f1b", 2, 4, mode=mode, paired=True, ep=2) is True
    monkeypatch.setattr(S, "paired_units", every_pair)
    assert _replay("1f1b", 2, 4, mode="eager", paired=True, ep=2) is not True


def test_p2p_programs_are_built_once_per_layout():
    """Every step of a run asks for the same program: it is built (and the lockstep simulated)
    once, and handed out immutable."""
    a = p2p_program("batched", "zb-v", 4, 1, 8, 2)
    assert a is p2p_program("batched", "zb-v", 4, 1, 8, 2) and isinstance(a, tuple)
    assert a is not p2p_program("batched", "zb-v", 4, 1, 9, 2)


def test_p2p_replay_detects_a_deadlock(monkeypatch):
    """The replay can fail: a program that holds its sends back until its ops have run
    deadlocks (stage 0 waits for a gradient of an activation it has not sent)."""
    def held_back(*args):
        prog = p2p.__wrapped__(*args)
        return [s for s in prog if not (s[0] == "post" and s[2])] + [
            s for s in prog if s[0] == "post" and s[2]]

    p2p = p2p_program
    monkeypatch.setitem(globals(), "p2p_program", held_back)
    assert _replay("1f1b", 2, 2) is not True


def test_eager_program_posts_receives_ahead_and_sends_at_once():
    n = 16
    prog = eager_program([True] * n, [True] * n, lookahead=2)
    posted = {}  # batch id -> the op whose input it receives
    for at, step in enumerate(prog):
        if step[0] == "post" and step[3]:
            posted[step[1]] = step[3][0]
        if step[0] == "run":
            i = step[1]
            # the receives of the next 2 ops are already posted when op i runs ...
            assert {j for j in (i, i + 1, i + 2) if j < n} <= set(posted.values()), prog[:at]
            # ... and op i's output is sent right after it, before the next op runs
            assert prog[at + 1][0] == "post" and prog[at + 1][2] == (i,)
