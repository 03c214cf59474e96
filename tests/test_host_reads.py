"""Host reads of device values per training iteration do not grow with layers, micro-batches,
precision, ZeRO stage or pipeline stages (tests/host_reads.py counts them; docs/performance.md)."""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from host_reads import count_pretrain
from pretrain_utils import flags

SMALL = ["--num-layers", "2", "--global-batch-size", "2"]  # 1 micro-batch of 2
LARGE = ["--num-layers", "8", "--global-batch-size", "16"]  # 8 micro-batches of 2
FP16 = ["--fp16", "--initial-loss-scale", "1024"]  # a scale that does not overflow: steps update


def _steady(counts):
    """Iterations 3 and 4 of a 4-iteration run, each with the log line of the one before
    (--log-interval 1); the first builds optimizer state, the second measures memory."""
    return [sum(c.values()) for c in counts[2:4]], counts[3]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_host_reads_per_iteration_constant(zero):
    ref, _ = _steady(count_pretrain(flags(*SMALL, train_iters=4, zero_stage=zero)))
    # the step's one decision read (grad norm with the loss or the fp16 found-inf flag), one read
    # of the logged losses and the log line's synchronize (the timer's only)
    assert ref[0] == ref[1] == 3, ref
    for extra in ([], FP16):
        got, where = _steady(count_pretrain(flags(*LARGE, *extra, train_iters=4,
                                                  zero_stage=zero)))
        assert got == ref, (extra, got, ref, where)


def _pp2(rank, world, argv):
    counts = count_pretrain(argv)
    return [sum(c.values()) for c in counts[1:3]], counts[2]


@pytest.mark.parametrize("precision", [[], FP16])
def test_host_reads_per_iteration_constant_pp2(precision, tmp_path):
    """Per rank of a 2-stage pipeline with the per-op timeline on (--timing-log-level 1), at the
    iterations between log lines (2 and 3 of 4 with --log-interval 4): no loss read, no timeline
    sync, only the step's one decision read."""
    pp = ["--pipeline-model-parallel-size", "2", "--timing-log-level", "1", "--log-interval", "4",
          "--metrics-file", tmp_path / "metrics.jsonl", *precision]  # traces beside it
    # a pipeline needs as many micro-batches as stages
    small = run_distributed(_pp2, 2, flags(*SMALL[:2], *pp, train_iters=4, global_batch_size=4))
    large = run_distributed(_pp2, 2, flags(*LARGE, *pp, train_iters=4))
    assert [c for c, _ in large] == [c for c, _ in small], (small, large)
    assert all(n == 1 for c, _ in large for n in c), large


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-grouped-gemm", "--moe-aux-loss-coeff", "0.01"]


def _moe(rank, world, argv):
    return _steady(count_pretrain(argv))


def test_moe_reads_only_the_dispatch_split_sizes():
    """Dropless MoE reads nothing per layer or micro-batch at EP 1 (the permutation's row count
    is k per token, known on the host); the log line adds one read of the MoE metrics. At EP 2
    each MoE layer's dispatch reads its split sizes once per micro-batch: the one documented
    exception (docs/moe.md), exactly L x m more per iteration."""
    (small, _), (large, where) = (_steady(count_pretrain(flags(*size, *MOE, train_iters=4)))
                                  for size in (SMALL, ["--num-layers", "4",
                                                       "--global-batch-size", "8"]))
    assert small == large == [4, 4], where
    ep2 = ["--expert-model-parallel-size", "2"]
    for layers, batch, micro in ((2, 4, 1), (4, 8, 2)):  # micro-batches of 2 per DP rank
        argv = flags("--num-layers", layers, "--global-batch-size", batch, *MOE, *ep2,
                     train_iters=4)
        for got, where in run_distributed(_moe, 2, argv):
            assert got == [4 + layers * micro] * 2, where
    # the allgather dispatcher at EP 1 (experts split over the TP pair) knows every block size:
    # no read per layer or micro-batch, as on one process
    allgather = ["--moe-token-dispatcher-type", "allgather", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--disable-bias-linear"]
    argv = flags("--num-layers", 4, "--global-batch-size", 4, "--micro-batch-size", 1, *MOE,
                 *allgather, train_iters=4)
    for got, where in run_distributed(_moe, 2, argv):
        assert got == [4, 4], where
    # capacity padded at EP 2: every block is C rows, known on the host: no read per layer
    padded = ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0",
              "--moe-pad-expert-input-to-capacity"]
    argv = flags("--num-layers", 4, "--global-batch-size", 8, *MOE, *padded, train_iters=4)
    for got, where in run_distributed(_moe, 2, argv):
        assert got == [4, 4], where
