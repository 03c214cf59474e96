"""Checkpoints of MoE models under expert parallelism (docs/checkpoints.md, "Experts"): experts are
stored by global index, so a save at one EP size resumes at another with the losses of the run
that never stopped (fp32, within 1e-5), the optimizer's expert moments and the loss-free
balancing bias included; so do ZeRO 1-3 checkpoints, whose per-DP-rank files shard the experts
over the expert-data-parallel group, at another EP size, ZeRO stage and, through
tools/checkpoint/convert.py reshard, another TP x PP layout. Every multi-rank run is in strict
mode."""

import json
import os
import shutil

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import flags, read_metrics, run_main

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--num-layers", "2",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.01"]
ITERS, SAVED = 6, 3


def _argv(ep, metrics, *extra):
    return [str(a) for a in flags(*MOE, "--expert-model-parallel-size", ep, *extra,
                                  train_iters=ITERS, metrics_file=metrics,
                                  attention_dropout=0.0, hidden_dropout=0.0)]


def _runs_worker(rank, world_size, runs, fail=None):
    """Each run in turn; then ``fail``, if given: pretrain.py's main with rank 1 unable to
    allocate the expert gathers of its save, returning (exit code, stderr)."""
    import contextlib
    import io

    import strict_collectives

    from megalite.checkpoint import save as ckpt_save
    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    strict_collectives.enable()
    for argv in runs:
        if callable(argv):  # a step between runs (copy, reshard): rank 0 does it, all wait
            if rank == 0:
                argv()
        else:
            pretrain(parse_args(argv))
        C.barrier()
    if fail is None:
        return True

    def hook(stage, path):
        if stage == "before_expert_gather" and rank == 1:
            raise RuntimeError("out of memory allocating the expert gather")

    ckpt_save.fault_hook, err = hook, io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(fail)
    return rc, err.getvalue()


def _losses(path):
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path)}


class _KeepIteration:
    """``src``'s iteration ``it`` alone, as a checkpoint directory ``dst`` (a run that saved at 3
    and went on to 6 is also the run a resume from 3 must continue)."""

    def __init__(self, src, dst, it):
        self.src, self.dst, self.it = src, dst, it

    def __call__(self):
        name = f"iter_{self.it:07d}"
        shutil.copytree(self.src / name, self.dst / name)
        (self.dst / "latest_checkpointed_iteration.txt").write_text(str(self.it))


class _Reshard:
    def __init__(self, src, dst, tp, pp, it, **kw):
        self.args, self.kw = (str(src), str(dst), tp, pp, it), kw

    def __call__(self):
        from megalite.checkpoint import convert as ct
        from megalite.checkpoint.layout import Layout

        src, dst, tp, pp, it = self.args
        ct.reshard(src, dst, Layout(tp, pp), iteration=it, **self.kw)


NO_BIAS = ["--disable-bias-linear"]
ETP2 = NO_BIAS + ["--tensor-model-parallel-size", 2, "--sequence-parallel"]  # ETP = TP
ETP1 = ["--expert-tensor-parallel-size", 1]
TP2_PP2 = ["--tensor-model-parallel-size", 2, "--sequence-parallel",
           "--expert-tensor-parallel-size", 1, "--pipeline-model-parallel-size", 2]
