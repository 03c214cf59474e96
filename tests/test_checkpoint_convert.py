"""tools/checkpoint/convert.py and megalite/checkpoint/convert.py.

HF models are built locally at random (tests/test_convert_hf.make_hf: large-std weights, so a
misplaced tensor moves the logits far beyond any tolerance); nothing is downloaded.
"""

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import ROOT, TINY
from test_convert_hf import SEQ, VOCAB, make_hf

from megalite.checkpoint import format as ckpt
from megalite.memory import HOST_PEAK_RSS_SUPPORTED
from megalite.checkpoint import convert as ct
from megalite.checkpoint.layout import Layout

sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
import convert as cli  # noqa: E402  (tools/checkpoint/convert.py)


def _load_hf_tensors(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _no_leftovers(path):
    parent, base = os.path.split(str(path))
    return [p for p in os.listdir(parent) if p.startswith(base + ".tmp-")] == []


# ------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("case", ["gpt2", "llama_gqa"])
def test_hf_to_megalite_tp2pp2_to_hf_is_bit_identical(tmp_path, case):
    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ml"), Layout(2, 2))
    it = tmp_path / "ml" / "iter_0000000"
    assert (tmp_path / "ml" / ckpt.TRACKER_FILE).read_text() == "0"
    assert sorted(os.listdir(it)) == ["args.json", "mp_rank_00_000", "mp_rank_00_001",
                                      "mp_rank_01_000", "mp_rank_01_001"]
    args = json.loads((it / "args.json").read_text())
    assert args["parallel"]["tensor_model_parallel_size"] == 2
    assert args["parallel"]["pipeline_model_parallel_size"] == 2
    assert args["model"]["num_layers"] == 2 and args["model"]["vocab_size"] == VOCAB
    # each TP rank holds only its slice
    sd = torch.load(it / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=True)
    m = args["model"]
    qkv_rows = (m["num_attention_heads"] + 2 * m["num_query_groups"]) * m["kv_channels"]
    assert sd["model"]["layers.0.self_attention.linear_qkv.weight"].shape[0] == qkv_rows // 2

    ct.megalite_to_hf(str(tmp_path / "ml"), str(tmp_path / "back"))
    a, b = _load_hf_tensors(tmp_path / "hf"), _load_hf_tensors(tmp_path / "back")
    a = {k: v for k, v in a.items() if not k.endswith(".attn.bias")}
    if hf.config.tie_word_embeddings:
        a.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k

    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


def test_hf_inputs_sharded_safetensors_and_pytorch_bin(tmp_path):
    """A sharded safetensors upload and a pytorch_model.bin both import to the same checkpoint."""
    hf = make_hf("llama_gqa")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (tmp_path / "bin").mkdir()
    hf.config.save_pretrained(tmp_path / "bin")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    ct.hf_to_megalite(str(tmp_path / "sharded"), str(tmp_path / "a"), Layout(1, 2))
    ct.hf_to_megalite(str(tmp_path / "bin"), str(tmp_path / "b"), Layout(1, 2))
    for r in (0, 1):
        name = f"iter_0000000/mp_rank_00_{r:03d}/model_optim_rng.pt"
        x = torch.load(tmp_path / "a" / name, weights_only=True)["model"]
        y = torch.load(tmp_path / "b" / name, weights_only=True)["model"]
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_export_sharded_output_loads_in_transformers(tmp_path):
    hf = make_hf("gpt2")
    hf.save_pretrained(tmp_path / "hf")
    ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ml"), Layout(2, 1))
    ct.megalite_to_hf(str(tmp_path / "ml"), str(tmp_path / "out"), max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


# ------------------------------------------------------------------------ loss parity, 4 ranks
def _stage_loss_worker(rank, world, ckpt_dir, ids):
    """Build this rank's chunks from the checkpoint's args.json, load its shard, run the model
    through the pipeline schedule (forward only) and return the mean token loss."""
    from functools import partial

    from megalite.parallel_state import initialize_model_parallel
    from megalite.pipeline_parallel.partition import build_model_chunks
    from megalite.pipeline_parallel.executor import get_forward_backward_func
    from megalite.training import _forward_step

    cfg = ckpt.read_checkpoint_config(ckpt_dir)
    par = cfg.parallel
    ps = initialize_model_parallel(par.tensor_model_parallel_size,
                                   par.pipeline_model_parallel_size)
    chunks = build_model_chunks(cfg.model, ps, seed=7)  # every weight is overwritten below
    sd = torch.load(os.path.join(ckpt.iteration_dir(ckpt_dir, 0),
                                 ckpt.shard_dir_name(ps.tp_rank, ps.pp_rank), ckpt.MODEL_FILE),
                    weights_only=True)
    for chunk in chunks:
        chunk.load_state_dict(sd["model"])
        chunk.eval()
    tokens, labels = ids[:, :-1], ids[:, 1:]
    mask = torch.ones_like(labels, dtype=torch.float32)
    # one sequence per micro-batch: 1F1B needs at least pp micro-batches
    batch = [(tokens[i:i + 1], labels[i:i + 1], mask[i:i + 1], None, None)
             for i in range(len(ids))]
    fb = get_forward_backward_func(ps.pp_size, None)
    with torch.no_grad():
        stats = fb(forward_step_func=partial(_forward_step, mask.sum()),
                   data_iterator=iter(batch), model=chunks, num_microbatches=len(batch),
                   seq_length=tokens.shape[1], micro_batch_size=1,
                   parallel_state=ps, forward_only=True)
    if not ps.is_pipeline_last_stage:
        return None
    return float(sum(float(s["lm_loss_sum"]) for s in stats) / mask.sum())


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa"])
def test_converted_tp2pp2_checkpoint_gives_hf_loss(tmp_path, case):
    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ml"), Layout(2, 2))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = float(hf(ids, labels=ids).loss)
    losses = run_distributed(_stage_loss_worker, 4, str(tmp_path / "ml"), ids, timeout=240)
    got = [x for x in losses if x is not None]
    assert len(got) == 2  # the two TP ranks of the last stage
    for x in got:
        assert abs(x - ref) <= 1e-4 * max(1.0, abs(ref)), (x, ref)


# ------------------------------------------------------------------ reshard and resume training
def _pretrain_worker(rank, world, argv):
    from megalite.arguments import parse_args
    from megalite.training import pretrain

    return pretrain(parse_args(argv), stream=io.StringIO())["train_losses"]


def _train(argv, nproc):
    return run_distributed(_pretrain_worker, nproc, [str(a) for a in argv], timeout=300)[0]


def _assert_same(got, ref, iters, rel=1e-5):
    for it in iters:
        assert abs(got[it] - ref[it]) <= rel * abs(ref[it]), (it, got[it], ref[it])


BASE = TINY + ["--train-iters", "10", "--eval-iters", "0"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def test_reshard_tp2pp2_to_tp1pp1_and_tp1pp2dp2_resumes_with_same_losses(tmp_path):
    ref = _train(BASE + TP2PP2, 4)
    part = _train(BASE + TP2PP2 + ["--exit-interval", "5", "--save", tmp_path / "a"], 4)
    _assert_same(part, ref, range(1, 6), rel=0)

    ct.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(1, 1))
    args = json.loads((tmp_path / "b" / "iter_0000005" / "args.json").read_text())
    assert args["parallel"]["tensor_model_parallel_size"] == 1
    assert args["parallel"]["pipeline_model_parallel_size"] == 1
    got = _train(BASE + ["--load", tmp_path / "b"], 1)
    assert sorted(got) == list(range(6, 11))
    _assert_same(got, ref, range(6, 11))
    # The optimizer state matters: without it the same weights give different losses, so the
    # equality above cannot come from the weights alone.
    cold = _train(BASE + ["--load", tmp_path / "b", "--no-load-optim"], 1)
    assert max(abs(cold[i] - ref[i]) / abs(ref[i]) for i in range(6, 11)) > 1e-4

    ct.reshard(str(tmp_path / "a"), str(tmp_path / "c"), Layout(1, 2), data_parallel_size=2)
    got = _train(BASE + ["--pipeline-model-parallel-size", "2", "--load", tmp_path / "c"], 4)
    _assert_same(got, ref, range(6, 11))


def test_reshard_zero_optimizer_pp2dp2_to_tp2dp2_and_to_plain(tmp_path):
    """ZeRO-1 per-DP-rank files are read by parameter name and re-split for a new layout."""
    zero = ["--use-distributed-optimizer"]
    src = ["--pipeline-model-parallel-size", "2"] + zero
    ref = _train(BASE + src, 4)
    _train(BASE + src + ["--exit-interval", "5", "--save", tmp_path / "a"], 4)
    assert (tmp_path / "a" / "iter_0000005" / "mp_rank_00_001" / "distrib_optim_dp001.pt").exists()

    ct.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(2, 1), data_parallel_size=2)
    assert (tmp_path / "b" / "iter_0000005" / "mp_rank_01_000" / "distrib_optim_dp001.pt").exists()
    got = _train(BASE + zero + ["--tensor-model-parallel-size", "2", "--load", tmp_path / "b"], 4)
    _assert_same(got, ref, range(6, 11))

    ct.reshard(str(tmp_path / "a"), str(tmp_path / "c"), Layout(1, 1), zero_stage=0)
    sd = torch.load(tmp_path / "c" / "iter_0000005" / "mp_rank_00_000" / "model_optim_rng.pt",
                    weights_only=True)
    assert "optimizer" in sd and sd["optimizer"]["optimizer"]["state"]
    got = _train(BASE + ["--load", tmp_path / "c"], 1)
    _assert_same(got, ref, range(6, 11))


def test_reshard_to_interleaved_layout_keeps_weights(tmp_path):
    """tp=1 pp=1 -> tp=2 pp=2 with 2 virtual stages -> back: every tensor survives bit for bit."""
    hf = make_hf("llama_gqa")
    hf.config.num_hidden_layers = 4
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf.config)
    hf.save_pretrained(tmp_path / "hf")
    ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "a"), Layout(1, 1))
    ct.reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(2, 2, 1))
    sd = torch.load(tmp_path / "b" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt",
                    weights_only=True)
    assert sd["num_model_chunks"] == 2
    # chunk c of rank r is virtual stage c*p + r (Megatron's assignment): rank 1 has layers 1, 3
    assert {k.split(".")[1] for k in sd["model0"] if k.startswith("layers.")} == {"1"}
    assert {k.split(".")[1] for k in sd["model1"] if k.startswith("layers.")} == {"3"}
    assert "output_layer.weight" in sd["model1"]
    args = json.loads((tmp_path / "b" / "iter_0000000" / "args.json").read_text())
    assert args["parallel"]["virtual_pipeline_model_parallel_size"] == 2
    ct.reshard(str(tmp_path / "b"), str(tmp_path / "c"), Layout(1, 1))
    x = torch.load(tmp_path / "a" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt",
                   weights_only=True)["model"]
    y = torch.load(tmp_path / "c" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt",
                   weights_only=True)["model"]
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


