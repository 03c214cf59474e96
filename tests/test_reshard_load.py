"""Resharding on load (docs/checkpoints.md, "Resharding on load"): ``--load`` of a checkpoint
saved at another TP / PP / virtual-stage / CP / ZeRO layout resumes directly, each rank
assembling its own files, with the next losses of resharding offline (``convert.py reshard``)
and then loading: same weights, optimizer state, scheduler and data position.

One spawn per world size runs every case of that size in the same processes (strict mode: a
collective on a tensor its group cannot carry on NCCL fails), the sources saved once and shared
between the cases that start from them.
"""

import os

import pytest

from dist_utils import run_distributed
from pretrain_utils import flags, train_in_worker

from megalite.checkpoint.layout import Layout

ITERS, SAVE_AT = 5, 3
BASE = flags("--num-layers", 4, train_iters=ITERS)
TP = "--tensor-model-parallel-size"
PP = "--pipeline-model-parallel-size"
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]

# name: (source flags, [(target name, target flags, offline Layout, reshard options)])
WORLD4 = {
    "tp2pp2_zero1": (BASE + [TP, 2, PP, 2, "--zero-stage", 1], [
        ("tp1pp4_zero1", BASE + [PP, 4, "--zero-stage", 1], Layout(1, 4),
         dict(data_parallel_size=1)),
    ]),
}
WORLD2 = {
    "tp1pp2_vpp2": (BASE + [PP, 2, "--num-layers-per-virtual-pipeline-stage", 1], [
        ("tp2pp1", BASE + [TP, 2], Layout(2, 1), {}),
    ]),
    "dp2_zero3": (BASE + ["--zero-stage", 3], [
        ("tp2_zero1", BASE + [TP, 2, "--zero-stage", 1], Layout(2, 1),
         dict(data_parallel_size=1, zero_stage=1)),
    ]),
    "cp2tp1": (BASE + ["--context-parallel-size", 2], [
        ("cp1tp2", BASE + [TP, 2], Layout(2, 1), {}),
        # ZeRO 0 -> ZeRO 1 at another TP
        ("tp2_zero1", BASE + [TP, 2, "--zero-stage", 1], Layout(2, 1),
         dict(data_parallel_size=1, zero_stage=1)),
    ]),
    # experts: EP 2 -> EP 1 at TP 2 (the model file holds every expert, any EP)
    "moe_ep2": (BASE + MOE + ["--expert-model-parallel-size", 2], [
        ("moe_ep1tp2", BASE + MOE + [TP, 2, "--sequence-parallel", "--expert-tensor-parallel-size", 1], Layout(2, 1), {}),
        # a ZeRO optimizer whose expert shards sit apart (EP 2 over the TP pair) at another TP
        ("moe_ep2tp2_zero1", BASE + MOE + [TP, 2, "--sequence-parallel",
                                           "--expert-model-parallel-size", 2,
                                           "--expert-tensor-parallel-size", 1, "--zero-stage", 1],
         Layout(2, 1), dict(data_parallel_size=1, zero_stage=1)),
    ]),
}


def _cases(rank, world, root, cases):
    """Every case of one world size: save each source, reshard it offline (rank 0), then resume
    from the source itself and from the offline copy."""
    import strict_collectives

    from megalite import collectives as C
    from megalite.checkpoint import convert as ct

    strict_collectives.enable()

    run = train_in_worker
    got = {}
    for name, (src, targets) in cases.items():
        ck = os.path.join(root, name)
        run(src + ["--exit-interval", SAVE_AT, "--save", ck])
        for tname, argv, layout, kw in targets:
            offline = os.path.join(root, f"{name}-{tname}")
            if rank == 0:
                ct.reshard(ck, offline, layout, **kw)
            C.barrier()
            got[name, tname] = (run(argv + ["--load", ck]), run(argv + ["--load", offline]))
    return got


def _check(got):
    for (name, tname), ((direct, log), (ref, ref_log)) in got.items():
        case = f"{name} -> {tname}"
        assert sorted(direct) == sorted(ref) == list(range(SAVE_AT + 1, ITERS + 1)), case
        for it in ref:
            assert abs(direct[it] - ref[it]) <= 1e-5 * abs(ref[it]), (case, it, direct, ref)
        lines = [ln for ln in log.splitlines() if "resharded on load" in ln]
        assert len(lines) == 1 and "RNG re-seeded" in lines[0], (case, log[-2000:])
        assert "resharded on load" not in ref_log, case


@pytest.mark.parametrize("world,cases", [(4, WORLD4), (2, WORLD2)], ids=["world4", "world2"])
def test_load_at_another_layout_equals_offline_reshard(tmp_path, world, cases):
    _check(run_distributed(_cases, world, str(tmp_path), cases, timeout=400)[0])
