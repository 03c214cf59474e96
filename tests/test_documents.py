"""Packed documents (--reset-attention-mask, --reset-position-ids): each token attends only to
its own document, on one device and under every context-parallel comm type, against the
whole-sequence masked-SDPA formula; blocks no query sees are skipped (docs/data.md, "Packed
documents"; docs/context_parallel.md, "Packed documents")."""

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalite.context_parallel import attention as A
from megalite.context_parallel.sharding import shard
from megalite.masks import Documents, document_attention, document_ids
from tests.dist_utils import run_distributed

B, N, G, S, D = 2, 8, 4, 32, 8


def _packed(lengths_per_sample, s=S):
    """Documents of samples whose documents have the given lengths (summing to s)."""
    ids = np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_sample])
    assert ids.shape[1] == s
    return Documents.of(ids)


# sample 0: a document across the CP chunk borders; sample 1: many short ones, one per chunk
LENGTHS = [(5, 11, 16), (4, 4, 4, 4, 4, 4, 4, 4)]


def _reference(q, k, v, docs, window=None):
    pos = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(pos, pos, window),
                                          enable_gqa=q.shape[1] != k.shape[1])


def test_document_ids_and_positions_restart_after_each_eod():
    ids, pos = document_ids(np.array([[5, 0, 7, 8, 0, 0, 3]]), eod=0)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0, 0]]


@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_one_device_document_attention_equals_the_masked_formula(many, window, monkeypatch):
    """Per document SDPA (few documents) and one masked SDPA per sample (many): fp64, 1e-12."""
    import megalite.masks as M

    monkeypatch.setattr(M, "_MANY_DOCUMENTS", 0 if many else 10**6)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, S, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, G, S, D, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    docs = _packed(LENGTHS)
    out = document_attention(q, k, v, docs, window, enable_gqa=True)
    ref = _reference(q, k, v, docs, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _cp_case(group, rank, size, comm, kernel):
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen) for h in (N, G, G, N))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    docs = _packed(LENGTHS)
    ref = _reference(q, k, v, docs)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    local = [shard(t.detach(), rank, size, 2).requires_grad_() for t in (q, k, v)]
    attend = partial(document_attention, docs=docs, enable_gqa=True) if comm == "a2a" else None
    out = A.context_parallel_attention(*local, group, comm, local_attention=attend,
                                       kernel=kernel, documents=docs)
    grads = torch.autograd.grad(out, local, shard(dout, rank, size, 2))
    errs = [float((a.detach() - shard(b.detach(), rank, size, 2)).abs().max())
            for a, b in zip([out, *grads], [ref, *ref_grads])]
    skipped = sum(1 for how in docs._blocks.values() if isinstance(how, str))
    return errs, skipped


def _cp_all(rank, size):
    group = torch.distributed.new_group(list(range(size)))
    return {(comm, kernel): _cp_case(group, rank, size, comm, kernel)
            for comm in ("p2p", "allgather", "a2a") for kernel in ("auto", "math")}


@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_document_attention_equals_one_device(size):
    results = run_distributed(_cp_all, size)
    for rank, res in enumerate(results):
        for case, (errs, skipped) in res.items():
            assert max(errs) < 1e-5, (rank, case, errs)
    # at C = 4 the ring skips blocks: rank 0's first chunk (tokens 0-3, the first documents of
    # both samples) meets no key of rank 3's chunks
    if size == 4:
        assert results[3][("p2p", "auto")][1] > 0


# ------------------------------------------------------------------------------------------------
# The model: a packed sample gives each document's losses as if it ran alone
# ------------------------------------------------------------------------------------------------
def _families():
    from tests.model_utils import tiny_config
    from tests.test_mla import mla_config

    return {"llama": tiny_config("llama", seq_length=32),
            "gpt2": tiny_config("gpt2", seq_length=32),  # learned absolute positions
            "mistral_window": tiny_config("llama", seq_length=32, sliding_window=4),
            "mla_yarn": mla_config(seq_length=32, rope_type="yarn", rotary_scaling_factor=4.0,
                                   rope_original_max_position_embeddings=16)}


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral_window", "mla_yarn"])
def test_packed_documents_give_each_documents_own_losses(family):
    from megalite.data.batch import get_batch
    from megalite.models.gpt import GPTModel

    torch.manual_seed(0)
    cfg = _families()[family]
    model = GPTModel(cfg.validate(), seed=3)
    eod = 99
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 99, (n,), generator=gen) for n in (9, 14, 10)]
    docs = [torch.cat([d[:-1], torch.tensor([eod])]) for d in docs]  # each ends with its EOD
    sample = torch.cat(docs)[None]  # 33 tokens: 32 inputs and their labels
    tokens, labels, _, pos, documents = get_batch(sample, eod, False, True, True)
    packed = model(tokens, labels=labels, position_ids=pos, documents=documents)[0]
    plain = model(tokens, labels=labels)[0]
    start = 0
    for d in docs:
        n = min(len(d), 32 - start)
        alone = model(tokens[:, start:start + n], labels=labels[:, start:start + n])[0]
        torch.testing.assert_close(packed[start:start + n], alone, rtol=0, atol=1e-6)
        if start > 0:  # without the flags, a later document sees the ones before it
            assert (plain[start:start + n] - alone).abs().max() > 1e-3
        start += n


