"""The Mixture-of-Experts settings: flags, the layer pattern, parameter counts and every check
(docs/moe.md, "Flags")."""

from dataclasses import fields

import pytest

from megalite.arguments import parse_args
from megalite.config import (
    CHECKPOINT_ARGS_FIELDS, MODEL_SHAPE_FIELDS, ConfigError, MegaliteConfig, ModelConfig,
    ParallelConfig, check_expert_grid_divisible, config_from_dict, flag_name,
    parse_moe_layer_freq)

MOE_FIELDS = [f for f in fields(ModelConfig) if f.metadata["group"] == "mixture of experts"]


def _moe(**kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                vocab_size=100, num_experts=8)
    return ModelConfig(**{**base, **kw})


def test_flags_reach_the_config_with_their_roles():
    cfg = parse_args([
        "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "4",
        "--moe-ffn-hidden-size", "64", "--moe-layer-freq", "([0]*1+[1]*3)",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
        "--moe-router-group-score", "top2_sum", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
        "--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate",
        "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1"])
    m, par = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (8, 4, 64)
    assert m.moe_layer_pattern() == [False, True, True, True] and m.is_moe_layer(1)
    assert m.moe_router_group_score == "top2_sum" and m.moe_router_topk_scaling_factor == 2.5
    assert (par.expert_model_parallel_size, par.expert_tp_size) == (2, 1)
    assert cfg.to_dict() == config_from_dict(cfg.to_dict()).to_dict()  # args.json round trip
    roles = {f.name: f.metadata["role"] for f in MOE_FIELDS}
    shape = {"num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
             "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate", "moe_router_linear_bias"}
    assert {n for n, r in roles.items() if r == "shape"} == shape <= set(MODEL_SHAPE_FIELDS)
    assert {"moe_router_topk", "moe_router_score_function", "moe_router_group_score",
            "moe_router_pre_softmax"} <= set(CHECKPOINT_ARGS_FIELDS) - set(MODEL_SHAPE_FIELDS)
    assert roles["moe_router_dtype"] == roles["moe_aux_loss_coeff"] == "run"


def test_defaults_are_dense_and_megalites_own():
    cfg = parse_args([])
    m, par = cfg.model, cfg.parallel
    assert m.num_experts is None and m.moe_ffn_hidden_size is None
    assert m.moe_layer_pattern() == [False] * m.num_layers
    assert m.num_active_parameters() == m.num_parameters()
    assert (m.moe_router_dtype, cfg.execution.moe_token_dispatcher_type) == ("fp32", "alltoall")
    assert (par.expert_model_parallel_size, par.expert_tensor_parallel_size) == (1, None)
    assert par.expert_tp_size == 1 and par.expert_data_parallel_size(8) == 8
    assert _moe(ffn_hidden_size=96).moe_ffn_hidden_size == 96  # default: --ffn-hidden-size


@pytest.mark.parametrize("text", [
    "[1,0,1,1]", "([0]*3+[1]*29)", "[0]*3+[1]*29", "([1]*2+[0])*2", "( [1, 0] * 2 )", "[1,0,]",
    "[0]+[1]*3+[0]*0", "[]"])
def test_layer_freq_lists_read_as_python_would(text):
    assert parse_moe_layer_freq(text) == eval(text)  # the test may eval; the parser never does


@pytest.mark.parametrize("text", [
    "__import__('os')", "[1,0", "[1]*", "[1]*[2]", "[[1]]", "1,0", "[1] [0]", "[-1]", "(1)",
    "[1]+", "[0x1]", ""])
def test_layer_freq_refuses_anything_else(text):
    with pytest.raises(ConfigError, match="--moe-layer-freq must be") as e:
        parse_moe_layer_freq(text)
    assert "\n" not in str(e.value)


