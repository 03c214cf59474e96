"""Parameter records (megalite/param_meta.py): what the builders attach, and that nothing else in
megalite reads parameter attributes on its own."""

import ast
import copy
import os

import torch
from model_utils import tiny_config
from pretrain_utils import ROOT

from megalite.config import OptimizerConfig
from megalite.checkpoint.layout import Chunk, chunk_specs
from megalite.distributed.zero3 import shard_model_zero3
from megalite.models import GPTModel
from megalite.models.gpt import EMBEDDING_WEIGHT_NAME
from megalite.optimizer.clip_grads import counts_for_norm
from megalite.param_meta import ParamMeta, grad_of, param_meta, set_param_meta
from megalite.parallel_state import ParallelState
from megalite.pipeline_parallel.partition import build_model_chunks

# The ad-hoc attributes the record replaced (and its own slot): reading one with getattr/hasattr
# outside param_meta.py would bypass the record.
OLD_NAMES = {"tensor_model_parallel", "partition_dim", "partition_stride", "shared_embedding",
             "local_tied_copy", "sequence_parallel", "init_method", "init_seed_name", "main_grad",
             "_megalite_param_meta"}
GONE = {"tensor_model_parallel", "shared_embedding", "_megalite_param_meta"}  # no field has these


def attribute_reads(source: str):
    """(line, name) of each getattr/hasattr/setattr/delattr of an OLD_NAMES string, and each
    ``x.name`` for a name no record field has."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in OLD_NAMES):
            hits.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.Attribute) and node.attr in GONE:
            hits.append((node.lineno, node.attr))
    return hits


def test_scan_sees_an_old_style_read():
    assert attribute_reads("x = getattr(p, 'shared_embedding', False)\np.tensor_model_parallel = 1"
                           ) == [(1, "shared_embedding"), (2, "tensor_model_parallel")]
    assert attribute_reads("m = param_meta(p)\nm.partition_dim, getattr(p, 'weight_grads_queued')"
                           ) == []


def test_only_param_meta_reads_parameter_attributes():
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and os.path.relpath(path, ROOT) != os.path.join(
                    "megalite", "param_meta.py"):
                found += [(os.path.relpath(path, ROOT), *h)
                          for h in attribute_reads(open(path, encoding="utf-8").read())]
    assert found == [], f"parameter attributes read outside megalite/param_meta.py: {found}"


def test_records_of_a_tp1_model():
    model = GPTModel(tiny_config("llama", qk_layernorm=True), ParallelState(), seed=1)
    meta = {n: param_meta(p) for n, p in model.named_parameters()}
    split = {n: (m.partition_dim, m.partition_stride) for n, m in meta.items() if m.tp_split}
    layer = "layers.0."
    assert split[layer + "self_attention.linear_qkv.weight"] == (0, 1)  # column-parallel
    assert split[layer + "mlp.linear_fc1.weight"] == (0, 2)  # SwiGLU's [gate; up]
    assert split[layer + "self_attention.linear_proj.weight"] == (1, 1)  # row-parallel
    assert split[layer + "mlp.linear_fc2.weight"] == (1, 1)
    assert split[EMBEDDING_WEIGHT_NAME] == split["output_layer.weight"] == (0, 1)
    assert meta[EMBEDDING_WEIGHT_NAME].init_method == ("normal_vocab", 0.02)
    assert meta[layer + "input_layernorm.weight"] == ParamMeta(init_method=("ones",))
    # qk-norms: each TP rank applies them to its own heads, with or without SP
    partial = {n for n, m in meta.items() if m.grad_partial_over_tp}
    assert partial == {f"layers.{i}.self_attention.{q}_layernorm.weight"
                       for i in range(2) for q in "qk"}
    assert not any(m.tied_embedding or m.local_tied_copy or m.expert for m in meta.values())
    # GPT-2: tied in one stage (one weight), replicated row-parallel biases; SP is off at TP1
    gpt = GPTModel(tiny_config("gpt2"), ParallelState(), seed=1, sequence_parallel=True)
    meta = {n: param_meta(p) for n, p in gpt.named_parameters()}
    assert "output_layer.weight" not in meta and not meta[EMBEDDING_WEIGHT_NAME].tied_embedding
    bias = meta["layers.0.self_attention.linear_proj.bias"]
    assert not bias.tp_split and not bias.grad_partial_over_tp and bias.init_method == ("zeros",)
    assert meta["layers.0.self_attention.linear_qkv.bias"].tp_split


def test_tied_embedding_records_under_pp():
    cfg = tiny_config("gpt2", num_layers=4)
    first, last = (build_model_chunks(cfg, ParallelState(world_size=2, pp_size=2, pp_rank=r),
                                      seed=None) for r in (0, 1))
    emb, out = first[0].embedding.word_embeddings.weight, last[0].output_layer.weight
    assert param_meta(emb).tied_embedding and not param_meta(emb).local_tied_copy
    assert param_meta(out) == ParamMeta(tp_split=True, tied_embedding=True,
                                        init_method=("normal_vocab", 0.02),
                                        init_seed_name=EMBEDDING_WEIGHT_NAME)
    assert counts_for_norm(emb, 0, True) and not counts_for_norm(out, 0, False)
    # V schedules: both copies on rank 0; the output layer's is the local duplicate
    v = build_model_chunks(cfg, ParallelState(world_size=2, pp_size=2), seed=None, v_shape=True)
    out = v[1].output_layer.weight
    assert param_meta(out).tied_embedding and param_meta(out).local_tied_copy
    assert not counts_for_norm(out, 0, True)
    assert counts_for_norm(v[0].embedding.word_embeddings.weight, 0, True)
    # the converter reads the same records off its meta-device model
    specs = {s.name: s.meta for s in chunk_specs(cfg, Chunk(1, 0, (2, 4), False, True), 2)}
    assert specs["output_layer.weight"].tied_embedding
    assert specs["layers.2.mlp.linear_fc2.weight"].partition_dim == 1


def test_set_param_meta_and_grad_of():
    p = torch.nn.Parameter(torch.zeros(3))
    assert param_meta(p) == ParamMeta()
    set_param_meta(p, tp_split=True, partition_dim=1)
    assert set_param_meta(p, expert=True) == ParamMeta(tp_split=True, partition_dim=1, expert=True)
    # torch's Parameter.__deepcopy__ copies data only: a copy is untagged (as it was untagged
    # by the old ad-hoc attributes); build models again instead of copying them
    assert param_meta(copy.deepcopy(p)) == ParamMeta()
    assert grad_of(p) is None
    p.grad = torch.ones(3)
    assert grad_of(p) is p.grad
    p.main_grad = torch.full((3,), 2.0)
    assert grad_of(p) is p.main_grad


def test_records_survive_zero3_sharding():
    model = GPTModel(tiny_config("gpt2"), ParallelState(), seed=1)
    before = {n: param_meta(p) for n, p in model.named_parameters()}
    z = shard_model_zero3(model, ParallelState(), OptimizerConfig().validate())
    assert {n: param_meta(p) for n, p in z.module.named_parameters()} == before
