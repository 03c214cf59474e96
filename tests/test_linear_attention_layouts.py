"""Hybrid linear attention (Gated DeltaNet layers beside gated softmax layers, Qwen3.5's shape):
every layout trains as one process does (docs/design.md, contract 5), and what the layer cannot
run is refused in one line (docs/models.md, "Hybrid linear attention")."""

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError
from tests.dist_utils import run_distributed

ITERS = 4
# layers 0 and 2 linear, 1 and 3 softmax (with PP2 each stage holds one of each)
HYBRID = ["--num-layers", "4", "--seq-length", "64", "--linear-attention-freq", "2",
          "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
          "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
          "--attention-output-gate", "--apply-layernorm-1p", "--qk-layernorm",
          "--rotary-percent", "0.5", "--position-embedding-type", "rope",
          "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--group-query-attention",
          "--num-query-groups", "2"]
MOE = HYBRID + ["--num-experts", "4", "--moe-router-topk", "2",
                "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# name -> (world size, model flags, layout flags); one process runs each model's flags
LAYOUTS = {
    "tp2_sp": (2, HYBRID, TP2_SP),
    "pp2_1f1b": (2, HYBRID, PP2),
    "pp2_dualpipev": (2, HYBRID, PP2 + ["--pipeline-schedule", "dualpipev"]),
    "cp2_a2a": (2, HYBRID, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "dp2_zero3": (2, HYBRID, ["--zero-stage", "3"]),
    "moe_ep2_tp2_sp": (4, MOE, ["--expert-model-parallel-size", "2"] + TP2_SP),
    "recompute_full": (1, HYBRID, ["--recompute-granularity", "full"]),
}


def _argv(model, layout, metrics):
    from tests.pretrain_utils import TINY

    return [*TINY, "--train-iters", str(ITERS), "--metrics-file", str(metrics), *model, *layout]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    from tests.pretrain_utils import pretrain_cases, run_main

    d = tmp_path_factory.mktemp("linear_attention")
    for world in (2, 4):
        runs = [_argv(m, layout, d / f"{name}.jsonl")
                for name, (w, m, layout) in LAYOUTS.items() if w == world]
        assert all(run_distributed(pretrain_cases, world, runs, timeout=600))
    for name, (w, m, layout) in LAYOUTS.items():
        if w == 1:
            assert run_main(_argv(m, layout, d / f"{name}.jsonl")) == 0
    refs = {}
    for model in {tuple(m) for _w, m, _l in LAYOUTS.values()}:
        refs[model] = d / f"single_{len(refs)}.jsonl"
        assert run_main(_argv(list(model), [], refs[model])) == 0
    return d, refs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_every_layout_equals_one_process(hybrid_runs, name):
    from tests.pretrain_utils import assert_same_run, read_metrics

    d, refs = hybrid_runs
    ref = read_metrics(refs[tuple(LAYOUTS[name][1])])
    assert_same_run(ref, read_metrics(d / f"{name}.jsonl"), ITERS, name=name)


@pytest.mark.parametrize("flags, needle", [
    (TP2_SP[:2] + ["--linear-num-key-heads", "3", "--linear-num-value-heads", "6"],
     "--linear-num-key-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], "--cp-comm-type p2p"),
    (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], "--cp-comm-type allgather"),
    (["--reset-attention-mask"], "--reset-attention-mask with --linear-attention-freq"),
    (["--linear-num-value-heads", "3"], "--linear-num-value-heads (3) must be a multiple"),
])
def test_what_linear_layers_cannot_run_is_refused_in_one_line(flags, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(HYBRID + flags)
    assert needle in str(e.value) and "\n" not in str(e.value)
