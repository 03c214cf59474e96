"""ZeRO checkpoints of MoE models resharded on load into runs whose experts are sharded apart
(docs/checkpoints.md, "Resharding on load", "Experts"): saved with the expert shards on an
ETP 2 x EP 2 grid (ZeRO-1), over EP 2 x EDP 2 (ZeRO-3) or with the dense ones (TP 1, EP 1) and
resumed at another TP x PP layout whose experts sit on another grid (EP 1 x TP 2, EP 4, EP 2 x
TP 2), each rank assembles the unsharded state of its (TP, PP) rank, keeps its experts and
re-splits them: the next losses are those of the run that never stopped (fp32, 1e-5). One spawn
of 4 ranks runs every case, in strict mode."""

import os

from dist_utils import run_distributed
from pretrain_utils import flags, train_in_worker

ITERS, SAVE_AT = 6, 3
MOE = flags("--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 24,
            "--disable-bias-linear", train_iters=ITERS, attention_dropout=0.0,
            hidden_dropout=0.0)
TP2 = ["--tensor-model-parallel-size", 2, "--sequence-parallel"]
EP = "--expert-model-parallel-size"
ZERO1, ZERO3 = ["--zero-stage", 1], ["--zero-stage", 3]

# source: (flags, {target: flags}); every target changes the TP x PP cut and the expert grid
CASES = {
    "ep2_etp2_zero1": (MOE + TP2 + [EP, 2] + ZERO1, {  # ETP 2 (= TP) x EP 2 x EDP 1
        "ep1_tp2_pp2": MOE + TP2 + ["--pipeline-model-parallel-size", 2] + ZERO1,
        "ep4": MOE + [EP, 4] + ZERO1,  # TP 1: ETP 1 x EP 4
    }),
    "ep2_zero3": (MOE + [EP, 2] + ZERO3, {  # TP 1: EP 2 x EDP 2
        "ep1_tp2": MOE + TP2 + ZERO3,  # ETP 2 x EDP 2
        "ep4": MOE + TP2 + [EP, 4, "--expert-tensor-parallel-size", 1] + ZERO3,
    }),
    "ep1_zero1": (MOE + ZERO1, {  # TP 1, EP 1: the experts share the dense parameters' shards
        "ep2_tp2": MOE + TP2 + [EP, 2, "--expert-tensor-parallel-size", 1] + ZERO1,
    }),
}


def _cases(rank, world, root):
    import strict_collectives

    from megalite import collectives as C

    strict_collectives.enable()

    run = train_in_worker
    got = {}
    for name, (src, targets) in CASES.items():
        ck = os.path.join(root, name)
        got[name] = run(src + ["--save", ck, "--save-interval", SAVE_AT])[0]
        if rank == 0:  # resume from iteration 3 of the run that went on to 6
            with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(SAVE_AT))
        C.barrier()
        for tname, argv in targets.items():
            got[name, tname] = run(argv + ["--load", ck])
    return got


def test_zero_checkpoint_with_experts_apart_resumes_at_another_layout_and_grid(tmp_path):
    got = run_distributed(_cases, 4, str(tmp_path), timeout=400)[0]
    wholes = {name: got.pop(name) for name in CASES}
    for whole in wholes.values():
        assert sorted(whole) == list(range(1, ITERS + 1))
        assert len({round(v, 4) for v in whole.values()}) == ITERS  # the losses do move
    assert sorted(got) == sorted((n, t) for n, (_, ts) in CASES.items() for t in ts)
    for (name, tname), (losses, log) in got.items():
        case, whole = f"{name} -> {tname}", wholes[name]
        assert sorted(losses) == list(range(SAVE_AT + 1, ITERS + 1)), case
        for it, v in losses.items():
            assert abs(v - whole[it]) <= 1e-5 * abs(whole[it]), (case, it, v, whole[it])
        lines = [ln for ln in log.splitlines() if "resharded on load" in ln]
        assert len(lines) == 1 and "ZeRO optimizer" in lines[0], (case, log[-2000:])
