"""--torch-compile composes with the parallel layouts: each run below, with every transformer
layer compiled, reports the per-iteration losses and grad norms of one eager process (fp32).

The aot_eager backend is used: it runs the same graph capture (dynamo, AOTAutograd, and the graph
breaks at TP collectives, recompute and ZeRO hooks) as inductor but executes the captured ops
eagerly, so the comparison is tight and CPU compile time stays seconds. Inductor's own kernels
are compared with eager in tests/test_fast_paths.py.
"""

import pytest

from pretrain_utils import flags, read_metrics, run_cli, run_main

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
ITERS = 3


def _records(path):
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in read_metrics(path)}


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    path = tmp_path_factory.mktemp("eager") / "m.jsonl"
    assert run_main(flags(*LLAMA, train_iters=ITERS, metrics_file=path)) == 0
    return _records(path)


@pytest.mark.parametrize("nproc,layout", [
    # TP with sequence parallelism (collectives inside the layer: graph breaks) x pipeline
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--pipeline-model-parallel-size", "2"]),
    # ZeRO-3: parameter gathers in module hooks around the compiled forward; selective recompute
    (2, ["--zero-stage", "3", "--overlap-grad-reduce", "--recompute-granularity", "selective"]),
    # ZeRO-2 with overlapped param gathers (pre-hooks inside the compiled layer), and full
    # recompute: the compiled layer re-run inside backward
    (2, ["--zero-stage", "2", "--overlap-grad-reduce", "--overlap-param-gather",
         "--recompute-granularity", "full"]),
], ids=["tp2sp-pp2", "dp2-zero3-selective", "dp2-zero2-overlap-recompute"])
def test_compiled_layers_match_eager_in_parallel_layouts(nproc, layout, eager, tmp_path):
    path = tmp_path / "m.jsonl"
    proc = run_cli(flags(*LLAMA, *layout, "--torch-compile", "aot_eager", train_iters=ITERS,
                         metrics_file=path), nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _records(path)
    assert sorted(got) == sorted(eager) == list(range(1, ITERS + 1))
    for it, (loss, gnorm) in eager.items():
        assert abs(got[it][0] - loss) <= 1e-5 * abs(loss), (it, got[it], loss)
        assert abs(got[it][1] - gnorm) <= 1e-4 * gnorm, (it, got[it], gnorm)
    assert len({round(v[0], 6) for v in eager.values()}) == ITERS  # the losses do move
