"""GPT packing, splits, blends, the pretraining sampler (layout independence, resume), get_batch."""

import numpy as np
import torch

from megalite.config import DataConfig
from megalite.data import (build_data_loader, build_pretraining_datasets, get_batch)
from megalite.data.gpt_dataset import (ArrayDocumentStore, BlendedDataset, GPTDataset,
                                       blending_indices, parse_blend, split_document_ranges)
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.data.sampler import PretrainingSampler
from megalite.data.tokenizer import null_tokenizer

EOD = 0


def make_store(doc_lengths, seed=0):
    rng = np.random.RandomState(seed)
    docs = [np.append(rng.randint(1, 100, n - 1), EOD) for n in doc_lengths]
    offsets = np.cumsum([0] + [len(d) for d in docs])
    return ArrayDocumentStore(np.concatenate(docs).astype(np.int32), offsets, "toy"), docs


def write_indexed(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(d)
    b.finalize(prefix + ".idx")
    return prefix


# --- packing --------------------------------------------------------------------------------


def test_packing_reproduces_the_shuffled_document_stream():
    store, docs = make_store([5, 17, 3, 40, 8, 11, 2, 29])
    s = 16
    ds = GPTDataset(store, range(8), s, num_samples=20, seed=7)
    assert len(ds) >= 20 and ds.num_epochs >= 2
    # each epoch is a permutation of the documents
    n = len(docs)
    for e in range(ds.num_epochs):
        assert sorted(ds.doc_order[e * n:(e + 1) * n].tolist()) == list(range(n))
    stream = np.concatenate([docs[d] for d in ds.doc_order])
    for j in range(len(ds)):
        assert ds.sample_tokens(j).tolist() == stream[j * s:j * s + s + 1].tolist()
    # the shuffled view is a permutation of the unshuffled samples
    assert sorted(ds.shuffle_idx.tolist()) == list(range(len(ds)))
    got = ds[3]["tokens"]
    assert got.dtype == np.int64 and got.shape == (s + 1,)
    assert got.tolist() == ds.sample_tokens(int(ds.shuffle_idx[3])).tolist()


def test_packing_is_deterministic_in_seed():
    store, _ = make_store([9] * 30)
    a = GPTDataset(store, range(30), 8, 20, seed=1)
    b = GPTDataset(store, range(30), 8, 20, seed=1)
    c = GPTDataset(store, range(30), 8, 20, seed=2)
    assert all((a[i]["tokens"] == b[i]["tokens"]).all() for i in range(len(a)))
    assert any((a[i]["tokens"] != c[i]["tokens"]).any() for i in range(len(a)))


# --- splits -----------------------------------------------------------------------------------


def test_split_document_ranges():
    assert split_document_ranges(1000, "969,30,1") == [range(0, 969), range(969, 999),
                                                      range(999, 1000)]
    assert split_document_ranges(10, "8,1,1") == [range(0, 8), range(8, 9), range(9, 10)]
    assert split_document_ranges(10, "100") == [range(0, 10), range(10, 10), range(10, 10)]
    assert split_document_ranges(7, "1,0,1") == [range(0, 4), range(4, 4), range(4, 7)]


def test_splits_draw_only_their_documents(tmp_path):
    # document d is made of token d+1 (and EOD 0), so a sample tells which documents fed it
    docs = [np.array([d + 1] * 6 + [EOD]) for d in range(20)]
    prefix = write_indexed(str(tmp_path / "sp"), docs)
    cfg = DataConfig(data_path=[prefix], split="14,4,2", tokenizer_type="NullTokenizer")
    tok = null_tokenizer(300)
    tr, va, te = build_pretraining_datasets(cfg, tok, 8, 1, (50, 10, 5))
    for ds, lo, hi in ((tr, 1, 14), (va, 15, 18), (te, 19, 20)):
        seen = set(np.concatenate([ds[i]["tokens"] for i in range(len(ds))]).tolist()) - {EOD}
        assert seen and min(seen) >= lo and max(seen) <= hi, (lo, hi, seen)
    assert len(tr) >= 50 and len(va) >= 10 and len(te) >= 5
    cfg.split = "1,0,0"
    tr, va, te = build_pretraining_datasets(cfg, tok, 8, 1, (5, 5, 5))
    assert tr is not None and va is None and te is None


# --- blends -----------------------------------------------------------------------------------


def test_parse_blend():
    assert parse_blend(["a"]) == (["a"], [1.0])
    assert parse_blend(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)


def test_blending_indices_track_weights_in_every_prefix():
    w = [0.5, 0.3, 0.2]
    idx, within = blending_indices(w, 1000)
    counts = np.zeros(3)
    for n, d in enumerate(idx):
        assert within[n] == counts[d]  # consecutive samples of each dataset
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(w) * (n + 1)) <= 1.0)
    assert counts.tolist() == [500, 300, 200]


def test_blend_weights_respected_end_to_end(tmp_path):
    a = write_indexed(str(tmp_path / "a"), [np.array([1] * 30 + [EOD])] * 10)
    b = write_indexed(str(tmp_path / "b"), [np.array([2] * 20 + [EOD])] * 10)
    cfg = DataConfig(data_path=["0.7", a, "0.3", b], split="100", tokenizer_type="NullTokenizer")
    tr, va, te = build_pretraining_datasets(cfg, null_tokenizer(300), 16, 3, (400, 0, 0))
    assert isinstance(tr, BlendedDataset) and len(tr) == 400 and va is None
    src = []
    for i in range(len(tr)):
        t = set(tr[i]["tokens"].tolist()) - {EOD}
        assert len(t) == 1  # never mixes sources
        src.append(t.pop())
    assert src.count(1) == 280 and src.count(2) == 120
    # every global batch of 10 holds 7 from a and 3 from b
    for k in range(0, 400, 10):
        assert src[k:k + 10].count(1) == 7


