"""Flags -> MegaliteConfig: Megatron spellings, defaults, validation with one clear message."""

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError, config_from_dict, model_shape_differences


def test_defaults_are_a_small_gpt2_for_cpu():
    cfg = parse_args([])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (6, 384, 6, 256)
    assert cfg.model.vocab_size == 8192 and cfg.data.data_path is None
    assert 8e6 <= m.num_parameters() <= 16e6  # "~10M parameters"
    assert m.params_dtype == "float32" and cfg.optimizer.lr_decay_style == "cosine"
    assert cfg.optimizer.lr_warmup_iters > 0 and cfg.training.train_iters == 300
    assert cfg.training.eval_interval == 100


def test_flags_reach_the_dataclasses():
    cfg = parse_args([
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--bf16", "--lr", "3e-4", "--min-lr", "3e-5",
        "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10", "--zero-stage", "2",
        "--overlap-grad-reduce", "--recompute-granularity", "full", "--recompute-method",
        "uniform", "--recompute-num-layers", "1", "--save", "/tmp/x", "--no-save-optim",
        "--data-path", "0.3", "a", "0.7", "b", "--eod-mask-loss", "--seed", "7",
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"])
    m = cfg.model
    assert m.num_query_groups == 2 and m.position_embedding_type == "rope" and m.swiglu
    assert not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert cfg.parallel.sequence_parallel and not hasattr(m, "sequence_parallel")
    assert m.params_dtype == "bfloat16" and not hasattr(cfg.optimizer, "bf16")  # one fact
    assert cfg.execution.recompute_granularity == "full" and cfg.execution.recompute_num_layers == 1
    assert cfg.optimizer.zero_stage == 2 and cfg.optimizer.overlap_grad_reduce
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert cfg.checkpoint.no_save_optim and cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    assert cfg.training.seed == 7 and cfg.data.eod_mask_loss


@pytest.mark.parametrize("argv,needle", [
    (["--fp16", "--bf16"], "--bf16 and --fp16"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--num-layers", "x"], "--num-layers"),
    (["--position-embedding-type", "alibi"], "--position-embedding-type"),
    (["--tensor-model-parallel-size", "4", "--num-attention-heads", "6"], "--num-attention-heads"),
    (["--sequence-parallel"], "--sequence-parallel"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["--num-query-groups", "2"], "--group-query-attention"),
    (["--use-checkpoint-args"], "--load"),
    (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    (["--data-path"], "--data-path"),
])
def test_bad_flags_raise_one_line(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_world_size_checks_and_the_resolved_config():
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                      "--global-batch-size", "6"])
    with pytest.raises(ConfigError, match="--global-batch-size"):
        cfg.resolve(4, 300)  # dp = 2: 6 is not a multiple of 2 x 2
    with pytest.raises(ConfigError, match="world size"):
        parse_args(["--tensor-model-parallel-size", "2"]).resolve(3, 300)
    raw = parse_args(["--micro-batch-size", "2"])
    cfg = raw.resolve(2, 300)
    assert cfg.training.global_batch_size == 4  # default: micro x dp
    assert cfg.model.vocab_size == 300 and cfg.model.output_vocab_size == 300  # the tokenizer's
    assert raw.training.global_batch_size is None and raw.model.vocab_size != 300  # untouched
    with pytest.raises(AttributeError, match="read-only"):
        cfg.model.vocab_size = 512
    # A model vocabulary from the checkpoint may exceed the tokenizer's: the extra rows are never
    # predicted. Smaller is an error (the tokenizer would produce ids with no embedding row).
    ck = parse_args(["--load", "x", "--use-checkpoint-args", "--vocab-size", "320"])
    ck = ck.resolve(1, 300)
    assert (ck.model.vocab_size, ck.model.output_vocab_size) == (320, 300)
    with pytest.raises(ConfigError, match="the tokenizer has 400 ids"):
        parse_args(["--load", "x", "--use-checkpoint-args", "--vocab-size", "320"]).resolve(1, 400)


def test_args_json_roundtrip_and_shape_diff():
    cfg = parse_args(["--hidden-size", "64", "--num-attention-heads", "4"])
    back = config_from_dict(cfg.to_dict())
    assert back.to_dict() == cfg.to_dict()
    other = parse_args(["--hidden-size", "128", "--num-attention-heads", "4"])
    diffs = model_shape_differences(cfg.model, other.model)
    assert any(d.startswith("--hidden-size: checkpoint has 64, this run has 128") for d in diffs)
    assert model_shape_differences(cfg.model, back.model) == []


# ------------------------------------------------------------------ one declaration per setting
def test_every_setting_is_declared_once():
    """A field without a flag says why; a flag is a field's or one of the compound flags; every
    model field has a role, and the shape fields are among those --use-checkpoint-args takes."""
    from dataclasses import fields

    from megalite.arguments import COMPOUND_FLAGS, build_parser
    from megalite.config import (CHECKPOINT_ARGS_FIELDS, MODEL_SHAPE_FIELDS, SECTIONS,
                                 ModelConfig, flag_name)

    parser_flags = {a.option_strings[0] for a in build_parser()._actions} - {"-h"}
    compound = {flag for _, flag, _ in COMPOUND_FLAGS}
    declared = set()
    for cls in SECTIONS.values():
        for f in fields(cls):
            flag = flag_name(f)
            if flag is None:
                why = f.metadata["no_flag"]
                assert why, f"{cls.__name__}.{f.name} has neither a flag nor a reason"
                if why.startswith("--"):  # set by a compound flag's translation: it exists
                    assert set(why.replace("/", " ").split()) <= parser_flags, (f.name, why)
            else:
                assert flag not in declared, f"{flag} is declared twice"
                declared.add(flag)
    assert parser_flags == declared | compound
    for f in fields(ModelConfig):
        assert f.metadata["role"] in ("shape", "checkpoint-arg", "run"), f.name
    assert set(MODEL_SHAPE_FIELDS) < set(CHECKPOINT_ARGS_FIELDS)
    assert {"num_layers", "hidden_size", "vocab_size", "qk_layernorm"} <= set(MODEL_SHAPE_FIELDS)


def test_library_defaults_are_the_cli_defaults():
    from megalite.config import MegaliteConfig

    assert MegaliteConfig() == parse_args([])
    MegaliteConfig().validate(1)  # and they are valid as they stand (context parallelism too)
    cp = MegaliteConfig()
    cp.parallel.context_parallel_size = 2
    cp.validate(2)


def _describe(parser):
    out = {}
    for g in parser._action_groups:
        for a in g._group_actions:
            if a.option_strings and "--help" not in a.option_strings:
                out[" ".join(a.option_strings)] = dict(
                    default=a.default, choices=None if a.choices is None else list(a.choices),
                    nargs=a.nargs, const=a.const, action=type(a).__name__, group=g.title,
                    type=getattr(a.type, "__name__", None))
    return out


def test_flags_and_defaults_are_those_recorded_before_the_declarations():
    """pretrain.py and tools/plan.py keep every flag, default, kind and --help group they had
    (tests/fixtures/cli/flags_before.json, dumped from the hand-written parser). The changes:
    --optimizer offers sgd, which the optimizer always implemented, and the flags added since
    are exactly the declared MoE and multi-latent attention settings, YaRN's,
    --mtp-num-layers, the expert-parallel sizes and --async-save."""
    import json
    import os
    import sys
    from dataclasses import fields

    from pretrain_utils import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from megalite.arguments import build_parser
    from megalite.config import SECTIONS, ModelConfig, ParallelConfig, flag_name
    from plan import PLANNER_ONLY_FLAGS, build_plan_parser

    with open(os.path.join(ROOT, "tests", "fixtures", "cli", "flags_before.json")) as f:
        before = json.load(f)
    moe = {flag_name(f) for cls in SECTIONS.values() for f in fields(cls)
           if f.metadata["group"] == "mixture of experts"}
    mla = {flag_name(f) for f in fields(ModelConfig)
           if f.metadata["group"] == "multi-latent attention"}
    yarn_mtp = {"--rope-type", "--rotary-scaling-factor", "--beta-fast", "--beta-slow",
                "--mscale", "--mscale-all-dim", "--mtp-num-layers"}
    added = moe | mla | yarn_mtp | {flag_name(f) for f in fields(ParallelConfig)
                                    if f.name.startswith("expert_")}
    assert "--num-experts" in moe and len(added) == len(moe) + len(mla) + len(yarn_mtp) + 2
    added |= {"--rotary-percent", "--qk-layernorm-scope"}  # the HF MoE families' (models.md)
    added |= {"--cp-attention-kernel"}  # docs/context_parallel.md, "Kernels"
    added |= {"--async-save"}  # docs/checkpoints.md, "Asynchronous saves"
    added |= {"--log-planner-estimate", "--log-memory-peak"}  # docs/planner.md
    added |= {"--reset-position-ids", "--reset-attention-mask"}  # docs/data.md
    added |= {flag_name(f) for f in fields(ModelConfig)  # docs/models.md, "Hybrid linear ..."
              if f.metadata["group"] == "linear attention"}
    added |= {"--attention-output-gate", "--apply-layernorm-1p"}
    added |= {"--collective-record", "--collective-record-dir"}  # docs/clusters.md
    added |= {"--no-verify-load"}  # docs/checkpoints.md, "Loads that prove themselves"
    added |= {"--num-distributed-optimizer-instances"}  # docs/data_parallel.md, "HSDP"
    added |= {"--optimizer-cpu-offload", "--optimizer-offload-fraction"}  # docs/offload.md
    added |= {"--cross-entropy-chunk-tokens"}  # docs/tensor_parallel.md, chunked loss head
    added |= {"--attention-sinks", "--swiglu-limit", "--swiglu-alpha",  # docs/models.md,
              "--window-attn-skip-freq", "--rope-yarn-truncate"}  # "GPT-OSS"
    added |= {"--mtp-loss-scaling-factor"}  # docs/models.md, "Multi-token prediction"
    for tool, parser in (("pretrain.py", build_parser()), ("plan.py", build_plan_parser())):
        now, old = _describe(parser), before[tool]
        # (a key is an action's spellings: "--x --no-x" for a flag that defaults on)
        planner_only = set(PLANNER_ONLY_FLAGS) if tool == "plan.py" else set()  # (its own)
        assert set(old) <= set(now) and {k.split()[0] for k in set(now) - set(old)} == added \
            | planner_only, tool
        old["--optimizer"]["choices"].append("sgd")
        for flag, want in old.items():
            got = dict(now[flag])
            if want["type"] is None:  # choices of strings: argparse took them untyped
                got["type"] = None
            assert got == want, (tool, flag)


def test_old_args_json_loads_to_the_config_it_meant():
    """A committed args.json from before the declarations (it still has bf16/fp16,
    use_distributed_optimizer, the layers per virtual stage) loads with every recorded value,
    ZeRO-1 from use_distributed_optimizer; keys it lacks take the defaults of when it was
    written (LEGACY_DEFAULTS), never a default that moved since."""
    import json
    import os

    from megalite.config import LEGACY_DEFAULTS
    from pretrain_utils import ROOT

    path = os.path.join(ROOT, "tests", "fixtures", "optimizer_v1", "zero1", "iter_0000001",
                        "args.json")
    with open(path) as f:
        saved = json.load(f)
    cfg = config_from_dict(saved)
    for section, values in saved.items():
        now = getattr(cfg, section).to_dict()
        for k, v in values.items():
            if k in now:
                assert now[k] == v, (section, k)
    assert cfg.optimizer.zero_stage == 1 and cfg.parallel.context_parallel_size == 1
    bare = config_from_dict({})  # a file older than every field
    for section, values in LEGACY_DEFAULTS.items():
        for k, v in values.items():
            assert getattr(getattr(bare, section), k) == v, (section, k)
    assert bare.model.ffn_hidden_size == 1024 and bare.model.num_query_groups == 4


def test_run_switches_saved_in_the_model_section_load_where_they_live_now():
    """args.json files written while the run switches sat in ModelConfig (and the BPE's size in
    DataConfig) load with each value in its section of today; the model keeps only its math."""
    old = {"model": {"hidden_size": 64, "num_attention_heads": 4, "torch_compile": "eager",
                     "use_apex": True, "cp_attention_kernel": "math", "moe_grouped_gemm": False,
                     "recompute_granularity": "full", "recompute_num_layers": 2,
                     "moe_token_dispatcher_type": "allgather",
                     "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True},
           "data": {"vocab_size": 8192}}
    cfg = config_from_dict(old)
    ex, tr = cfg.execution, cfg.training
    assert (ex.torch_compile, ex.use_apex, ex.cp_attention_kernel, ex.moe_grouped_gemm) == (
        "eager", True, "math", False)
    assert (ex.recompute_granularity, ex.recompute_num_layers) == ("full", 2)
    assert ex.moe_token_dispatcher_type == "allgather"
    assert tr.overlap_moe_expert_parallel_comm and tr.delay_wgrad_compute
    assert cfg.model.hidden_size == 64 and not hasattr(cfg.model, "torch_compile")
    assert config_from_dict(cfg.to_dict()) == cfg  # and today's files round-trip


def test_virtual_stages_either_flag_one_fact():
    a = parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                    "--num-layers-per-virtual-pipeline-stage", "2"])
    b = parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "8",
                    "--num-virtual-stages-per-pipeline-rank", "2"])
    assert a == b and a.parallel.virtual_pipeline_model_parallel_size == 2
    assert a.layers_per_virtual_stage() == 2
    for argv in (["--num-layers-per-virtual-pipeline-stage", "4"],
                 ["--num-virtual-stages-per-pipeline-rank", "4"]):
        with pytest.raises(ConfigError) as e:
            parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "6"] + argv)
        msg = str(e.value)  # whichever flag was given, the message names both
        assert "--num-virtual-stages-per-pipeline-rank" in msg
        assert "--num-layers-per-virtual-pipeline-stage" in msg


def test_sgd_is_a_choice_that_runs():
    import torch

    from megalite.models import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import ParallelState
    from model_utils import tiny_config

    cfg = parse_args(["--optimizer", "sgd", "--lr", "0.1", "--min-lr", "0"])
    with pytest.raises(ConfigError, match="--optimizer sgd"):
        parse_args(["--optimizer", "sgd", "--zero-stage", "1"])
    model = GPTModel(tiny_config(), ParallelState(), seed=1)
    opt = build_optimizer([model], cfg.optimizer, ParallelState())
    assert isinstance(opt.inner, torch.optim.SGD)
    ids = torch.randint(0, 100, (2, 17))
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step()[0]
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
