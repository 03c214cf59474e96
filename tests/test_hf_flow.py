"""HF -> convert.py hf-to-megalite -> pretrain.py --load --use-checkpoint-args --data-path ->
convert.py megalite-to-hf -> AutoModelForCausalLM, with no model or tokenizer flag anywhere.

The HF models (tiny random Llama, Llama 3.1 with llama3 RoPE scaling, Qwen2, Qwen3, Mistral) and
the tokenizer (a BPE trained on the test's own text) are built locally. Each model goes back as its
own class with its options (windows, scaling, head dim) carried by args.json. The model's vocabulary is 24 rows larger than the tokenizer's, as padded
vocabularies are: those rows are never predicted (masked out of the softmax like the TP padding),
so they get no gradient, and with weight decay off training leaves them exactly as imported (which
also needs this run's --weight-decay to win over the imported optimizer state's), while the rows
the tokenizer produces move.
"""

import os
import sys

import pytest
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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps over "
                            f"{'lazy' if i % 3 else 'busy'} dogs\n" for i in range(400)))
    return text, _tokenizer(str(text))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
# HF class prefix -> config options; the training runs use sequences of 32 tokens, longer than
# the windows (8) and than the llama3 model's original context (8).
FAMILIES = {
    "llama": ("Llama", {}),
    "llama3": ("Llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                        "tie_word_embeddings": True}),
    "qwen3": ("Qwen3", {"head_dim": 16}),
    "mistral": ("Mistral", {"sliding_window": 8}),
    "mistral_no_window": ("Mistral", {"sliding_window": None, "tie_word_embeddings": True}),
}


def _hf_model(family: str, vocab: int, eos=None, layers: int = 2):
    import transformers

    name, extra = FAMILIES[family]
    torch.manual_seed(0)
    kw = dict(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=64, vocab_size=vocab,
              max_position_embeddings=32, eos_token_id=eos, bos_token_id=None,
              tie_word_embeddings=False)
    config = getattr(transformers, name + "Config")(**{**kw, **extra})
    return getattr(transformers, name + "ForCausalLM")(config)


def _assert_same_options(got, ref):
    for field in ("sliding_window", "layer_types", "rope_parameters", "tie_word_embeddings"):
        assert getattr(got, field, None) == getattr(ref, field, None), field
    head_dim = [getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
                for c in (got, ref)]  # Qwen2's config has no head_dim field
    assert head_dim[0] == head_dim[1]


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_hf_to_megalite_to_hf_needs_no_model_or_tokenizer_flags(tmp_path, corpus, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text, tok = corpus
    vocab = len(tok) + EXTRA_ROWS
    hf = _hf_model(family, vocab, tok.eos_token_id)
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
    assert type(back) is type(hf) and back.config.vocab_size == vocab
    _assert_same_options(back.config, hf.config)
    # the tokenizer travelled: out/ loads as the HF directory does (AutoTokenizer may pick the
    # family's own class, e.g. Qwen2Tokenizer, from config.json)
    n = len(AutoTokenizer.from_pretrained(out))
    assert n == len(AutoTokenizer.from_pretrained(tmp_path / "hf")) >= len(tok)
    for name in ("lm_head.weight", "model.embed_tokens.weight")[hf.config.tie_word_embeddings:]:
        before, after = hf.state_dict()[name], back.state_dict()[name]
        assert not torch.allclose(after[:n], before[:n], rtol=1e-3), f"{name}: trained rows"
        assert torch.equal(after[n:], before[n:]), f"{name}: rows the tokenizer never produces"


# (family, convert.py layout flags): every family through a TP, PP or virtual-stage layout
ROUND_TRIPS = {
    "qwen2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "qwen3": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
              "1"],
    "mistral": ["--tensor-model-parallel-size", "2"],
    "mistral_no_window": ["--pipeline-model-parallel-size", "4"],
    "llama3": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1"],
}


@pytest.mark.parametrize("family", list(ROUND_TRIPS))
def test_round_trip_through_a_layout_is_bit_identical(tmp_path, family):
    """HF (sharded safetensors) -> megalite in a TP/PP/VPP layout -> HF: the same class, config
    options and every tensor bit for bit."""
    from transformers import AutoModelForCausalLM

    hf = _hf_model(family, 100, layers=4)
    with torch.no_grad():
        for p in hf.parameters():  # norms too, so a swapped or dropped tensor shows
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ml, out = str(tmp_path / "ml"), str(tmp_path / "out")
    assert convert_cli.main(["hf-to-megalite", "--hf-dir", str(tmp_path / "hf"), "--save", ml]
                            + ROUND_TRIPS[family]) == 0
    assert convert_cli.main(["megalite-to-hf", "--load", ml, "--save", out]) == 0
    back = AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(hf)
    _assert_same_options(back.config, hf.config)
    ref, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_unsupported_hf_option_is_refused_by_the_converter(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=50, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    ).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    assert convert_cli.main(["hf-to-megalite", "--hf-dir", str(tmp_path / "hf"),
                             "--save", str(tmp_path / "ml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "rope type 'dynamic' is not supported" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ml").exists()
