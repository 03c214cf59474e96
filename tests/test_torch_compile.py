"""--torch-compile composes with the parallel layouts: each run below, with every transformer
layer compiled, reports the per-iteration losses and grad norms of one eager process (fp32).

A compiled layer must be one graph (no graph breaks), at TP = 1 and at TP = 2 with its
collectives: every break is a separate graph with its own launch and Python overhead, which is
what a small model on a GPU pays for.

The aot_eager backend is used: it runs the same graph capture (dynamo, AOTAutograd) as inductor
but executes the captured ops eagerly, so the comparison is tight and CPU compile time stays seconds. Inductor's own kernels
are compared with eager in tests/test_fast_paths.py.
"""

import pytest
import torch

from megalite.config import ExecutionConfig
from megalite.models.transformer import TransformerLayer
from megalite.tensor_parallel.random import get_rng_tracker, model_parallel_seed
from model_utils import tiny_config
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
    # TP with sequence parallelism (collectives traced inside the layer's graph) x pipeline
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


@pytest.fixture
def seeded_tracker():
    """The tracked (per-TP-rank) RNG stream seeded as training.py does, restored afterwards."""
    tracker = get_rng_tracker()
    saved, cpu = tracker.get_states(), torch.get_rng_state()
    model_parallel_seed(1234, tp_rank=0)
    yield
    tracker.set_states(saved)
    torch.set_rng_state(cpu)


def _explain(family, execution=ExecutionConfig(), **overrides):
    layer = TransformerLayer(tiny_config(family, **overrides), 0, execution=execution).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(16, 2, layer.input_layernorm.weight.numel(), requires_grad=True)
    torch._dynamo.reset()
    return torch._dynamo.explain(layer._layer_forward)(x)


@pytest.mark.parametrize("family,recompute", [("gpt2", None), ("llama", None),
                                               ("llama", "selective")])
def test_tp1_layer_compiles_to_one_graph(family, recompute, seeded_tracker):
    """No dropout: nothing random is drawn, so attention does not fork the RNG state (dynamo
    cannot trace get/set_rng_state: it broke the layer into 4 graphs), and selective recompute
    uses the compiler's checkpoint (megalite's own saves RNG states: 5 graphs)."""
    ex = _explain(family, ExecutionConfig(recompute_granularity=recompute))
    assert ex.graph_break_count == 0, [str(b.reason)[:300] for b in ex.break_reasons]
    assert ex.graph_count == 1


