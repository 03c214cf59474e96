"""Packed documents against Hugging Face: HF builds its block-causal mask from position ids that
restart (transformers' masking_utils.find_packed_sequence_indices, used when the call has no
attention mask and no cache); megalite takes the same batch through get_batch with
--reset-position-ids and --reset-attention-mask. Both must give the same logits (docs/data.md,
"Packed documents")."""

import numpy as np
import pytest
import torch

from test_convert_hf import SEQ, TOL, VOCAB, make_hf, max_abs

from megalite.convert import from_hf
from megalite.data.batch import get_batch

EOD = VOCAB - 1
# per sample, the documents' lengths (each ending with its EOD): 3 and 4 documents, the
# boundaries at different places, the last document cut by the sample's end (no EOD)
LENGTHS = [(5, 4, 8), (3, 6, 2, 6)]


def _packed_batch():
    """[2, SEQ + 1] tokens (get_batch's input): random non-EOD tokens, EOD at each document's
    last token."""
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, EOD, (len(LENGTHS), SEQ + 1), generator=gen)
    for row, lengths in zip(data, LENGTHS):
        assert sum(lengths) == SEQ + 1
        row[np.cumsum(lengths)[:-1] - 1] = EOD
    return data


@pytest.mark.parametrize("case", ["llama_gqa", "qwen3_untied_headdim"])
def test_packed_batch_logits_match_hf(case):
    hf = make_hf(case)
    ml = from_hf(hf, make_vocab_size_divisible_by=8)
    tokens, _, _, positions, documents = get_batch(_packed_batch(), EOD, False,
                                                   reset_position_ids=True,
                                                   reset_attention_mask=True)
    assert documents.lengths == ((5, 4, 7), (3, 6, 2, 5))  # the last cut by the sample's end
    with torch.no_grad():
        got = ml(tokens, position_ids=positions, documents=documents)
        ref = hf(tokens, position_ids=positions, use_cache=False).logits
        # plain positions 0..s-1: HF sees one sequence per sample, the sample-wide causal mask
        plain = hf(tokens, position_ids=torch.arange(SEQ).expand_as(tokens),
                   use_cache=False).logits
    assert ref.abs().max().item() > 1.0  # the comparison is not between near-zero logits
    assert max_abs(got, ref) <= TOL, case
    # HF did mask by document: its packed logits differ from its sample-wide causal ones after
    # the first document, and equal them within it
    first = min(x[0] for x in documents.lengths)
    assert max_abs(plain[:, :first], ref[:, :first]) <= TOL
    assert max_abs(plain, ref) > 1e-2
    # megalite without the flags is the sample-wide causal model too
    with torch.no_grad():
        assert max_abs(ml(tokens), plain) <= TOL