ZERO_CASES = {  # name: (EP, flags) of runs that continue the EP 2 x EDP 2 ZeRO-1 run
    "ep4_zero1": (4, ["--zero-stage", 1]),  # EDP 2 -> 1: expert shards merged, re-split
    "ep1_zero2": (1, ["--zero-stage", 2]),  # experts back with the dense ones, another stage
    "tp2pp2_zero1": (2, TP2_PP2 + ["--zero-stage", 1]),  # resharded offline, to iteration 4
    "tp2pp2_zero3": (2, TP2_PP2 + ["--zero-stage", 3]),  # from 4: EP shards span TP ranks
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ck")
    ep2, ep1 = d / "ck_ep2", d / "ck_ep1"
    save = ["--save", None, "--save-interval", SAVED, "--exit-interval", SAVED]
    save[1] = ep1
    assert run_main(_argv(1, d / "save_ep1.jsonl", *save)) == 0  # a save at EP 1 ...
    save[1] = ep2
    fails = run_distributed(_runs_worker, 2, [
        _argv(2, d / "whole_ep2.jsonl"),  # the run that never stops
        _argv(2, d / "save_ep2.jsonl", *save),
        _argv(2, d / "ep2_from_ep2.jsonl", "--load", ep2),
        _argv(2, d / "ep2_from_ep1.jsonl", "--load", ep1),  # ... resumed at EP 2
        # experts sliced over ETP (= TP 2, the default; no linear biases) save whole experts:
        # resumed at ETP 1 on the same TP, and split over EP 2 instead, ZeRO 0 and ZeRO 1
        _argv(1, d / "save_etp2.jsonl", *ETP2, "--save", d / "ck_etp2", *save[2:]),
        _argv(1, d / "etp1_from_etp2.jsonl", *ETP2, *ETP1, "--load", d / "ck_etp2"),
        _argv(2, d / "ep2_from_etp2.jsonl", *ETP2, *ETP1, "--load", d / "ck_etp2"),
        _argv(1, d / "save_etp2_zero1.jsonl", *ETP2, "--zero-stage", 1, "--save",
              d / "ck_etp2_zero1", *save[2:]),
        _argv(2, d / "ep2_zero1_from_etp2_zero1.jsonl", *ETP2, *ETP1, "--zero-stage", 1,
              "--load", d / "ck_etp2_zero1"),
    ], _argv(2, d / "fail.jsonl", "--save", d / "ck_fail", "--exit-interval", 1), timeout=300)
    (d / "fails.json").write_text(json.dumps(fails))
    assert run_main(_argv(1, d / "ep1_from_ep2.jsonl", "--load", ep2)) == 0
    assert run_main(_argv(1, d / "whole_no_bias.jsonl", *NO_BIAS)) == 0
    # PP 2 with a dense first stage: its ranks hold no expert, yet agree with those that gather
    pp = ["--pipeline-model-parallel-size", 2, "--moe-layer-freq", "[0,1]"]
    save[1] = d / "ck_pp2"
    z, at6 = d / "ck_zero1", ["--save-interval", SAVED]  # (and at the end: iteration 6)

    def zero(name, load, *extra):
        ep, f = ZERO_CASES[name]
        return _argv(ep, d / f"{name}.jsonl", *f, "--load", load, *extra)

    assert all(run_distributed(_runs_worker, 4, [
        _argv(4, d / "ep4_from_ep2.jsonl", "--load", ep2),
        _argv(2, d / "save_pp2.jsonl", *pp, *save),
        _argv(1, d / "pp2_from_pp2.jsonl", *pp, "--load", save[1]),  # EP 2 -> EP 1 at PP 2
        _argv(2, d / "whole_zero1.jsonl", "--zero-stage", 1, "--save", z, *at6),
        _KeepIteration(z, d / "ck_zero1_at3", SAVED),
        zero("ep4_zero1", d / "ck_zero1_at3", "--save", d / "ck_ep4_zero1", *at6),
        zero("ep1_zero2", d / "ck_zero1_at3", "--save", d / "ck_ep1_zero2", *at6),
        _Reshard(z, d / "ck_zero1_tp2pp2", 2, 2, SAVED, data_parallel_size=1),
        zero("tp2pp2_zero1", d / "ck_zero1_tp2pp2", "--save", d / "ck_tp2pp2",
             "--exit-interval", SAVED + 1),
        zero("tp2pp2_zero3", d / "ck_tp2pp2", "--save", d / "ck_tp2pp2", *at6),
        _Reshard(d / "ck_tp2pp2", d / "ck_tp2pp2_tp1", 1, 1, ITERS, zero_stage=1),
    ], timeout=400))
    assert run_main(_argv(1, d / "whole_pp2.jsonl", "--moe-layer-freq", "[0,1]")) == 0
    return d


@pytest.mark.parametrize("name", ["ep2_from_ep2", "ep1_from_ep2", "ep4_from_ep2",
                                  "ep2_from_ep1", "pp2_from_pp2"])
def test_resume_at_another_ep_continues_the_run(runs, name):
    whole = _losses(runs / ("whole_pp2.jsonl" if name == "pp2_from_pp2" else "whole_ep2.jsonl"))
    saved = _losses(runs / f"save_{name.split('_from_')[1]}.jsonl")
    got = _losses(runs / f"{name}.jsonl")
    assert sorted(saved) == list(range(1, SAVED + 1))
    assert sorted(got) == list(range(SAVED + 1, ITERS + 1))
    assert len({round(v, 4) for v in whole.values()}) >= ITERS - 1  # the losses do move
    for it in range(1, ITERS + 1):
        v = saved[it] if it <= SAVED else got[it]
        rel = abs(v - whole[it]) / abs(whole[it])
        assert rel <= 1e-5, f"{name} iteration {it}: {v} vs uninterrupted {whole[it]} ({rel:.1e})"


@pytest.mark.parametrize("saved,resumed", [("etp2", "etp1_from_etp2"),
                                           ("etp2", "ep2_from_etp2"),
                                           ("etp2_zero1", "ep2_zero1_from_etp2_zero1")])
def test_etp_checkpoint_resumes_at_another_expert_grid(runs, saved, resumed):
    """Experts sliced over ETP 2 (TP 2) are saved whole (ZeRO 0: gathered into the model and
    optimizer files; ZeRO 1: the per-rank shards merged by the slices' partition dims): they
    resume at ETP 1, replicated or split over EP 2, with the uninterrupted run's losses."""
    whole = _losses(runs / "whole_no_bias.jsonl")
    got = {**_losses(runs / f"save_{saved}.jsonl"), **_losses(runs / f"{resumed}.jsonl")}
    assert sorted(got) == list(range(1, ITERS + 1))
    for it, v in got.items():
        assert abs(v - whole[it]) <= 1e-5 * abs(whole[it]), (resumed, it, v, whole[it])


def test_ep2_checkpoint_stores_every_expert_by_global_index(runs):
    """The model file holds [E, ...] experts and the optimizer their [E, ...] moments; the bias
    moved and was saved; the files of EP 1 and EP 2 have the same keys and shapes."""
    def load(ck):
        return torch.load(runs / ck / f"iter_{SAVED:07d}" / "mp_rank_00_000" /
                          "model_optim_rng.pt", weights_only=True)

    ep2, ep1 = load("ck_ep2"), load("ck_ep1")
    model = ep2["model"]
    assert model["layers.0.mlp.weight1"].shape[0] == 4
    assert model["layers.1.mlp.weight2"].shape[0] == 4
    assert model["layers.0.mlp.expert_bias"].abs().sum() > 0
    assert {k: v.shape for k, v in model.items()} == {k: v.shape for k, v in ep1["model"].items()}
    moments = [s["exp_avg"].shape for s in ep2["optimizer"]["optimizer"]["state"].values()]
    assert moments == [s["exp_avg"].shape
                       for s in ep1["optimizer"]["optimizer"]["state"].values()]
    assert sum(m[0] == 4 and len(m) == 3 for m in moments) >= 4  # weight1/2 of both layers
    # the loss-free balancing bias after 3 steps at EP 2 is one process's (counts summed over
    # the ranks that routed other tokens, updated after each applied step)
    for layer in (0, 1):
        key = f"layers.{layer}.mlp.expert_bias"
        torch.testing.assert_close(model[key], ep1["model"][key], rtol=0, atol=1e-7)


def test_a_rank_that_cannot_gather_its_experts_stops_every_rank(runs):
    """The expert gathers are agreed on first: rank 1 failing to allocate them makes both ranks
    exit with its one-line error, not wait in a gather, and no checkpoint is left behind."""
    for rank, (rc, err) in enumerate(json.loads((runs / "fails.json").read_text())):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0 and len(lines) == 1, (rank, err)
        assert "iteration 1 failed on rank 1" in lines[0] and "out of memory" in lines[0], lines
    assert not [n for n in os.listdir(runs / "ck_fail") if n.startswith("iter_")]


# ------------------------------------------------------------------------ ZeRO 1-3 at EP > 1
def _zero_losses(runs, name):
    if name.startswith("tp2pp2"):  # to iteration 4 at ZeRO 1, on from there at ZeRO 3
        return {**_losses(runs / "tp2pp2_zero1.jsonl"), **_losses(runs / "tp2pp2_zero3.jsonl")}
    return _losses(runs / f"{name}.jsonl")


@pytest.mark.parametrize("name", ["ep4_zero1", "ep1_zero2", "tp2pp2"])
def test_zero_checkpoint_at_ep2_resumes_at_another_layout(runs, name):
    """EP 2 x EDP 2 ZeRO-1 saved at iteration 3, resumed at EP 4 ZeRO-1, at EP 1 ZeRO-2, and
    resharded to TP 2 (SP) x PP 2 ZeRO-1, saved again at 4 with its expert shards spread over
    the TP ranks and resumed from there at ZeRO-3: the losses of the run that never stopped."""
    whole, got = _losses(runs / "whole_zero1.jsonl"), _zero_losses(runs, name)
    assert sorted(got) == list(range(SAVED + 1, ITERS + 1))
    assert len({round(v, 4) for v in whole.values()}) >= ITERS - 1  # the losses do move
    for it in got:
        rel = abs(got[it] - whole[it]) / abs(whole[it])
        assert rel <= 1e-5, f"{name} iteration {it}: {got[it]} vs {whole[it]} ({rel:.1e})"


def _final_state(ck):
    """Iteration 6 of a TP 1 x PP 1 checkpoint: its model file and the optimizer state merged
    by name (experts by global index)."""
    from megalite.checkpoint.optim_state import merge_shard_state_dicts

    shard = ck / f"iter_{ITERS:07d}" / "mp_rank_00_000"
    files = sorted(shard.glob("distrib_optim_dp*.pt"))
    return (torch.load(shard / "model_optim_rng.pt", weights_only=True)["model"],
            merge_shard_state_dicts([torch.load(f, weights_only=True) for f in files])["params"])


@pytest.mark.parametrize("ck", ["ck_ep4_zero1", "ck_ep1_zero2", "ck_tp2pp2_tp1"])
def test_zero_resume_restores_experts_moments_and_bias(runs, ck):
    """After the resumed runs' last step, the MoE layers' weights (experts [E, ...] by global
    index, router), Adam moments and fp32 masters and the expert bias equal the uninterrupted
    run's (the TP 2 x PP 2 run's read back through the resharder, which merges expert shards of
    every TP rank). Only the MoE layers: the other tensors the losses cover, and one of them,
    attention's key bias, has an exact-zero gradient whose rounding noise Adam scales to a
    layout-dependent step."""
    model, optim = _final_state(runs / ck)
    ref_model, ref_optim = _final_state(runs / "ck_zero1")
    assert sorted(model) == sorted(ref_model) and sorted(optim) == sorted(ref_optim)
    assert ref_model["layers.1.mlp.expert_bias"].abs().sum() > 0  # the bias moved ...
    torch.testing.assert_close(model["layers.1.mlp.expert_bias"],  # ... and was restored
                               ref_model["layers.1.mlp.expert_bias"], rtol=0, atol=0)
    assert optim["layers.0.mlp.weight1"]["exp_avg"].shape[0] == 4  # all experts, by index
    moe = [k for k in ref_model if ".mlp." in k]
    assert len(moe) == 2 * 6  # router, weight1/2, bias1/2 and the expert bias of both layers
    for k in moe:
        torch.testing.assert_close(model[k], ref_model[k], rtol=1e-5, atol=1e-7, msg=k)
    for name in (n for n in ref_optim if ".mlp." in n):
        for kind, v in optim[name].items():
            # a master is a weight: the weights' own atol (a float32 weight near 0.02 has a
            # last bit of ~2e-9, so a master that crossed near 0 can differ by a few of them)
            torch.testing.assert_close(v, ref_optim[name][kind], rtol=1e-4,
                                       atol=1e-7 if kind == "master" else 1e-9,
                                       msg=f"{name} {kind}")


def test_zero_files_at_ep2_say_where_their_expert_shards_lie(runs):
    """Each DP rank's file flags its expert shards ([E_local, ...] over EDP) and records its
    place in the expert grid; the dense shards are over DP x CP as at EP 1."""
    shard = runs / "ck_zero1" / f"iter_{SAVED:07d}" / "mp_rank_00_000"
    sds = [torch.load(shard / f"distrib_optim_dp{d:03d}.pt", weights_only=True)
           for d in range(4)]
    assert [(sd["ep_rank"], sd["edp_rank"]) for sd in sds] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(sd["ep_size"] == 2 and sd["edp_size"] == 2 and sd["etp_size"] == 1 for sd in sds)
    for sd in sds:
        expert = [s for s in sd["shards"] if s["expert"]]
        assert expert and all(seg[4][0] == 2 for s in expert for seg in s["segments"])
        assert all("mlp.weight" not in seg[0] and "mlp.bias" not in seg[0]
                   for s in sd["shards"] if not s["expert"] for seg in s["segments"])


def test_merge_joins_expert_shards_by_their_grid_position():
    """optim_state.merge_shard_state_dicts on files as 8 ranks (TP 2 x DP 4, ETP 2 x EP 2 x EDP 2)
    would write them: every (ETP, EP) rank's EDP pieces merge, EP ranks stack by expert index,
    ETP slices join along the parameter's own partition dim (SwiGLU's stride 2); the dense
    parameter comes from this TP rank's files alone. A missing file is named, not guessed."""
    from megalite.checkpoint.optim_state import merge_shard_state_dicts
    from megalite.optimizer.optimizer import SHARD_FORMAT
    from megalite.param_meta import ParamMeta
    from megalite.tensor_parallel.utils import shard_tensor

    name, meta = "layers.0.mlp.weight1", ParamMeta(tp_split=True, partition_dim=2,
                                                   partition_stride=2, expert=True)
    full = torch.arange(4 * 3 * 8, dtype=torch.float32).view(4, 3, 8)  # [E, h, 2 f]
    dense = torch.arange(6, dtype=torch.float32) + 100  # TP rank 0's, over DP 4 (padded 8)

    def shard(flat, shape, segs_name, rank, n):  # rank's 1/n of ``flat``, as ZeRO holds it
        size = -(-flat.numel() // n)
        lo, hi = rank * size, min((rank + 1) * size, flat.numel())
        piece = torch.zeros(size)
        piece[:hi - lo] = flat[lo:hi]
        kinds = {"master": piece, "exp_avg": piece * 2, "exp_avg_sq": piece * 3}
        return {"segments": [[segs_name, 0, hi - lo, lo, list(shape)]] if hi > lo else [],
                **kinds}

    files = {}  # tp rank -> its directory's files
    for d in range(4):
        for t in range(2):
            etp, ep, edp = t, d % 2, d // 2  # rank = d * TP + t, ETP fastest in the expert grid
            local = shard_tensor(full, 2, etp, 2, 2)[2 * ep:2 * ep + 2]
            files.setdefault(t, []).append({
                "format": SHARD_FORMAT, "zero_stage": 1, "dp_size": 4, "dp_rank": d, "step": 3,
                "param_groups": [], "grad_scaler": None, "etp_size": 2, "etp_rank": etp,
                "ep_size": 2, "ep_rank": ep, "edp_size": 2, "edp_rank": edp,
                "shards": [{**shard(dense, (6,), "dense", d, 4), "expert": False},
                           {**shard(local.reshape(-1), local.shape, name, edp, 2),
                            "expert": True}]})
    stage = files[0] + files[1]
    got = merge_shard_state_dicts(files[0], stage, lambda n: meta)["params"]
    for k, scale in (("master", 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
        assert torch.equal(got[name][k], full * scale), k
        assert torch.equal(got["dense"][k], dense * scale), k
    only = merge_shard_state_dicts(files[0], stage, lambda n: meta, names=[name])["params"]
    assert sorted(only) == [name]
    with pytest.raises(ValueError, match="ETP rank 1, EP rank 0 .* ranks \\[1\\]"):
        merge_shard_state_dicts(files[0], files[0] + files[1][1:], lambda n: meta)
