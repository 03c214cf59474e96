"""ZeRO 1-3 under expert parallelism (docs/moe.md): the expert weights' optimizer state (and,
for stage 2, gradients; for stage 3, the weights too) is sharded over the expert-data-parallel
group, the dense weights' over DP x CP. pretrain.py's losses and grad norms at EP 2 on 4 ranks (expert-DP 2) equal one process's,
6 steps in fp32, within 1e-5, in strict mode (docs/design.md, contract 1); and each rank's expert
Adam state is its 1/EDP part of its EP rank's experts, as megalite/memory.py's formula says."""

import pytest

from dist_utils import run_distributed

ITERS = 6
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--num-layers", "2",
       "--clip-grad", "0.5"]  # clipping acts: the norm is also what the step divides by
EP2 = ["--expert-model-parallel-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--expert-tensor-parallel-size", "1"]
CASES = {  # name: layout flags on 4 ranks (EP 2 x EDP 2)
    "ep2_edp2_zero1": EP2 + ["--zero-stage", "1"],
    "ep2_edp2_zero2": EP2 + ["--zero-stage", "2"],
    "ep2_edp2_zero2_overlap": EP2 + ["--zero-stage", "2", "--overlap-grad-reduce",
                                     "--overlap-param-gather", "--ddp-bucket-size", "400"],
    "ep2_edp2_zero3": EP2 + ["--zero-stage", "3"],  # expert units over EDP, prefetched
    # EP over the TP ranks (EDP 2 = DP): expert squares summed over EDP and EP, once per TP group
    "ep2_tp2_sp_zero2": EP2 + TP2_SP + ["--zero-stage", "2"],
    "ep2_tp2_sp_zero3": EP2 + TP2_SP + ["--zero-stage", "3"],
}


def _argv(layout, metrics):
    from pretrain_utils import flags

    return flags(*MOE, *layout, train_iters=ITERS, metrics_file=metrics,
                 attention_dropout=0.0, hidden_dropout=0.0)


def _shard_sizes(argv):
    """(expert params here, their padded buffers or units, expert Adam numel, dense padded, dense
    Adam numel, EDP, DP x CP, the state file's expert flags) of the optimizer pretrain builds."""
    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.data import build_tokenizer
    from megalite.optimizer import build_optimizer
    from megalite.param_meta import param_meta
    from megalite.parallel_state import initialize_model_parallel
    from megalite.pipeline_parallel.partition import build_model_chunks
    from megalite.training import wrap_model_for_data_parallel

    cfg = parse_args(argv)
    ps = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    cfg = cfg.resolve(ps.world_size, build_tokenizer(cfg.data, None, cfg.model.vocab_size).vocab_size)
    chunks, _, _ = wrap_model_for_data_parallel(
        build_model_chunks(cfg.model, ps, seed=1, device=ps.device), cfg, ps)
    opt = build_optimizer(chunks, cfg.optimizer, ps)
    # (padded, unpadded, expert) of each flat holder: DDP buffers (ZeRO 1-2) or units (ZeRO 3)
    held = [(u.padded, u.numel, u.expert) for c in chunks for u in getattr(c, "units", ())] + [
        (b.numel, b.numel_unpadded, param_meta(next(iter(b.slots))).expert)
        for c in chunks for b in getattr(c, "grad_buffers", ())]
    state = {e: sum(a.numel() + b.numel() for a, b, se in zip(
        opt.exp_avg, opt.exp_avg_sq, opt.shard_is_expert) if se == e) for e in (True, False)}
    sd = opt.state_dict()
    return (sum(n for _, n, e in held if e), sum(n for n, _, e in held if e), state[True],
            sum(n for n, _, e in held if not e), state[False], ps.edp_size,
            C.group_size(ps.dp_cp_group), sd["edp_size"], [s["expert"] for s in sd["shards"]])


def _cases_worker(rank, world_size, runs):
    import strict_collectives

    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    strict_collectives.enable()
    for argv in runs:
        pretrain(parse_args(argv))
        C.barrier()
    return [_shard_sizes(runs[0]), _shard_sizes(runs[3])]  # ZeRO 1 and 3 at DP 4


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    from pretrain_utils import run_main

    d = tmp_path_factory.mktemp("moe_zero")
    sizes = run_distributed(_cases_worker, 4, [_argv(layout, d / f"{name}.jsonl")
                                               for name, layout in CASES.items()], timeout=600)
    assert run_main(_argv([], d / "single.jsonl")) == 0
    return d, sizes


@pytest.mark.parametrize("name", list(CASES))
def test_moe_zero_matches_one_process(zero_runs, name):
    from pretrain_utils import read_metrics

    d, _ = zero_runs
    ref, got = read_metrics(d / "single.jsonl"), read_metrics(d / f"{name}.jsonl")
    assert [r["iteration"] for r in ref] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in got] == [r["iteration"] for r in ref]
    for a, b in zip(ref, got):
        for key in ("lm_loss", "grad_norm"):
            rel = abs(b[key] - a[key]) / abs(a[key])
            assert rel <= 1e-5, f"{name} iteration {a['iteration']} {key}: {b[key]} vs one " \
                                f"process {a[key]} (rel {rel:.2e})"
    assert max(r["grad_norm"] for r in ref) > 0.5  # the clipping is exercised
    # rank 0's measured model-state bytes are the formula's, experts counted with N = EDP
    mem = read_metrics(d / f"{name}.jsonl", "memory")[0]
    assert mem["mem_total_bytes"] == mem["mem_theory_total_bytes"]
    assert len({round(r["lm_loss"], 4) for r in ref}) >= ITERS - 1  # the losses do move


def test_expert_optimizer_state_is_sharded_over_expert_data_parallel(zero_runs):
    _, sizes = zero_runs
    for (expert, expert_padded, expert_state, dense_padded, dense_state, edp, dp, file_edp,
         flags) in (stage for rank in sizes for stage in rank):
        assert (edp, dp, file_edp) == (2, 4, 2)
        # this EP rank's 2 of the 4 experts, padded to the buffer alignment only
        assert 0 < expert <= expert_padded < expert + 2 * 128 * 4
        assert expert_state == 2 * expert_padded // edp  # exp_avg + exp_avg_sq, 1/EDP each
        assert dense_state == 2 * dense_padded // dp
        assert True in flags and False in flags