# ------------------------------------------------------------------------------------------------
# pretrain.py with both flags: every layout equals one process (docs/design.md, contract 5)
# ------------------------------------------------------------------------------------------------
ITERS = 4
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--num-layers", "4"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
CP2, TP2_SP = ["--context-parallel-size", "2"], ["--tensor-model-parallel-size", "2",
                                                 "--sequence-parallel"]
# name -> (world size, model flags, layout flags); one process runs each model's flags
LAYOUTS = {
    "tp2_sp": (2, LLAMA, TP2_SP),
    "pp2_1f1b": (2, LLAMA, ["--pipeline-model-parallel-size", "2"]),
    "pp2_dualpipev": (2, LLAMA, ["--pipeline-model-parallel-size", "2",
                                 "--pipeline-schedule", "dualpipev"]),
    "cp2_p2p": (2, LLAMA, CP2),
    "cp2_allgather": (2, LLAMA, CP2 + ["--cp-comm-type", "allgather"]),
    "cp2_a2a": (2, LLAMA, CP2 + ["--cp-comm-type", "a2a"]),
    "dp2_zero3": (2, LLAMA, ["--zero-stage", "3"]),
    "ep2": (2, LLAMA + MOE, ["--expert-model-parallel-size", "2"]),
    "cp2_tp2": (4, LLAMA, CP2 + ["--tensor-model-parallel-size", "2"]),
    # one process: recomputed in backward, each layer compiled (the document attention eager)
    "recompute_compiled": (1, LLAMA, ["--recompute-granularity", "full",
                                      "--torch-compile", "aot_eager"]),
}


def _short_documents(prefix: str) -> None:
    """1000 documents of 3-13 tokens (mean 8 = s/8), each ending with NullTokenizer's EOD."""
    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for n in rng.integers(3, 14, size=1000):
            b.add_document(list(rng.integers(0, 299, size=n - 1)) + [299])
        b.finalize(prefix + ".idx")


def _argv(data, model, layout, metrics):
    from tests.pretrain_utils import TINY

    tiny = [f for f in TINY if f != "--mock-data"]
    return tiny + ["--data-path", data, "--tokenizer-type", "NullTokenizer", "--split", "100,0,0",
                   "--seq-length", "64", "--global-batch-size", "8", "--train-iters", str(ITERS),
                   "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
                   "--metrics-file", str(metrics), *model, *layout]


@pytest.fixture(scope="module")
def document_runs(tmp_path_factory):
    from tests.pretrain_utils import pretrain_cases, run_main, single_process_refs

    d = tmp_path_factory.mktemp("documents")
    data = str(d / "docs")
    _short_documents(data)
    for world in (2, 4):
        runs = [_argv(data, m, layout, d / f"{name}.jsonl")
                for name, (w, m, layout) in LAYOUTS.items() if w == world]
        assert all(run_distributed(pretrain_cases, world, runs, timeout=600))
    for name, (w, m, layout) in LAYOUTS.items():
        if w == 1:
            assert run_main(_argv(data, m, layout, d / f"{name}.jsonl")) == 0
    refs = single_process_refs((m for _w, m, _l in LAYOUTS.values()),
                               lambda m, out: _argv(data, m, [], out), d)
    # without the flags the same data trains differently (the masks are in effect)
    plain = [f for f in _argv(data, LLAMA, [], d / "plain.jsonl")
             if f not in ("--reset-position-ids", "--reset-attention-mask")]
    assert run_main(plain) == 0
    return d, refs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_documents_every_layout_equals_one_process(document_runs, name):
    from tests.pretrain_utils import assert_same_run, read_metrics

    d, refs = document_runs
    ref = read_metrics(refs[tuple(LAYOUTS[name][1])])
    assert_same_run(ref, read_metrics(d / f"{name}.jsonl"), ITERS, name=name)
    if name == "tp2_sp":
        plain = read_metrics(d / "plain.jsonl")
        assert abs(plain[0]["lm_loss"] - ref[0]["lm_loss"]) > 1e-4  # the masks change the loss