# --- sampler ----------------------------------------------------------------------------------


def global_batches(dataset_len, consumed, mbs, dp, gbs, n_iters):
    """What the training loop sees: per iteration, the indices every rank consumed."""
    iters = [iter(PretrainingSampler(dataset_len, consumed, mbs, r, dp)) for r in range(dp)]
    out = []
    for _ in range(n_iters):
        batch = []
        for _ in range(gbs // (mbs * dp)):
            for it in iters:
                batch.extend(next(it))
        out.append(batch)
    return out


def test_global_batch_is_the_same_set_for_any_dp_and_micro_batch():
    gbs, ref = 8, None
    for dp in (1, 2, 4):
        for mbs in (1, 2, 4):
            if gbs % (mbs * dp):
                continue
            got = [sorted(b) for b in global_batches(1000, 16, mbs, dp, gbs, 5)]
            if ref is None:
                ref = got
            assert got == ref, (dp, mbs)
    assert ref[0] == list(range(16, 24))  # consecutive samples from consumed_samples


def test_rank_slices_are_contiguous_and_disjoint():
    it0 = iter(PretrainingSampler(100, 0, 2, 0, 2))
    it1 = iter(PretrainingSampler(100, 0, 2, 1, 2))
    assert [next(it0), next(it0)] == [[0, 1], [4, 5]]
    assert [next(it1), next(it1)] == [[2, 3], [6, 7]]


def test_sampler_wraps_around_the_dataset():
    it = iter(PretrainingSampler(5, 3, 4, 0, 1))
    assert next(it) == [3, 4, 0, 1]


def test_loader_batches_match_across_layouts_and_resume():
    tok = null_tokenizer(300)
    cfg = DataConfig(mock_data=True)
    tr, _, _ = build_pretraining_datasets(cfg, tok, 8, 5, (100, 10, 10))
    gbs = 8

    def run(dp, mbs, consumed, iters):
        loaders = [iter(build_data_loader(tr, consumed, mbs, r, dp)) for r in range(dp)]
        res = []
        for _ in range(iters):
            rows = []
            for _ in range(gbs // (mbs * dp)):
                for ld in loaders:
                    mb = next(ld)["tokens"]
                    assert mb.dtype == torch.int64 and mb.shape == (mbs, 9)
                    rows.extend(tuple(r) for r in mb.tolist())
            res.append(rows)
        return res

    ref = run(1, 8, 0, 4)
    for dp, mbs in ((2, 2), (4, 1), (2, 4)):
        assert [sorted(b) for b in run(dp, mbs, 0, 4)] == [sorted(b) for b in ref]
    # stop after 2 iterations, resume from consumed_samples = 2 * gbs: the same next batches
    resumed = run(2, 2, 2 * gbs, 2)
    assert [sorted(b) for b in resumed] == [sorted(b) for b in ref[2:]]
    assert build_data_loader(None, 0, 1, 0, 1) is None


def test_loader_with_workers_matches_main_process():
    tok = null_tokenizer(300)
    tr, _, _ = build_pretraining_datasets(DataConfig(mock_data=True), tok, 8, 5,
                                          (40, 0, 0))
    a, b = iter(build_data_loader(tr, 4, 2, 1, 2)), iter(build_data_loader(tr, 4, 2, 1, 2, 1))
    for _ in range(3):
        assert torch.equal(next(a)["tokens"], next(b)["tokens"])


# --- mock data --------------------------------------------------------------------------------


def test_mock_data_is_deterministic_and_in_vocab():
    cfg = DataConfig(mock_data=True, split="9,1,0")
    tok = null_tokenizer(300)
    tr, va, te = build_pretraining_datasets(cfg, tok, 16, 11, (10, 3, 3))
    tr2, _, _ = build_pretraining_datasets(cfg, tok, 16, 11, (10, 3, 3))
    assert te is None and len(tr) == 10 and len(va) == 3
    assert np.array_equal(tr[4]["tokens"], tr2[4]["tokens"])
    assert not np.array_equal(tr[4]["tokens"], tr[5]["tokens"])
    assert not np.array_equal(tr[0]["tokens"], va[0]["tokens"])
    allt = np.concatenate([tr[i]["tokens"] for i in range(10)])
    assert allt.min() >= 0 and allt.max() < 300 and tr[0]["tokens"].shape == (17,)


# --- get_batch --------------------------------------------------------------------------------


def test_get_batch_shifts_masks_and_positions():
    sample = torch.tensor([[5, 6, EOD, 7, 8], [1, EOD, EOD, 2, 3]])
    tokens, labels, mask, pos, docs = get_batch({"tokens": sample}, EOD, eod_mask_loss=False)
    assert tokens.tolist() == [[5, 6, 0, 7], [1, 0, 0, 2]]
    assert labels.tolist() == [[6, 0, 7, 8], [0, 0, 2, 3]]
    assert mask.dtype == torch.float32 and mask.sum().item() == 8
    assert pos is None and docs is None  # positions 0..s-1, one attention span
    _, _, mask, pos, docs = get_batch({"tokens": sample}, EOD, eod_mask_loss=True,
                                      reset_position_ids=True, reset_attention_mask=True)
    assert mask.tolist() == [[1, 1, 0, 1], [1, 0, 0, 1]]
    # a document ends with its EOD; the token after it starts the next one at position 0
    assert pos.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert docs.ids.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]
    assert docs.lengths == ((3, 1), (2, 1, 1)) and docs.cu_seqlens.tolist() == [0, 3, 4, 6, 7, 8]
