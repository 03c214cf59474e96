"""Expert biases with the experts split over ETP ranks (docs/moe.md, "Expert biases under ETP"):
fc1's bias split with its columns, fc2's whole on every ETP rank and added once to the partial
sums. A GPT-2-shaped MoE (biases, learned positions, LayerNorm, gelu) and a SwiGLU one at TP2 +
SP + EP2 with the default ETP (= TP = 2) equal one process: every parameter's gradient from
non-zero biases (1e-5), and pretrain's losses and grad norms over 4 steps (the alltoall
dispatcher with ZeRO-3, the allgather one with ZeRO-1); a checkpoint saved there resumes at ETP 1
x EP 4 with the losses of the run that never stopped. One spawn of 4 ranks, in strict mode."""

import os

import torch

from dist_utils import run_distributed
from model_utils import VOCAB, assert_grads_close, gather_full_tensor, tiny_config
from pretrain_utils import assert_same_run, flags, read_metrics, run_main

ITERS, SAVE_AT = 4, 2
MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 24,
       "--moe-aux-loss-coeff", 0.01]
SWIGLU = ["--swiglu"]  # (biases on: GPT-2's default)
TP2_SP_EP2 = ["--tensor-model-parallel-size", 2, "--sequence-parallel",
              "--expert-model-parallel-size", 2]  # ETP unset: = TP
# name: (model flags, layout flags); the model flags alone are the one-process run
RUNS = {
    "gpt2_zero3": ([], TP2_SP_EP2 + ["--zero-stage", 3]),
    "swiglu_allgather_zero1": (SWIGLU, TP2_SP_EP2 + [
        "--moe-token-dispatcher-type", "allgather", "--zero-stage", 1]),
}
RESUME = ["--expert-model-parallel-size", 4, "--expert-tensor-parallel-size", 1,
          "--zero-stage", 1]


def _argv(model, layout, metrics, *extra):
    return flags(*MOE, *model, *layout, *extra, train_iters=ITERS, metrics_file=metrics,
                 attention_dropout=0.0, hidden_dropout=0.0, eval_iters=0)


def _biased(model, ps):
    """Every bias drawn from its name (so not zero: a bias added twice would show), this rank's
    part of it: experts by their global index and ETP slice, dense ones by their TP shard."""
    from megalite.checkpoint.experts import experts_of
    from megalite.param_meta import param_meta
    from megalite.tensor_parallel.utils import shard_tensor

    experts = {e.key: e for e in experts_of([model])}
    for name, p in model.named_parameters():
        if not name.split(".")[-1].startswith("bias"):
            continue
        meta, e = param_meta(p), experts.get(name)
        shape = list(p.shape)
        if e is not None:
            shape[0] = e.total
        if meta.tp_split:
            shape[meta.partition_dim] *= ps.etp_size if e is not None else ps.tp_size
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        full = torch.randn(shape, generator=g) * 0.1
        if e is not None:
            full = full.narrow(0, e.first, p.shape[0])
        if meta.tp_split:
            rank, size = (ps.etp_rank, ps.etp_size) if e is not None else (ps.tp_rank, ps.tp_size)
            full = shard_tensor(full, meta.partition_dim, rank, size, meta.partition_stride)
        with torch.no_grad():
            p.copy_(full)
    return model


def _full_grads(model, ps):
    from megalite.checkpoint.experts import experts_of, gather_whole

    experts = {e.key: e for e in experts_of([model])}
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        e = experts.get(name)
        out[name] = gather_whole(g, e, ps) if e else gather_full_tensor(g, p, ps.tp_group)
        if "word_embeddings" in name or "output_layer" in name:
            out[name] = out[name][:VOCAB]
    return out


def _grads_equal_one_process(rank, swiglu):
    """Each DP rank its own two sequences: the summed gradients (SUM over DP, the experts'
    through the all-to-all) equal one process's of the sum of both ranks' mean losses."""
    from megalite.distributed.finalize_model_grads import finalize_model_grads
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState, initialize_model_parallel

    cfg = tiny_config("gpt2", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                      moe_aux_loss_coeff=0.01, swiglu=swiglu)
    ids = torch.randint(0, VOCAB, (2, 2, 17), generator=torch.Generator().manual_seed(5))
    ref_ps = ParallelState()
    ref = _biased(GPTModel(cfg, ref_ps, seed=7), ref_ps)
    sum(ref(b[:, :-1], labels=b[:, 1:]).mean() for b in ids).backward()
    ps = initialize_model_parallel(2, 1, expert_model_parallel_size=2, backend="gloo",
                                   device="cpu", set_default=False)
    assert (ps.etp_size, ps.ep_size, ps.dp_size) == (2, 2, 2)
    model = _biased(GPTModel(cfg, ps, seed=7, sequence_parallel=True), ps)
    mine = ids[ps.dp_rank]
    model(mine[:, :-1], labels=mine[:, 1:]).mean().backward()
    finalize_model_grads(model, ps)
    got, want = _full_grads(model, ps), _full_grads(ref, ref_ps)
    assert_grads_close(got, want, 1e-5, f"rank {rank} swiglu={swiglu}")
    return sorted(n for n in got if "bias" in n and "mlp" in n)


def _worker(rank, world, root):
    import strict_collectives

    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    strict_collectives.enable()
    names = [_grads_equal_one_process(rank, swiglu) for swiglu in (False, True)]
    for name, (model, layout) in RUNS.items():
        extra = ["--save", os.path.join(root, "ck"), "--save-interval", SAVE_AT] \
            if name == "gpt2_zero3" else []
        pretrain(parse_args(_argv(model, layout, os.path.join(root, f"{name}.jsonl"), *extra)))
        C.barrier()
    if rank == 0:  # resume from step 2 of the run that went on to 4
        with open(os.path.join(root, "ck", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(SAVE_AT))
    C.barrier()
    pretrain(parse_args(_argv([], RESUME, os.path.join(root, "resumed.jsonl"), "--load",
                              os.path.join(root, "ck"))))
    return names


def test_expert_biases_under_etp_equal_one_process(tmp_path):
    root = str(tmp_path)
    names = run_distributed(_worker, 4, root, timeout=400)[0]
    for biases in names:  # both expert biases were among the gradients compared
        assert "layers.0.mlp.bias1" in biases and "layers.0.mlp.bias2" in biases
    for name, (model, _) in RUNS.items():
        ref = tmp_path / f"one_{name}.jsonl"
        assert run_main(_argv(model, [], ref)) == 0
        ref, got = read_metrics(ref), read_metrics(tmp_path / f"{name}.jsonl")
        assert_same_run(ref, got, ITERS, name=name)
        assert len({round(r["lm_loss"], 4) for r in ref}) == ITERS  # the losses do move
        if name == "gpt2_zero3":  # resumed from step 2 at ETP 1 x EP 4: steps 3 and 4 as unbroken
            resumed = read_metrics(tmp_path / "resumed.jsonl")
            assert [r["iteration"] for r in resumed] == list(range(SAVE_AT + 1, ITERS + 1))
            for a, b in zip(got[SAVE_AT:], resumed):
                assert abs(b["lm_loss"] - a["lm_loss"]) <= 1e-5 * abs(a["lm_loss"]), (a, b)