# --------------------------------------------------------------------------- generation parity
def test_generate_on_export_and_on_checkpoint_agree(tmp_path):
    """tools/generate.py greedy on the megalite checkpoint == transformers greedy on the export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from megalite.data.tokenizer import train_bpe

    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 50
    tok = train_bpe(iter(text), 300)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64,
                                    vocab_size=len(tok.hf), resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(str(tmp_path / "hf"))
    ct.hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ml"), Layout(2, 2))
    assert (tmp_path / "ml" / "tokenizer" / "tokenizer.json").exists()
    ct.reshard(str(tmp_path / "ml"), str(tmp_path / "ml1"), Layout(1, 1))
    ct.megalite_to_hf(str(tmp_path / "ml"), str(tmp_path / "out"))

    prompt = "def add("
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load",
                        str(tmp_path / "ml1"), "--prompt", prompt, "--max-new-tokens", "12",
                        "--greedy"], capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    ours = r.stdout.rstrip("\n")

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    t = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ids = torch.tensor([t.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=12, do_sample=False,
                             eos_token_id=t.eos_token_id, pad_token_id=t.eos_token_id)
    theirs = t.decode(gen[0].tolist(), skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)
    assert len(gen[0]) > ids.shape[1]
    assert ours == theirs


# ------------------------------------------------------------------------------------- errors
def _cli(capsys, *argv):
    capsys.readouterr()  # drop what the test's own set-up printed
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return rc, err


def _assert_one_line_error(rc, err, out_path, *needles):
    assert rc != 0
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("convert.py: error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not os.path.exists(out_path)
    assert _no_leftovers(out_path)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A llama_gqa HF dir (8 heads, 4 query groups, 2 layers) and its tp=1 pp=1 import."""
    d = tmp_path_factory.mktemp("imported")
    make_hf("llama_gqa").save_pretrained(d / "hf")
    ct.hf_to_megalite(str(d / "hf"), str(d / "ml"), Layout(1, 1))
    return d


