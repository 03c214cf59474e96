"""Context parallelism in the training stack (docs/context_parallel.md, "Using it"): bad layouts
fail in one line, the rank grid is tp -> cp -> dp -> pp, pretrain.py at CP 2/4 (alone and with
TP+SP, PP, DP with ZeRO 1 and 3, recompute, Llama GQA, the math blocks, a sliding window under a2a) gives the losses, gradient norms and
validation losses of one process, a CP2 checkpoint resumes at CP1 and CP4, and the planner
divides activations by C. The attention itself is tested in test_context_parallel_attention.py."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megalite.arguments import parse_args
from megalite.config import ConfigError, ParallelConfig
from megalite.parallel_state import initialize_model_parallel, rank_grid

_BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64"]


@pytest.mark.parametrize("extra,expect", [
    (["--context-parallel-size", "2", "--seq-length", "66"],
     "--seq-length (66) must be divisible by 4"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--seq-length", "66"],
     "--seq-length (66) must be divisible by 4"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "68"], "--seq-length (68) must be divisible by 8"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2"],
     "--cp-comm-type a2a"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention",
      "--num-query-groups", "1"], "1 query groups"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], "--attention-dropout 0.1"),
    (["--context-parallel-size", "0"], "--context-parallel-size must be >= 1"),
])
def test_bad_context_parallel_layouts_fail_in_one_line(extra, expect):
    with pytest.raises(ConfigError) as err:
        parse_args(_BASE + extra)
    assert expect in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_world_size_must_be_divisible_by_tp_cp_pp():
    cfg = parse_args(_BASE + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match=r"world size \(6\).*--context-parallel-size \(2\)"):
        cfg.parallel.validate(6)
    with pytest.raises(ConfigError, match=r"world size \(6\).*= 4"):
        ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2).validate(6)
    assert cfg.parallel.data_parallel_size(8) == 2


def test_rank_grid_order_is_tp_cp_dp_pp():
    dp, tp, dpg, pp, mp, cp, dpcp = rank_grid(16, 2, 2, 2)
    assert dp == 2
    assert tp[:2] == [[0, 1], [2, 3]]  # TP fastest, then CP: TP x CP is one contiguous block
    assert cp[:2] == [[0, 2], [1, 3]] and dpg[:2] == [[0, 4], [1, 5]]
    assert dpcp[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]] and pp[0] == [0, 8]
    assert mp[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]  # TP x PP: CP ranks are not in it
    for groups in (tp, dpg, pp, cp, dpcp):  # each kind of group covers every rank once
        assert sorted(r for g in groups for r in g) == list(range(16))


def _groups_worker(rank, world_size):
    ps = initialize_model_parallel(1, 1, context_parallel_size=2, backend="gloo", device="cpu")
    assert (ps.tp_size, ps.cp_size, ps.dp_size, ps.dp_cp_size) == (1, 2, 2, 4)
    assert (ps.cp_rank, ps.dp_rank, ps.cp_ranks) == (rank % 2, rank // 2, [rank // 2 * 2,
                                                                            rank // 2 * 2 + 1])
    for group, ranks in ((ps.cp_group, ps.cp_ranks), (ps.dp_cp_group, ps.dp_cp_ranks),
                         (ps.dp_group, ps.dp_ranks)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks)
    assert ps.dp_cp_rank == ps.dp_cp_ranks.index(rank)
    return ps.describe()


def test_cp_and_dp_cp_groups_from_torchrun_environment():
    out = run_distributed(_groups_worker, 4)
    assert out[3] == "rank 3/4: tp 0/1 cp 1/2 dp 1/2 pp 0/1"


# ------------------------------------------------------------------------------------------------
# pretrain.py under CP equals one process (docs/design.md, contract 5)
# ------------------------------------------------------------------------------------------------
# 8 steps, evaluated and saved at the half: enough for the losses to move, short enough that
# the last-bit differences of a layout's reduction order stay far below 1e-5 on any CPU
ITERS = 8
HALF = ITERS // 2
SEQ = ["--seq-length", "64", "--global-batch-size", "4"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2"]
CP2 = ["--context-parallel-size", "2"]
# name -> (world size, model flags, layout flags); the one-process reference runs the model flags
CASES = {
    "cp2_p2p": (2, [], CP2),
    "cp2_allgather": (2, [], CP2 + ["--cp-comm-type", "allgather"]),
    "cp2_a2a": (2, [], CP2 + ["--cp-comm-type", "a2a"]),
    "cp2_full_recompute": (2, [], CP2 + ["--recompute-granularity", "full"]),
    "cp2_selective_recompute": (2, [], CP2 + ["--recompute-granularity", "selective"]),
    "llama_gqa_cp2_p2p": (2, LLAMA, CP2),
    "llama_gqa_cp2_a2a": (2, LLAMA, CP2 + ["--cp-comm-type", "a2a"]),
    # the exact math blocks instead of the fused kernel (docs/context_parallel.md, "Kernels")
    "llama_gqa_cp2_allgather_math": (2, LLAMA, CP2 + ["--cp-comm-type", "allgather",
                                                      "--cp-attention-kernel", "math"]),
    # a window of 8 of 64 tokens on every layer (the blocked kernel, W < s/2)
    "llama_window_cp2_a2a": (2, LLAMA + ["--sliding-window", "8"], CP2 + ["--cp-comm-type", "a2a"]),
    "cp4_p2p": (4, [], ["--context-parallel-size", "4"]),
    "tp2_sp_cp2": (4, [], CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2_pp2": (4, [], CP2 + ["--pipeline-model-parallel-size", "2"]),
    "cp2_dp2_zero1": (4, [], CP2 + ["--zero-stage", "1"]),
    "cp2_dp2_zero3": (4, [], CP2 + ["--zero-stage", "3"]),
}


def _argv(model, layout, metrics, **kw):
    from pretrain_utils import flags

    kw.setdefault("train_iters", ITERS)
    return flags(*SEQ, *model, *layout, eval_interval=HALF, metrics_file=metrics, **kw)


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    from pretrain_utils import pretrain_cases, run_main, single_process_refs

    d = tmp_path_factory.mktemp("cp")
    # a ZeRO-1 checkpoint saved at CP2 (its shards over DP x CP = 2) resumes at CP4 (4 shards)
    # and at CP1 (one process, 1 shard) with no conversion: the model file is CP-independent
    zero1 = ["--zero-stage", "1"]
    save = _argv([], CP2 + zero1, d / "save.jsonl", exit_interval=HALF, save=d / "ck")
    cp4 = _argv([], ["--context-parallel-size", "4"] + zero1, d / "resume_cp4.jsonl",
                load=d / "ck")
    for world in (2, 4):
        runs = [_argv(model, layout, d / f"{name}.jsonl")
                for name, (w, model, layout) in CASES.items() if w == world]
        runs += [save] if world == 2 else [cp4]
        assert all(run_distributed(pretrain_cases, world, runs, timeout=600))
    assert run_main(_argv([], zero1, d / "resume_cp1.jsonl", load=d / "ck")) == 0
    refs = single_process_refs((m for _w, m, _l in CASES.values()),
                               lambda m, out: _argv(m, [], out), d)
    return d, refs


def _compare(name, ref, got, keys):
    assert [r["iteration"] for r in got] == [r["iteration"] for r in ref]
    for a, b in zip(ref, got):
        for key in keys:
            rel = abs(b[key] - a[key]) / abs(a[key])
            assert rel <= 1e-5, f"{name} iteration {a['iteration']} {key}: {b[key]} vs one " \
                                f"process {a[key]} (rel {rel:.2e})"


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matches_one_process(cp_runs, name):
    from pretrain_utils import read_metrics

    d, refs = cp_runs
    ref, got = read_metrics(refs[tuple(CASES[name][1])]), read_metrics(d / f"{name}.jsonl")
    assert [r["iteration"] for r in ref] == list(range(1, ITERS + 1))
    _compare(name, ref, got, ("lm_loss", "grad_norm"))
    assert len({round(r["lm_loss"], 4) for r in ref}) >= ITERS - 1  # the losses do move
    # evaluation runs under CP as training does: the validation losses at the half and the end
    ref_v = read_metrics(refs[tuple(CASES[name][1])], "valid")
    got_v = read_metrics(d / f"{name}.jsonl", "valid")
    assert [r["iteration"] for r in ref_v] == [HALF, ITERS]
    _compare(name, ref_v, got_v, ("lm_loss",))


def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(cp_runs):
    from pretrain_utils import read_metrics

    d, refs = cp_runs
    ref = read_metrics(refs[()])
    _compare("save at cp2", ref[:HALF], read_metrics(d / "save.jsonl"), ("lm_loss",))
    shard = sorted(p.name for p in (d / "ck" / f"iter_{HALF:07d}" / "mp_rank_00_000").iterdir())
    assert shard == ["distrib_optim_dp000.pt", "distrib_optim_dp001.pt", "model_optim_rng.pt"]
    for where in ("resume_cp1", "resume_cp4"):
        _compare(where, ref[HALF:], read_metrics(d / f"{where}.jsonl"), ("lm_loss", "grad_norm"))


# ------------------------------------------------------------------------------------------------
# The planner (docs/planner.md): CP divides activations, shards ZeRO over DP x CP, and wins at 128k
# ------------------------------------------------------------------------------------------------
def _llama8b(seq):
    from megalite.config import ModelConfig
    from megalite.planner import Model

    return Model.from_config(ModelConfig(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, seq_length=seq, vocab_size=128256, position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, untie_embeddings_and_output_weights=True,
        params_dtype="bfloat16"))


def test_planner_divides_activations_by_cp_and_picks_cp_at_128k():
    from megalite.planner import GPUS, Cluster, Layout, memory, step_time
    from tools.plan import plan, short

    m, cl = _llama8b(131072), Cluster(64, 8, GPUS["H100-80GB"])
    lay = dict(tensor_model_parallel_size=8, data_parallel_size=8, zero_stage=1,
               sequence_parallel=True, recompute_granularity="selective")
    one = memory(m, Layout(**lay), 64)
    for c, kind in ((2, "p2p"), (4, "allgather"), (8, "a2a")):
        cp = memory(m, Layout(**dict(lay, data_parallel_size=8 // c), context_parallel_size=c,
                              cp_comm_type=kind), 64)
        assert cp["optimizer"] == pytest.approx(one["optimizer"])  # ZeRO over DP x CP = 8
        assert one["activations"] / c <= cp["activations"] < 1.15 * one["activations"] / c
        t = step_time(m, Layout(**dict(lay, data_parallel_size=8 // c), context_parallel_size=c,
                                cp_comm_type=kind), cl, 64)
        assert t["cp_comm_s"] > 0 or kind == "p2p"  # the ring hides its transfer at 128k
    # at 128k tokens the fastest layout that fits splits the sequence (TP 8, micro-batch 1 pinned
    # to keep the search short); without CP, only slower ones fit (full recompute, deep PP)
    pin = {"tensor_model_parallel_size": 8, "micro_batch_size": 1}
    best, no_cp = plan(m, cl, 64, pin)[0], plan(m, cl, 64, dict(pin, context_parallel_size=1))[0]
    assert best.fits and best.layout.context_parallel_size > 1, short(best.layout)
    assert best.time["step_time_s"] < no_cp.time["step_time_s"], short(no_cp.layout)