def test_layer_pattern_int_and_list():
    # Megatron's integer form: layer i is MoE when i % N == 0
    assert _moe(num_layers=6, moe_layer_freq="2").moe_layer_pattern() == [
        i % 2 == 0 for i in range(6)]
    assert _moe(moe_layer_freq="1").moe_layer_pattern() == [True] * 4
    assert _moe(moe_layer_freq="[1,0,0,1]").moe_layer_pattern() == [True, False, False, True]
    for freq, needle in (("[1,0,1]", "--num-layers (4)"), ("[1,2,1,1]", "0 (dense) or 1"),
                         ("0", "--moe-layer-freq must be")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            _moe(moe_layer_freq=freq).validate()


@pytest.mark.parametrize("kw,needle", [
    (dict(num_experts=0), "--num-experts must be >= 1"),
    (dict(moe_router_topk=9), r"--moe-router-topk \(9\) must be between 1 and --num-experts \(8\)"),
    (dict(moe_router_topk=1), "--moe-router-pre-softmax"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1),
     r"--moe-router-num-groups \(3\) must divide --num-experts \(8\)"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5),
     r"--moe-router-group-topk \(5\) must be between 1 and --moe-router-num-groups \(4\)"),
    (dict(moe_router_group_topk=2), "needs both --moe-router-num-groups"),
    (dict(moe_router_num_groups=4), "needs both --moe-router-num-groups"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3),
     r"--moe-router-topk \(3\) exceeds the 2 experts"),
    (dict(moe_router_num_groups=8, moe_router_group_topk=2, moe_router_group_score="top2_sum"),
     "top2_sum needs at least 2 experts per group"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be positive"),
    (dict(moe_expert_capacity_factor=-1.0), "--moe-expert-capacity-factor must be positive"),
    (dict(moe_pad_expert_input_to_capacity=True),
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    (dict(moe_router_enable_expert_bias=True),
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (dict(moe_shared_expert_gate=True),
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    (dict(moe_ffn_hidden_size=0), "--moe-ffn-hidden-size must be a positive integer"),
    (dict(moe_router_load_balancing_type="sinkhorn"),
     "--moe-router-load-balancing-type sinkhorn is not supported: use one of aux_loss, "
     "seq_aux_loss, global_aux_loss, none"),
    (dict(moe_router_load_balancing_type="aux_loss,seq_aux_loss"), "is not supported"),
    (dict(moe_router_score_function="tanh"), "--moe-router-score-function must be one of"),
])
def test_model_checks_one_line_naming_the_flag(kw, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        _moe(**kw).validate()
    assert "\n" not in str(e.value)


def test_the_router_options_that_are_valid_pass():
    _moe(moe_router_topk=1, moe_router_pre_softmax=True).validate()
    _moe(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
         moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4,
         moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True,
         moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
         moe_router_load_balancing_type="none").validate(4)


def _non_default(f):
    if f.type == "bool":
        return not f.default
    if f.metadata["choices"] or f.name == "moe_router_load_balancing_type":
        return "sigmoid" if f.name == "moe_router_score_function" else (
            next(c for c in f.metadata["choices"] if c != f.default)
            if f.metadata["choices"] else "none")
    if f.name == "moe_layer_freq":
        return "2"
    return 4 if f.default is None else f.default * 2 + 1


@pytest.mark.parametrize("f", [f for f in MOE_FIELDS if f.name != "num_experts"],
                         ids=lambda f: f.name)
def test_every_moe_setting_needs_num_experts(f):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{f.name: _non_default(f)}).validate()
    assert str(e.value).startswith(f"{flag_name(f)} needs --num-experts N")


def test_expert_parallel_sizes_need_num_experts_and_divide():
    for argv in (["--expert-model-parallel-size", "2"], ["--expert-tensor-parallel-size", "1"]):
        with pytest.raises(ConfigError, match=r"--expert-model-parallel-size / "
                                              r"--expert-tensor-parallel-size need --num-experts"):
            parse_args(argv)
    with pytest.raises(ConfigError, match=r"--num-experts \(6\) must be divisible by "
                                          r"--expert-model-parallel-size \(4\)"):
        parse_args(["--num-experts", "6", "--expert-model-parallel-size", "4"])
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size must be >= 1, got 0"):
        parse_args(["--num-experts", "4", "--expert-model-parallel-size", "0"])
    with pytest.raises(ConfigError, match=r"--moe-ffn-hidden-size \(30\) must be divisible by "
                                          r"--expert-tensor-parallel-size \(4\)"):
        parse_args(["--num-experts", "4", "--moe-ffn-hidden-size", "30",
                    "--expert-tensor-parallel-size", "4"])
    with pytest.raises(ConfigError, match=r"--moe-shared-expert-intermediate-size \(33\)"):
        parse_args(["--num-experts", "4", "--moe-shared-expert-intermediate-size", "33",
                    "--tensor-model-parallel-size", "2"])


def test_expert_grid_must_fit_each_stage_one_home():
    """TP x CP x DP (world / PP) must be divisible by ETP x EP, checked where the world size is
    known (resolve) with the message the rank grid gives too."""
    ok = parse_args(["--num-experts", "8", "--expert-model-parallel-size", "4",
                     "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                     "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                     "--num-layers", "4",
                     "--micro-batch-size", "1", "--global-batch-size", "24"])
    assert ok.resolve(16, 300).parallel.expert_data_parallel_size(16) == 2
    for world in (4, 12):  # world / PP = 2 or 6 ranks per stage, EP 4 fits neither
        with pytest.raises(ConfigError) as e:
            ok.resolve(world, 300)
        msg = str(e.value)
        assert msg.startswith(f"world size ({world}) / --pipeline-model-parallel-size (2) must be "
                              f"divisible by --expert-tensor-parallel-size (1) x "
                              f"--expert-model-parallel-size (4)")
        with pytest.raises(ConfigError) as grid:
            check_expert_grid_divisible(world, 1, 4, 2)
        assert str(grid.value) == msg
    with pytest.raises(ConfigError, match=r"--expert-tensor-parallel-size \(2\)"):  # ETP = TP
        ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4).validate(12)
    assert check_expert_grid_divisible(24, 2, 3, 2) == 2


def test_parameter_counts_match_a_hugging_face_moe_model():
    """Qwen2-MoE (a dense first layer, routed experts, a gated shared expert, SwiGLU, no linear
    biases but q/k/v ones): megalite's count is the count of transformers' model."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=4, mlp_only_layers=[0], num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False))
    cfg = _moe(num_experts=4, num_query_groups=2, ffn_hidden_size=48, moe_ffn_hidden_size=16,
               moe_layer_freq="[0]+[1]*3", moe_shared_expert_intermediate_size=24,
               moe_shared_expert_gate=True, position_embedding_type="rope",
               normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=True,
               untie_embeddings_and_output_weights=True).validate()
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    h, f = 32, 16
    expert = 3 * h * f
    # a token uses 2 of the 4 experts in each of the 3 MoE layers; router and shared expert always
    assert cfg.num_parameters() - cfg.num_active_parameters() == 3 * (4 - 2) * expert


def test_parameter_counts_with_biases_and_buffers():
    dense = _moe(num_experts=None)
    h, L, f = 32, 4, 128
    mlp = h * f + f + f * h + h  # GeLU fc1 and fc2 with their biases
    moe = _moe(moe_layer_freq="2", moe_ffn_hidden_size=64, moe_router_topk=2)
    expert = h * 64 + 64 + 64 * h + h
    assert moe.num_parameters() == dense.num_parameters() + 2 * (8 * h + 8 * expert - mlp)
    assert moe.num_active_parameters() == dense.num_parameters() + 2 * (8 * h + 2 * expert - mlp)
    # the expert bias is a buffer: no parameter; the shared expert's gate is h
    biased = _moe(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    assert biased.num_parameters() == _moe().num_parameters()
    shared = _moe(moe_shared_expert_intermediate_size=48)
    gated = _moe(moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True)
    assert shared.num_parameters() - _moe().num_parameters() == L * (h * 48 + 48 + 48 * h + h)
    assert gated.num_parameters() - shared.num_parameters() == L * h
    assert gated.num_active_parameters() - shared.num_active_parameters() == L * h


def test_library_config_validates_like_the_cli():
    cfg = MegaliteConfig(model=_moe(), parallel=ParallelConfig(expert_model_parallel_size=2))
    cfg.validate(4)
    cfg.model.moe_router_topk = 9
    with pytest.raises(ConfigError, match="--moe-router-topk"):
        cfg.validate()


@pytest.mark.parametrize("extra,needle", [
    (["--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
])
def test_what_moe_does_not_do_yet_is_refused_in_one_line(extra, needle):
    from megalite.arguments import parse_args
    from megalite.config import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_args(["--num-experts", "4"] + extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_two_spellings_of_one_layer_pattern_are_one_shape():
    from megalite.config import model_shape_differences

    base = ["--num-experts", "4", "--num-layers", "4"]
    a = parse_args(base + ["--moe-layer-freq", "2"]).model
    b = parse_args(base + ["--moe-layer-freq", "[1,0,1,0]"]).model
    c = parse_args(base + ["--moe-layer-freq", "[0,1,0,1]"]).model
    assert model_shape_differences(a, b) == []
    assert model_shape_differences(a, c) == [
        "--moe-layer-freq: checkpoint has 2, this run has [0,1,0,1]"]


OVERLAP = ["--num-experts", "4", "--expert-model-parallel-size", "2",
           "--overlap-moe-expert-parallel-comm"]


@pytest.mark.parametrize("argv, needle", [
    (["--expert-model-parallel-size", "1"], "needs --expert-model-parallel-size > 1"),
    (["--moe-token-dispatcher-type", "allgather"], "needs --moe-token-dispatcher-type alltoall"),
    (["--recompute-granularity", "full"], "with --recompute-granularity full"),
    (["--recompute-granularity", "selective"], "with --recompute-granularity selective"),
    (["--zero-stage", "3"], "with --zero-stage 3"),
])
def test_moe_overlap_refuses_what_it_does_not_compose_with(argv, needle):
    """The combined 1F1B's one-line refusals (docs/moe.md, "Hiding the all-to-alls"); the flag
    itself passes at EP 2, PP 1 and under every pipeline schedule (the last flag given wins)."""
    assert parse_args(OVERLAP).training.overlap_moe_expert_parallel_comm
    for schedule in ("1f1b", "dualpipev", "zb-v", "zb-h1"):
        assert parse_args(OVERLAP + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                     schedule, "--num-layers", "4"]
                          ).training.overlap_moe_expert_parallel_comm
    with pytest.raises(ConfigError, match=needle) as e:
        parse_args(OVERLAP + argv)
    assert str(e.value).startswith("--overlap-moe-expert-parallel-comm") and "\n" not in str(
        e.value)


def test_delay_wgrad_compute_needs_the_overlap():
    """--delay-wgrad-compute fills the combined 1F1B's all-to-all waits: alone it is refused in
    one line; with the overlap it passes."""
    assert parse_args(OVERLAP + ["--delay-wgrad-compute"]).training.delay_wgrad_compute
    with pytest.raises(ConfigError, match="needs --overlap-moe-expert-parallel-comm") as e:
        parse_args(OVERLAP[:4] + ["--delay-wgrad-compute"])
    assert str(e.value).startswith("--delay-wgrad-compute") and "\n" not in str(e.value)
