"""HF -> convert.py hf-to-megalite -> pretrain.py --load --use-checkpoint-args --data-path ->
convert.py megalite-to-hf -> AutoModelForCausalLM, with no model or tokenizer flag anywhere.

The HF model (a tiny random Llama) and its tokenizer (a BPE trained on the test's own text) are
built locally. The model's vocabulary is 24 rows larger than the tokenizer's, as padded
vocabularies are: those rows are never predicted (masked out of the softmax like the TP padding),
so they get no gradient, and with weight decay off training leaves them exactly as imported (which
also needs this run's --weight-decay to win over the imported optimizer state's), while the rows
the tokenizer produces move.
"""

import os
import sys

import torch

from pretrain_utils import ROOT, run_main

sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
import convert as convert_cli  # noqa: E402  (tools/checkpoint/convert.py)

EXTRA_ROWS = 24


def _tokenizer(text_file: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train([text_file], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")


def test_hf_to_megalite_to_hf_needs_no_model_or_tokenizer_flags(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps over "
                            f"{'lazy' if i % 3 else 'busy'} dogs\n" for i in range(400)))
    tok = _tokenizer(str(text))
    vocab = len(tok) + EXTRA_ROWS
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=vocab, max_position_embeddings=32,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")

    imported, trained, out = (str(tmp_path / d) for d in ("imported", "trained", "out"))
    assert convert_cli.main(["hf-to-megalite", "--hf-dir", str(tmp_path / "hf"),
                             "--save", imported]) == 0
    assert run_main(["--load", imported, "--use-checkpoint-args", "--data-path", str(text),
                     "--save", trained, "--train-iters", "4", "--micro-batch-size", "2",
                     "--lr", "1e-2", "--lr-warmup-iters", "1", "--weight-decay", "0",
                     "--eval-iters", "1", "--log-interval", "1", "--no-log-throughput"]) == 0
    assert convert_cli.main(["megalite-to-hf", "--load", trained, "--save", out]) == 0

    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.config.vocab_size == vocab
    assert len(AutoTokenizer.from_pretrained(out)) == len(tok)
    n = len(tok)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        before, after = hf.state_dict()[name], back.state_dict()[name]
        assert not torch.allclose(after[:n], before[:n], rtol=1e-3), f"{name}: trained rows"
        assert torch.equal(after[n:], before[n:]), f"{name}: rows the tokenizer never produces"