def test_attention_dropout_breaks_only_at_the_tracked_rng_call(seeded_tracker):
    """With attention dropout the fork into the tracked stream is one opaque call, and the
    compiled layer still gives the eager layer's values and gradients (same masks)."""
    ex = _explain("llama", hidden_dropout=0.1, attention_dropout=0.1)
    assert ex.graph_break_count > 0
    assert all("_in_tracked_rng" in str(b.reason) for b in ex.break_reasons), ex.break_reasons
    out = []
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        layer = TransformerLayer(tiny_config("llama", hidden_dropout=0.1, attention_dropout=0.1),
                                 0, execution=ExecutionConfig(torch_compile=backend)).train()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(16, 2, layer.input_layernorm.weight.numel(), requires_grad=True)
        model_parallel_seed(5, tp_rank=0)
        for _ in range(2):  # the second call runs the cached graphs
            layer.zero_grad()
            x.grad = None
            y = layer(x)
            y.sum().backward()
        out.append([y.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for got, ref in zip(out[1], out[0]):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_all_layers_share_one_compiled_graph(family):
    """Every layer and every iteration runs the code compiled once (no recompilation: RoPE's
    table cache is not read inside the traced layer)."""
    from torch._dynamo.utils import counters

    from megalite.models.gpt import GPTModel
    from megalite.parallel_state import ParallelState

    torch._dynamo.reset()
    counters.clear()
    model = GPTModel(tiny_config(family, num_layers=3), ParallelState(device=torch.device("cpu")),
                     seed=7, execution=ExecutionConfig(torch_compile="eager"))
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _tp2_layer(rank, world_size):
    import torch.distributed as dist

    from megalite import collectives as C

    model_parallel_seed(1234, tp_rank=rank)
    out = {}
    for sp in (False, True):
        layer = TransformerLayer(tiny_config("llama"), 0, tp_group=dist.group.WORLD,
                                 sequence_parallel=sp).train()
        x = torch.randn(8 if sp else 16, 2, 32, requires_grad=True)
        torch._dynamo.reset()
        ex = torch._dynamo.explain(layer._layer_forward)(x)
        out[f"graphs sp={sp}"] = ex.graph_count
    grads = []  # compiled against eager at TP = 2 (SP is compared in a full run above)
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)  # both builds: the same shard on this rank
        layer = TransformerLayer(tiny_config("llama"), 0, tp_group=dist.group.WORLD,
                                 execution=ExecutionConfig(torch_compile=backend)).train()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.linspace(-1, 1, 16 * 2 * 32).view(16, 2, 32).requires_grad_()
        C.reset_bytes_sent()
        for _ in range(2):  # the second call runs the cached graph
            layer.zero_grad()
            x.grad = None
            y = layer(x)
            (y * y).sum().backward()
        out[f"bytes {backend}"] = sum(C.bytes_sent().values())
        grads.append([y.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for got, ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    return out


def test_tp2_layer_compiles_to_one_graph_with_its_collectives():
    """The f/g collectives (all-reduce; all-gather and reduce-scatter under SP) are traced into the
    layer's graph; the byte counter skips them there (a side effect would break the graph)."""
    from dist_utils import run_distributed

    for out in run_distributed(_tp2_layer, 2, timeout=300):
        assert out["graphs sp=False"] == out["graphs sp=True"] == 1, out
        assert out["bytes None"] > 0 and out["bytes aot_eager"] == 0, out


def test_moe_layer_compiles_up_to_its_experts():
    """An MoE layer: attention and the norm before the MLP are one graph; the MoE MLP runs eager
    between it and the residual (data-dependent block sizes). The compiled layer gives the eager
    layer's values and gradients."""
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01)
    layer = TransformerLayer(tiny_config("llama", **moe), 0).train()
    x = torch.randn(16, 2, layer.input_layernorm.weight.numel(), requires_grad=True)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(layer._before_mlp)(x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    out = []
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        layer = TransformerLayer(tiny_config("llama", **moe), 0,
                                 execution=ExecutionConfig(torch_compile=backend)).train()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.1)
        assert (layer._forward == layer._layer_forward) and \
            (backend is None) != hasattr(layer._before_mlp, "_torchdynamo_orig_callable")
        for _ in range(2):  # the second call runs the cached graph
            layer.zero_grad()
            x.grad = None
            y = layer(x)
            y.square().sum().backward()
        out.append([y.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for got, ref in zip(out[1], out[0]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _overlapped_gathers_compiled(rank, world_size):
    """ZeRO-2 with overlapped parameter gathers at DP 2, every layer compiled: the gathers are
    waited on outside the layers' graph, so the layers share one graph."""
    from torch._dynamo.utils import counters

    from megalite.config import OptimizerConfig
    from megalite.distributed.ddp import wrap_chunks
    from megalite.models.gpt import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(1, 1, backend="gloo", device="cpu", set_default=False)
    ocfg = OptimizerConfig(lr=1e-2, zero_stage=2, overlap_grad_reduce=True,
                           overlap_param_gather=True).validate()
    model = GPTModel(tiny_config("gpt2", num_layers=3), ps, seed=7,
                     execution=ExecutionConfig(torch_compile="eager"))
    chunks, no_sync, finalize = wrap_chunks([model], ocfg, ps)
    opt = build_optimizer(chunks, ocfg, ps)
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):  # the second and third forwards wait on gathers issued by the step
        opt.zero_grad()
        loss = chunks[0](ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        finalize()
        opt.step()
        losses.append(loss.detach())
    layers = [m for m in chunks[0].module.modules() if type(m).__name__ == "TransformerLayer"]
    hooked = [bool(m._forward_pre_hooks) for m in layers]
    inside = [n for layer in layers for n, m in layer.named_modules() if n and m._forward_pre_hooks]
    return counters["stats"]["unique_graphs"], hooked, inside, [float(x) for x in losses]


def test_overlapped_param_gathers_do_not_recompile_compiled_layers():
    from dist_utils import run_distributed

    for graphs, hooked, inside, losses in run_distributed(_overlapped_gathers_compiled, 2,
                                                          timeout=300):
        assert graphs == 1, graphs  # one graph for all three layers and every iteration
        assert hooked == [True] * 3 and inside == [], (hooked, inside)  # hooks outside graphs
        assert losses[2] < losses[0], losses  # the gathered parameters did update
