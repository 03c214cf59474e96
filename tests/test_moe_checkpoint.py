"""Checkpoints of MoE models under expert parallelism (docs/checkpoints.md, "Experts"): experts are
stored by global index, so a save at one EP size resumes at another with the losses of the run
that never stopped (fp32, within 1e-5), the optimizer's expert moments and the loss-free
balancing bias included. Every multi-rank run is in strict mode."""

import json
import os

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

    from megalite import checkpointing
    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    strict_collectives.enable()
    for argv in runs:
        pretrain(parse_args(argv))
        C.barrier()
    if fail is None:
        return True

    def hook(stage, path):
        if stage == "before_expert_gather" and rank == 1:
            raise RuntimeError("out of memory allocating the expert gather")

    checkpointing.fault_hook, err = hook, io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(fail)
    return rc, err.getvalue()


def _losses(path):
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path)}


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
    ], _argv(2, d / "fail.jsonl", "--save", d / "ck_fail", "--exit-interval", 1), timeout=300)
    (d / "fails.json").write_text(json.dumps(fails))
    assert run_main(_argv(1, d / "ep1_from_ep2.jsonl", "--load", ep2)) == 0
    # PP 2 with a dense first stage: its ranks hold no expert, yet agree with those that gather
    pp = ["--pipeline-model-parallel-size", 2, "--moe-layer-freq", "[0,1]"]
    save[1] = d / "ck_pp2"
    assert all(run_distributed(_runs_worker, 4, [
        _argv(4, d / "ep4_from_ep2.jsonl", "--load", ep2),
        _argv(2, d / "save_pp2.jsonl", *pp, *save),
        _argv(1, d / "pp2_from_pp2.jsonl", *pp, "--load", save[1]),  # EP 2 -> EP 1 at PP 2
    ], timeout=300))
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


def test_a_rank_that_cannot_gather_its_experts_stops_every_rank(runs):
    """The expert gathers are agreed on first: rank 1 failing to allocate them makes both ranks
    exit with its one-line error, not wait in a gather, and no checkpoint is left behind."""
    for rank, (rc, err) in enumerate(json.loads((runs / "fails.json").read_text())):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0 and len(lines) == 1, (rank, err)
        assert "iteration 1 failed on rank 1" in lines[0] and "out of memory" in lines[0], lines
    assert not [n for n in os.listdir(runs / "ck_fail") if n.startswith("iter_")]