def test_error_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    rc, err = _cli(capsys, "hf-to-megalite", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "o")
    _assert_one_line_error(rc, err, tmp_path / "o", "unsupported", "BertForMaskedLM")


def test_error_missing_files(tmp_path, capsys, imported):
    (tmp_path / "hf").mkdir()
    make_hf("gpt2").config.save_pretrained(tmp_path / "hf")  # config.json but no weights
    rc, err = _cli(capsys, "hf-to-megalite", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "o")
    _assert_one_line_error(rc, err, tmp_path / "o", "no weights")

    rc, err = _cli(capsys, "hf-to-megalite", "--hf-dir", tmp_path / "nope", "--save",
                   tmp_path / "o")
    _assert_one_line_error(rc, err, tmp_path / "o", "no such directory")

    # a megalite checkpoint with one shard file gone
    import shutil

    shutil.copytree(imported / "ml", tmp_path / "ml")
    ct.reshard(str(tmp_path / "ml"), str(tmp_path / "ml2"), Layout(2, 2))
    os.remove(tmp_path / "ml2" / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt")
    for cmd in (["megalite-to-hf"], ["reshard", "--tensor-model-parallel-size", "1",
                                     "--pipeline-model-parallel-size", "1"]):
        rc, err = _cli(capsys, *cmd, "--load", tmp_path / "ml2", "--save", tmp_path / "o")
        _assert_one_line_error(rc, err, tmp_path / "o", "mp_rank_01_001", "missing")


def test_error_mismatched_shapes(tmp_path, capsys):
    hf = make_hf("llama_gqa")
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["intermediate_size"] = 64  # the weights have 48
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, "hf-to-megalite", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "o",
                   "--tensor-model-parallel-size", "2")
    _assert_one_line_error(rc, err, tmp_path / "o", "shape")

    cfg["intermediate_size"] = 48
    cfg["num_hidden_layers"] = 1  # the weights have 2 layers
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, "hf-to-megalite", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "o")
    _assert_one_line_error(rc, err, tmp_path / "o", "map to nothing", "layers.1")


