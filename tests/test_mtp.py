"""Multi-token prediction (megalite/models/mtp.py, docs/models.md "Multi-token prediction"): on a
DeepSeek-V3-shaped tiny model (multi-latent attention, MoE with a dense first layer, untied
output), D = 1 and 2 equal a reference written here in plain torch (fp32, 1e-6: the main and MTP
losses and every gradient); pretrain.py at TP2 + SP, PP2 (1F1B and DualPipeV), CP2 (p2p,
zigzag), EP2 and DP2 ZeRO-3 equals one process within 1e-5 (loss, grad norm, each depth's
logged loss); a checkpoint saved at PP2 resumes at TP2 + SP exactly; a step reads nothing on the
host; bad combinations are refused in one line."""

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed

V, S, B = 100, 16, 2
DEEPSEEK = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S, vocab_size=V,
                make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, untie_embeddings_and_output_weights=True,
                norm_epsilon=1e-6, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=16,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, num_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq="[0,1]",
                ffn_hidden_size=48, moe_shared_expert_intermediate_size=24)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model, data, mask, depths: int, factor: float):
    """DeepSeek-V3's MTP written out: h^0 the main model's last hidden state, then per depth k
    h^k = layer_k(W_k [rms(Emb(t_{i+k})), rms(h^{k-1}_i)]), logits^k = rms_k(h^k) W_out^T
    predicting t_{i+1+k}; loss = main + factor / D sum_k sum_i w_{i+k} ce^k_i, w = mask / N
    (0 past the end). The transformer layers are the model's own (their parity: test_mla.py,
    test_moe_layer.py); the rest is torch."""
    p = dict(model.named_parameters())
    emb, out_w = p["embedding.word_embeddings.weight"], p["output_layer.weight"]
    tokens, labels = data[:, :-1], data[:, 1:]
    n = mask.sum()

    def head(h, norm_w, targets, weights):
        logits = _rms(h, norm_w) @ out_w.t()  # [s, b, Vp]
        ce = F.cross_entropy(logits[..., :V].reshape(-1, V), targets.t().reshape(-1),
                             reduction="none").view(S, B).t()
        return (ce * weights).sum()

    h = F.embedding(tokens, emb).transpose(0, 1)  # [s, b, h]
    for i in range(model.config.num_layers):
        h = model.layers[str(i)](h)
    main = head(h, p["final_layernorm.weight"], labels, mask / n)
    mtp = []
    for k in range(1, depths + 1):
        layer = model.mtp.layers[k - 1]
        shifted = torch.zeros_like(tokens)  # token i + k, the embedding's input at position i
        shifted[:, : S + 1 - k] = data[:, k:S + 1]
        target, weight = torch.zeros_like(labels), torch.zeros_like(mask)
        target[:, : S - k], weight[:, : S - k] = labels[:, k:], mask[:, k:] / n
        e = _rms(F.embedding(shifted, emb).transpose(0, 1), layer.enorm.weight)
        x = torch.cat([e, _rms(h, layer.hnorm.weight)], -1) @ layer.eh_proj.weight.t()
        h = layer.transformer_layer(x)
        mtp.append(head(h, layer.final_layernorm.weight, target, weight))
    return main, mtp, main + factor / depths * sum(mtp)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_equals_the_reference(depths):
    from megalite.config import ModelConfig
    from megalite.models.gpt import GPTModel
    from megalite.models.mtp import mtp_targets
    from megalite.parallel_state import ParallelState

    cfg = ModelConfig(**DEEPSEEK, mtp_num_layers=depths, mtp_loss_scaling_factor=0.3)
    model = GPTModel(cfg, ParallelState(), seed=5)
    gen = torch.Generator().manual_seed(depths)
    data = torch.randint(0, V, (B, S + 1), generator=gen)
    mask = (torch.rand(B, S, generator=gen) > 0.2).float()
    labels = data[:, 1:]
    shifted_labels, shifted_mask = mtp_targets(labels, mask, depths)
    out = model(data[:, :-1], labels=labels, loss_weights=mask / mask.sum(),
                mtp_targets=(shifted_labels, shifted_mask / mask.sum()))
    out.loss.backward()
    got = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    main, mtp, loss = _reference(model, data, mask, depths, 0.3)
    loss.backward()
    close = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((out.token_loss * mask).sum() / mask.sum(), main.detach(), **close)
    assert sorted(out.logged) == [f"mtp_{k}_loss" for k in range(1, depths + 1)]
    for k, want in enumerate(mtp, 1):
        torch.testing.assert_close(out.logged[f"mtp_{k}_loss"], want.detach(), **close)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), **close)
    for name, q in model.named_parameters():
        assert got[name].abs().sum() > 0, name  # every part learns, MTP's included
        torch.testing.assert_close(got[name], q.grad, **close, msg=name)


