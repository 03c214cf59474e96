"""A training step reads no device value on the host; the log line reads a constant few, which do
not grow with layers, micro-batches, precision, ZeRO stage or pipeline stages (tests/host_reads.py
counts them; docs/performance.md, "A step with no host read"). MoE's dispatch at EP > 1 is the
one counted exception."""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from host_reads import count_pretrain
from pretrain_utils import flags, read_metrics

SMALL = ["--num-layers", "2", "--global-batch-size", "2"]  # 1 micro-batch of 2
FP16 = ["--fp16", "--initial-loss-scale", "1024"]  # a scale that does not overflow: steps update
# 5 iterations, a log line at 4 (and 5, the last): the steps of iterations 2-5 and the log line
# at 4, all past the first step (which builds the optimizer state)
QUIET = ["--log-interval", "4"]
MEDIUM = ["--num-layers", "4", "--global-batch-size", "8"]  # 4 micro-batches of 2
RUNS = ([*SMALL], [*MEDIUM, "--bf16"], [*MEDIUM, *FP16])  # fp32, bf16, fp16


def _windows(counts):
    """Per window: the reads of steps 2, 3 and 4 (no log line after 1-3: each must read
    nothing), then those of the log line at 4 with step 5 (a step reads nothing, so these are
    the log line's alone)."""
    return [sum(c.values()) for c in counts[1:5]], counts[4]


# The log line's reads: the one read of every step's record since the last line (losses, grad
# norms, skips, lrs, the loss scale: Trainer._drain) and the timer's synchronize.
LOG_READS = 2


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_no_host_read_between_log_lines(zero):
    """A step reads no device value, whatever the ZeRO stage, precision (fp32, bf16, fp16),
    layers or micro-batches: the skip decision, the loss scale, the LR schedule and the loss
    stay on the device until the log line, whose reads do not grow with them either."""
    for run in RUNS:
        got, where = _windows(count_pretrain(flags(*run, *QUIET, train_iters=5,
                                                   zero_stage=zero)))
        assert got == [0, 0, 0, LOG_READS], (run, got, where)


def test_no_host_read_with_optimizer_offload():
    """--optimizer-cpu-offload at ZeRO 0 and 3 (1-2 share 3's step): the host step takes the skip
    flag and the lr as copies queued with the gradients and waited for (docs/offload.md): a wait,
    not a read."""
    offload = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
    for zero in (0, 3):
        got, where = _windows(count_pretrain(flags(*SMALL, *FP16, *QUIET, *offload,
                                                   train_iters=5, zero_stage=zero)))
        assert got == [0, 0, 0, LOG_READS], (zero, got, where)


def _pp2(rank, world, runs):
    """Several runs in one world: training.pretrain for each, not pretrain.main (which destroys
    the process group it made, and one world cannot be joined twice)."""
    import pretrain_utils

    from megalite import collectives as C
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    def run(argv):
        pretrain(parse_args([str(a) for a in argv]))
        C.barrier()
        return 0

    pretrain_utils.run_main = run  # what count_pretrain calls
    return [_windows(count_pretrain(argv)) for argv in runs]


def test_no_host_read_between_log_lines_pp2(tmp_path):
    """The same per rank of a 2-stage pipeline with the per-op timeline on, fp32, bf16 and fp16
    in one world: steps 2 and 3 read nothing (--timing-log-level 1 synchronises around every op
    of the steps whose log line reports the bubble only: step 4 here)."""
    pp = ["--pipeline-model-parallel-size", "2", "--timing-log-level", "1",
          "--metrics-file", tmp_path / "metrics.jsonl"]  # traces beside it
    # a pipeline needs as many micro-batches as stages
    runs = [flags(*SMALL[:2], *pp, *QUIET, train_iters=5, global_batch_size=4)] + [
        flags(*run, *pp, *QUIET, train_iters=5) for run in RUNS[1:]]
    for rank in run_distributed(_pp2, 2, runs):
        for run, (got, where) in zip(runs, rank):
            assert got[:2] == [0, 0], (run, got, where)


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-grouped-gemm", "--moe-aux-loss-coeff", "0.01"]


def _steady(counts):
    """Iterations 3 and 4 of a 4-iteration run, each with the log line of the one before
    (--log-interval 1); the first builds optimizer state, the second measures memory."""
    return [sum(c.values()) for c in counts[2:4]], counts[3]