@pytest.mark.parametrize("flags,needle", [
    (["--tensor-model-parallel-size", "3"], "--num-attention-heads (8) must be divisible by "
                                            "--tensor-model-parallel-size (3)"),
    (["--tensor-model-parallel-size", "8"], "--num-query-groups (4) must be divisible by "
                                            "--tensor-model-parallel-size (8)"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "--num-layers (2) must be divisible by --num-layers-per-virtual-pipeline-stage (2) x "
     "--pipeline-model-parallel-size (2)"),
    (["--pipeline-model-parallel-size", "3"], "exceeds --num-layers (2)"),
])
def test_error_impossible_target_layout(tmp_path, capsys, imported, flags, needle):
    rc, err = _cli(capsys, "hf-to-megalite", "--hf-dir", imported / "hf", "--save",
                   tmp_path / "o", *flags)
    _assert_one_line_error(rc, err, tmp_path / "o", needle)
    if "--tensor-model-parallel-size" not in flags:
        flags = flags + ["--tensor-model-parallel-size", "1"]
    if "--pipeline-model-parallel-size" not in flags:
        flags = flags + ["--pipeline-model-parallel-size", "1"]
    rc, err = _cli(capsys, "reshard", "--load", imported / "ml", "--save", tmp_path / "o", *flags)
    _assert_one_line_error(rc, err, tmp_path / "o", needle)


def test_error_existing_output_and_no_optimizer_state(tmp_path, capsys, imported):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    rc, err = _cli(capsys, "megalite-to-hf", "--load", imported / "ml", "--save", tmp_path / "o")
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "already exists" in err
    assert os.listdir(tmp_path / "o") == ["keep.txt"] and _no_leftovers(tmp_path / "o")

    ct.reshard(str(imported / "ml"), str(tmp_path / "w"), Layout(1, 1), no_optim=True)
    rc, err = _cli(capsys, "reshard", "--load", tmp_path / "w", "--save", tmp_path / "o2",
                   "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1")
    _assert_one_line_error(rc, err, tmp_path / "o2", "--no-optim")