def test_mtp_targets_shift_within_each_sequence():
    from megalite.models.mtp import mtp_targets

    labels = torch.arange(10).view(2, 5)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0], [1.0] * 5])
    got_labels, got_mask = mtp_targets(labels, mask, 2)
    assert got_labels[0, :, 0].tolist() == [1, 2, 3, 4, 0]
    assert got_labels[1, :, 1].tolist() == [7, 8, 9, 0, 0]
    assert got_mask[0, :, 0].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert got_mask[0, :, 1].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------- layouts
ITERS = 3
DS_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
            "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
            "--ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "24",
            "--moe-aux-loss-coeff", "0.01", "--mtp-num-layers", "2",
            "--mtp-loss-scaling-factor", "0.3"]
TWO = ["--num-layers", "2", "--moe-layer-freq", "[0,1]"]
# a V at PP 2: 4 layers, 4 micro-batches per rank
FOUR = ["--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]", "--micro-batch-size", "1"]
CASES = {  # name: (model flags, layout flags); the model flags alone are the one-process run
    "tp2_sp": (TWO, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_1f1b": (TWO, ["--pipeline-model-parallel-size", "2"]),
    "pp2_dualpipev": (FOUR, ["--pipeline-model-parallel-size", "2",
                             "--pipeline-schedule", "dualpipev"]),
    "cp2_p2p": (TWO, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "ep2": (TWO, ["--expert-model-parallel-size", "2"]),
    "dp2_zero3_recompute": (TWO, ["--zero-stage", "3", "--recompute-granularity", "full"]),
}
KEYS = ("lm_loss", "grad_norm", "mtp_1_loss", "mtp_2_loss")


def _argv(model, layout, metrics):
    from pretrain_utils import flags

    return flags(*DS_FLAGS, *model, *layout, train_iters=ITERS, metrics_file=metrics,
                 eval_iters=0)


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory):
    from pretrain_utils import pretrain_cases, single_process_refs

    d = tmp_path_factory.mktemp("mtp")
    runs = [_argv(model, layout, d / f"{name}.jsonl") for name, (model, layout) in CASES.items()]
    # the MTP weights through a checkpoint: saved at PP2 after 2 steps, resumed at TP2 + SP
    save = _argv(TWO, ["--pipeline-model-parallel-size", "2", "--save", d / "ck"],
                 d / "saved.jsonl")
    save[save.index("--train-iters") + 1] = "2"
    runs += [save, _argv(TWO, ["--load", d / "ck", *CASES["tp2_sp"][1]], d / "resumed.jsonl")]
    assert all(run_distributed(pretrain_cases, 2, runs, timeout=600))
    refs = single_process_refs((m for m, _ in CASES.values()), lambda m, out: _argv(m, [], out), d)
    return d, refs


@pytest.mark.parametrize("name", list(CASES))
def test_mtp_layout_matches_one_process(mtp_runs, name):
    from pretrain_utils import assert_same_run, read_metrics

    d, refs = mtp_runs
    ref = read_metrics(refs[tuple(CASES[name][0])])
    assert_same_run(ref, read_metrics(d / f"{name}.jsonl"), ITERS, KEYS, name=name)
    assert len({round(r["mtp_2_loss"], 4) for r in ref}) == ITERS  # the MTP losses move


def test_mtp_weights_resume_from_a_checkpoint_at_another_layout(mtp_runs):
    """Iteration 3 after the load equals the uninterrupted one-process run's (the load's own
    probe check passed too: docs/checkpoints.md)."""
    from pretrain_utils import read_metrics

    d, refs = mtp_runs
    ref = read_metrics(refs[tuple(TWO)])
    got = read_metrics(d / "resumed.jsonl")
    assert [r["iteration"] for r in got] == [3]
    for key in KEYS:
        assert abs(got[0][key] - ref[2][key]) <= 1e-5 * abs(ref[2][key]), key


def test_mtp_refusals():
    from megalite.arguments import parse_args
    from megalite.config import ConfigError
    from pretrain_utils import flags

    with pytest.raises(ConfigError, match="--mtp-num-layers with --pipeline-model-parallel-size"):
        parse_args(flags("--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"))
    with pytest.raises(ConfigError, match="--mtp-num-layers must be a positive integer"):
        parse_args(flags("--mtp-num-layers", "0"))


def test_mtp_reads_nothing_on_the_host_between_log_lines():
    """The depths' losses stay on the device until the log line, as the main loss does
    (tests/test_host_reads.py's windows: steps 2-4 read nothing, the line at 4 its usual two)."""
    from host_reads import count_pretrain
    from pretrain_utils import flags
    from test_host_reads import LOG_READS, _windows

    run = flags("--position-embedding-type", "rope", "--mtp-num-layers", "2", "--log-interval",
                "4", "--global-batch-size", "2", train_iters=5, eval_iters=0)
    got, where = _windows(count_pretrain(run))
    assert got == [0, 0, 0, LOG_READS], (got, where)