def _moe(rank, world, argv):
    return _steady(count_pretrain(argv))


def test_moe_reads_only_the_dispatch_split_sizes():
    """Dropless MoE reads nothing per layer or micro-batch at EP 1 (the permutation's row count
    is k per token, known on the host); the log line (--log-interval 1) adds one read of the MoE
    metrics to its own. At EP 2
    each MoE layer's dispatch reads its split sizes once per micro-batch: the one documented
    exception (docs/moe.md), exactly L x m more per iteration."""
    (small, _), (large, where) = (_steady(count_pretrain(flags(*size, *MOE, train_iters=4)))
                                  for size in (SMALL, ["--num-layers", "4",
                                                       "--global-batch-size", "8"]))
    assert small == large == [LOG_READS + 1] * 2, where
    ep2 = ["--expert-model-parallel-size", "2"]
    for layers, batch, micro in ((2, 4, 1), (4, 8, 2)):  # micro-batches of 2 per DP rank
        argv = flags("--num-layers", layers, "--global-batch-size", batch, *MOE, *ep2,
                     train_iters=4)
        for got, where in run_distributed(_moe, 2, argv):
            assert got == [LOG_READS + 1 + layers * micro] * 2, where
    # the allgather dispatcher at EP 1 (experts split over the TP pair) knows every block size:
    # no read per layer or micro-batch, as on one process
    allgather = ["--moe-token-dispatcher-type", "allgather", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--disable-bias-linear"]
    argv = flags("--num-layers", 4, "--global-batch-size", 4, "--micro-batch-size", 1, *MOE,
                 *allgather, train_iters=4)
    for got, where in run_distributed(_moe, 2, argv):
        assert got == [LOG_READS + 1] * 2, where
    # capacity padded at EP 2: every block is C rows, known on the host: no read per layer
    padded = ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0",
              "--moe-pad-expert-input-to-capacity"]
    argv = flags("--num-layers", 4, "--global-batch-size", 8, *MOE, *padded, train_iters=4)
    for got, where in run_distributed(_moe, 2, argv):
        assert got == [LOG_READS + 1] * 2, where


def _short_documents(prefix: str) -> None:
    """400 documents of 2-6 tokens, each ending with NullTokenizer's EOD (vocab 300: id 299):
    3-8 documents per sample of 16, across the CP chunk borders."""
    import numpy as np

    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for n in rng.integers(2, 7, size=400):
            b.add_document(list(rng.integers(0, 299, size=n - 1)) + [299])
        b.finalize(prefix + ".idx")


def test_no_host_read_with_packed_documents(tmp_path):
    """--reset-position-ids and --reset-attention-mask: the documents and positions come from
    the tokens on the host (numpy) and the attention of one device and the CP ring's and
    all-gather's block decisions read host values only, so steps 2-4 read nothing, on one
    process and per rank of CP2 (p2p, all-gather, all-to-all)."""
    data = str(tmp_path / "docs")
    _short_documents(data)
    docs = ["--data-path", data, "--tokenizer-type", "NullTokenizer", "--split", "100,0,0",
            "--reset-position-ids", "--reset-attention-mask"]
    argv = [f for f in flags(*SMALL, *QUIET, *docs, train_iters=5) if f != "--mock-data"]
    got, where = _windows(count_pretrain(argv + ["--metrics-file", str(tmp_path / "m.jsonl")]))
    assert got == [0, 0, 0, LOG_READS], where
    # the log line's accounting of the documents' attention comes from the same host lengths
    recs = read_metrics(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in recs] == [4, 5]
    for rec in recs:
        assert 0 < rec["document_attention_fraction"] < 0.5, rec  # documents of 2-6 of 16
        assert rec["attention_tflops_needed"] > 0, rec
    # a window under CP too: its blocks are decided on the host with the documents'
    cp2 = ["--context-parallel-size", "2", "--sliding-window", "5", "--cp-comm-type"]
    runs = [argv + cp2 + [comm] for comm in ("p2p", "allgather", "a2a")]
    for rank in run_distributed(_pp2, 2, runs):
        for run, (got, where) in zip(runs, rank):
            assert got == [0, 0, 0, LOG_READS], (run, got, where)