def test_help_shows_an_example_for_each_command(capsys):
    for cmd in ("hf-to-megalite", "megalite-to-hf", "reshard"):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "example:" in out and f"convert.py {cmd} " in out
    rc, err = _cli(capsys, "reshard", "--load", "x")
    assert rc == 2 and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ streaming memory
_MEASURE = r"""
import json, os, shutil, sys, tempfile
sys.path.insert(0, {root!r})
from megalite.checkpoint import convert as ct
from megalite.checkpoint.layout import Layout
from megalite.memory import host_rss_bytes, reset_host_peak_rss

def run(src, dst, pp):
    if {cmd!r} == "reshard":
        ct.reshard(src, dst, Layout({tp}, pp))
    else:
        ct.megalite_to_hf(src, dst, max_shard_bytes={shard})

w = tempfile.mkdtemp()
run({tiny!r}, os.path.join(w, "x"), 2)  # warm-up: imports and caches are not what is measured
shutil.rmtree(w)
base = reset_host_peak_rss()
run({src!r}, {dst!r}, {pp})
print(json.dumps({{"growth": host_rss_bytes("VmHWM") - base}}))
"""


def _start_peak_growth(cmd, src, dst, tiny, tp=1, pp=1, shard=2 << 30):
    """Start measuring in a fresh process (its own peak RSS); :func:`_peak_growth` reads it."""
    code = _MEASURE.format(root=ROOT, cmd=cmd, tp=tp, pp=pp, shard=shard, tiny=str(tiny),
                           src=str(src), dst=str(dst))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _peak_growth(proc) -> int:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])["growth"]


def _dir_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(d) for f in fs)


@pytest.mark.skipif(not HOST_PEAK_RSS_SUPPORTED, reason="needs Linux /proc")
def test_streaming_peak_memory_is_one_stage_not_the_model(tmp_path):
    """24 layers: resharding to pp=8 and exporting in small shards grow the peak RSS by a fraction
    of the checkpoint, where loading it whole would take all of it (docs: measured figures)."""
    from pretrain_utils import flags, run_main

    assert run_main(flags(train_iters=1, save=tmp_path / "tiny", eval_iters=0)) == 0
    assert run_main(flags("--num-layers", "24", "--hidden-size", "128", train_iters=1,
                          save=tmp_path / "big", eval_iters=0)) == 0
    size = _dir_bytes(tmp_path / "big" / "iter_0000001")  # weights + Adam moments
    assert size > 40e6
    # both at once: each process measures its own peak
    reshard = _start_peak_growth("reshard", tmp_path / "big", tmp_path / "pp8", tmp_path / "tiny",
                                 tp=1, pp=8)
    export = _start_peak_growth("export", tmp_path / "big", tmp_path / "hf", tmp_path / "tiny",
                                shard=2 << 20)
    growth, export_growth = _peak_growth(reshard), _peak_growth(export)
    print(f"reshard to pp=8: peak RSS growth {growth / 2**20:.1f} MiB, checkpoint "
          f"{size / 2**20:.1f} MiB")
    assert growth < 0.3 * size, (growth, size)  # one stage (1/8) + one layer + slack
    growth = export_growth
    print(f"export in 2 MiB shards: peak RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 0.2 * size, (growth, size)  # one 2 MB output shard + one layer + slack


def test_stage_files_hold_only_their_own_tensors(tmp_path, imported):
    """The converter writes each stage file with torch.save of tensors that own exactly their
    bytes: a TP slice is never saved with the whole tensor's storage behind it, so the files of
    tp=2 hold the weights once between them, as a trainer's own save does."""
    ct.reshard(str(imported / "ml"), str(tmp_path / "tp2"), Layout(2, 1), no_optim=True)
    for path in sorted((tmp_path / "tp2" / "iter_0000000").glob("mp_rank_*/*.pt")):
        sd = torch.load(path, weights_only=True)
        for k, t in sd["model"].items():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (path, k)
