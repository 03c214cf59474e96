"""metrics.jsonl, W&B (offline) and TensorBoard get what the run logs; FLOPs as docs/theory.md."""

import glob
import json
import os
import struct

import numpy as np
import pytest
import torch

from model_utils import tiny_config
from pretrain_utils import flags, read_metrics, run_main

from megalite.config import ModelConfig
from megalite import logging as mlog
from megalite.logging import model_flops_per_sequence
from megalite.masks import Documents

REQUIRED = {"iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device",
            "mfu", "peak_memory_bytes", "consumed_samples", "loss_scale"}


def read_wandb_records(path):
    """Records of an offline .wandb file (W&B's LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer too short for a header: skip to the next block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 2:  # first fragment
            buf = payload
            continue
        if kind == 3:  # middle fragment
            buf += payload
            continue
        rec = pb.Record()
        rec.ParseFromString(buf + payload if kind == 4 else payload)
        out.append(rec)
    return out


def test_metrics_wandb_offline_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "ck"
    argv = [f for f in flags(train_iters=6, eval_interval=3, save=save,
                             wandb_project="megalite-test", wandb_exp_name="tiny",
                             wandb_save_dir=tmp_path / "wb", tensorboard_dir=tmp_path / "tb")
            if f != "--no-log-throughput"] + ["--fp16", "--initial-loss-scale", "1024"]
    assert run_main(argv) == 0
    # metrics.jsonl defaults to --save and holds every logged iteration with the required fields
    train = read_metrics(str(save / "metrics.jsonl"))
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        missing = REQUIRED - set(r)
        assert not missing, missing
        assert r["tokens_per_sec"] > 0 and r["peak_memory_bytes"] > 0 and r["loss_scale"] > 0
        assert 0 < r["mfu"] <= 1 and r["peak_tflops_per_device"] >= r["tflops_per_device"]
    valid = read_metrics(str(save / "metrics.jsonl"), split="valid")
    assert [r["iteration"] for r in valid] == [3, 6]
    assert all(r["ppl"] == pytest.approx(2.718281828 ** r["lm_loss"], rel=1e-6) for r in valid)

    # W&B: the offline run holds the same losses and the config
    files = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    history, config = {}, {}
    for rec in read_wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in rec.history.item}
            history[row["_step"]] = row
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    for r in train:
        assert history[r["iteration"]]["train/lm_loss"] == pytest.approx(r["lm_loss"], rel=1e-12)
        assert "train/tokens_per_sec" in history[r["iteration"]]
    assert history[3]["valid/lm_loss"] == pytest.approx(valid[0]["lm_loss"])
    model_cfg = config["model"]["value"] if "value" in config.get("model", {}) else config["model"]
    assert model_cfg["hidden_size"] == 32

    # TensorBoard: an event file with the training loss
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    steps = [e.step for e in ev.Scalars("train/lm_loss")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_log_interval_and_metrics_file_locations(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "sub" / "m.jsonl"
    assert run_main(flags(train_iters=4, log_interval=2, metrics_file=path)) == 0
    assert [r["iteration"] for r in read_metrics(str(path))] == [2, 4]
    assert not os.path.exists("metrics.jsonl")  # --metrics-file overrides the default
    assert run_main(flags(train_iters=2)) == 0  # no --save: the working directory
    assert [r["iteration"] for r in read_metrics("metrics.jsonl")] == [1, 2]


def test_interval_time_is_training_time_only(tmp_path, monkeypatch):
    """iteration_time_ms averages the steps of the log interval: an evaluation or a save between
    log lines is paused out (as Megatron-LM). On a fake clock: each step takes 1 s, 0.25 s of
    it queueing forward-backward (host_queue_ms_per_iteration), each evaluation and save 1000 s."""
    import time as real_time

    from megalite import training

    clock = [0.0]
    monkeypatch.setattr(training, "time", type("FakeTime", (), {
        "perf_counter": staticmethod(lambda: clock[0]), "time": staticmethod(real_time.time)}))
    for name, seconds in (("train_step", 0.75), ("_forward_backward", 0.25),
                          ("_evaluate_and_log", 1000.0), ("_save", 1000.0)):
        def slow(self, *a, _real=getattr(training.Trainer, name), _s=seconds, **k):
            clock[0] += _s
            return _real(self, *a, **k)
        monkeypatch.setattr(training.Trainer, name, slow)
    path = tmp_path / "m.jsonl"
    assert run_main(flags(train_iters=8, log_interval=4, eval_interval=2, eval_iters=1,
                          save=tmp_path / "ckpt", save_interval=3, metrics_file=path)) == 0
    assert [r["iteration_time_ms"] for r in read_metrics(str(path))] == [1000.0, 1000.0]
    assert [r["host_queue_ms_per_iteration"] for r in read_metrics(str(path))] == [250.0, 250.0]


def test_model_flops_match_theory_for_gpt2_shapes():
    """docs/theory.md: 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) per iteration of B sequences."""
    cfg = ModelConfig(num_layers=6, hidden_size=384, num_attention_heads=6, seq_length=256,
                      vocab_size=8192)
    L, h, s, V = 6, 384, 256, 8192
    theory = 72 * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert model_flops_per_sequence(cfg) == pytest.approx(theory, rel=1e-12)
    # GQA shrinks the K/V projections, SwiGLU adds a third MLP matrix
    gqa = ModelConfig(num_layers=6, hidden_size=384, num_attention_heads=6, num_query_groups=2,
                      seq_length=256, vocab_size=8192)
    assert model_flops_per_sequence(gqa) < theory
    swiglu = ModelConfig(num_layers=6, hidden_size=384, num_attention_heads=6, swiglu=True,
                         ffn_hidden_size=1024, seq_length=256, vocab_size=8192)
    per_token_mlp = 3 * 2 * 3 * 384 * 1024  # three h x f matrices, fwd + bwd
    assert model_flops_per_sequence(swiglu) > per_token_mlp * L * s


def test_other_components_log_through_the_logger_they_are_handed(tmp_path):
    """No module-level logger: the pipeline timeline's record goes to the MetricsLogger its
    caller hands it, and without one it is only returned."""
    from megalite.config import MegaliteConfig
    from megalite.logging import MetricsLogger
    from megalite.parallel_state import ParallelState
    from megalite.pipeline_parallel.timeline import StageTimeline, log_pipeline_step

    cfg = MegaliteConfig()
    cfg.logging.metrics_file = str(tmp_path / "m.jsonl")
    tl = StageTimeline("1f1b", 0, 1, 2)
    tl.record("F", 0, 0, 0.0, 1.0)
    logger = MetricsLogger(cfg, is_writer=True)
    try:
        rec = log_pipeline_step(tl, ParallelState(), 7, None, logger)
    finally:
        logger.close()
    assert log_pipeline_step(tl, ParallelState(), 8, None) is not None  # returned, not written
    (line,) = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert line["split"] == "pipeline" and line["iteration"] == 7
    assert line["bubble_fraction"] == rec["bubble_fraction"] == 0.0


def test_cpu_peak_rises_to_a_faster_step():
    """A deflated CPU peak (a busy moment) is re-measured, then raised to the step's own rate."""
    import torch

    cpu = mlog.CpuPeak()  # owned by its caller: no process-wide cache
    cpu.best[torch.get_num_threads()] = 1.0
    peak = mlog.peak_flops_per_device(torch.device("cpu"), "float32", cpu)
    assert peak == 1.0  # the cached, deflated measurement
    measured = cpu.measure(n=64, tries=1)
    assert measured > 1.0  # a new measurement raises the peak...
    assert cpu.at_least(measured / 2) == measured  # ...a slower step leaves it alone
    assert cpu.at_least(1e18) == 1e18  # a step beyond any measurement sets it


@pytest.mark.parametrize("window", [None, 3])
def test_document_attention_counts_the_pairs_of_the_document_mask(window):
    """The attention the documents need (metrics.jsonl's attention_tflops_needed and
    document_attention_fraction): the (query, key) pairs the document mask leaves (the mask
    itself, counted), 6 (q·k + v) FLOPs each over the layers, against the causal mask's."""
    cfg = tiny_config("llama", sliding_window=window)  # every layer within the window
    lengths = [(5, 4, 7), (16,)]
    pos = np.arange(16)
    docs = Documents.of(np.stack([np.repeat(np.arange(len(x)), x) for x in lengths]))
    pairs = int(docs.mask(torch.from_numpy(pos), torch.from_numpy(pos), window).sum())
    causal = int(Documents.of(np.zeros((1, 16), int)).mask(
        torch.from_numpy(pos), torch.from_numpy(pos), window).sum())
    flops, fraction = mlog.document_attention(cfg, lengths)
    qk, v = cfg.attention_widths()
    assert flops == pytest.approx(6 * (qk + v) * cfg.num_layers * pairs / 2)
    assert fraction == pytest.approx(pairs / 2 / causal) and fraction < 1
