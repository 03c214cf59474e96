"""Console lines, metrics.jsonl, W&B and TensorBoard; throughput, TFLOP/s, MFU and memory
(docs/logging.md). One :class:`MetricsLogger` per run, owned by the training loop and handed to
what logs besides it; only global rank 0 writes, and the W&B API key is never read.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from typing import Dict, Optional

import numpy as np
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.linear_attention import CHUNK


def model_flops_per_sequence(cfg: ModelConfig, vocab_size: Optional[int] = None) -> float:
    """Model FLOPs (forward + backward, no recompute) of one sequence from the actual matmul
    shapes, plus :func:`attention_flops` (docs/logging.md, "FLOPs, TFLOP/s and MFU"). MTP's D
    depths are D more layers (numbered L + k, of the last one's kind), output heads and eh_proj."""
    h, L, s = cfg.hidden_size, cfg.num_layers, cfg.seq_length
    V = vocab_size if vocab_size is not None else cfg.vocab_size
    D = cfg.mtp_num_layers or 0

    def mlp(f: int) -> int:  # forward FLOPs per token of an MLP of width f
        return 2 * (h * (2 * f if cfg.swiglu else f) + f * h)

    n_moe = sum(map(cfg.is_moe_layer, range(L + D)))
    moe = 0
    if n_moe:
        shared = cfg.moe_shared_expert_intermediate_size
        moe = (2 * h * cfg.num_experts + cfg.moe_router_topk * mlp(cfg.moe_ffn_hidden_size)
               + (mlp(shared) + (2 * h if cfg.moe_shared_expert_gate else 0) if shared else 0))
    n_lin = sum(map(cfg.is_linear_attention_layer, range(L + D)))
    fwd = (L + D - n_lin) * 2 * cfg.attention_weights() \
        + n_lin * 2 * cfg.linear_attention_weights() \
        + (L + D - n_moe) * mlp(cfg.ffn_hidden_size) + n_moe * moe
    per_token = 3 * (fwd + (1 + D) * 2 * h * V + D * 2 * 2 * h * h)
    return float(per_token * s) + attention_flops(cfg)


def attention_flops(cfg: ModelConfig) -> float:
    """The attention core's FLOPs (forward + backward) for one sequence: min(W, s) keys per query
    under a sliding window of W, no halving for causality; a Gated DeltaNet layer's chunked rule
    instead, per token and value head c(5dk + 3dv) within its chunk of c and 6dk·dv with the
    state (docs/theory.md, "FLOPs and MFU" and "Linear attention"). MTP's depths included."""
    s, (qk, v) = cfg.seq_length, cfg.attention_widths()
    layers = range(cfg.num_layers + (cfg.mtp_num_layers or 0))
    linear = [cfg.is_linear_attention_layer(i) for i in layers]
    keys = sum(min(cfg.attention_window(i) or s, s) for i in layers if not linear[i])
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rule = cfg.linear_num_value_heads * (CHUNK * (5 * dk + 3 * dv) + 6 * dk * dv)
    return float(3 * 2 * (qk + v) * keys * s + 3 * sum(linear) * -(-s // CHUNK) * CHUNK * rule)


def causal_pairs(lengths, window: Optional[int] = None) -> float:
    """The (query, key) pairs a causal mask, within ``window`` keys, leaves in sequences of
    ``lengths``: the first W queries see 1..W keys, the rest W each."""
    lengths = np.asarray(lengths, dtype=np.float64)
    seen = lengths if window is None else np.minimum(lengths, window)
    return float((seen * (seen + 1) / 2 + (lengths - seen) * seen).sum())


def document_attention(cfg: ModelConfig, lengths) -> tuple:
    """What the attention core of samples of packed documents needs (--reset-attention-mask),
    from each sample's document lengths (host ints): (the FLOPs of a sample, forward + backward,
    their share of the causal mask's), each layer (MTP's depths too) within its window
    (docs/logging.md, "Packed documents"). MFU keeps counting :func:`attention_flops`."""
    (qk, v), s = cfg.attention_widths(), cfg.seq_length
    docs = [x for row in lengths for x in row]
    windows = [cfg.attention_window(i) for i in range(cfg.num_layers + (cfg.mtp_num_layers or 0))]
    needed = sum(causal_pairs(docs, w) for w in windows) / len(lengths)
    return 3 * 2 * (qk + v) * needed, needed / sum(causal_pairs([s], w) for w in windows)


# Dense peak FLOP/s per device for 16-bit matmuls (vendor datasheets); fp32 training on these GPUs
# uses TF32 tensor cores, whose dense peak is half the 16-bit one.
_GPU_PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "A100": 312e12, "A800": 312e12, "A10G": 125e12, "A10": 125e12, "L40S": 362e12, "L40": 181e12,
    "L4": 121e12, "V100": 125e12, "T4": 65e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
    "B200": 2250e12, "B100": 1750e12, "MI300X": 1307e12, "MI250X": 383e12,
}


class CpuPeak:
    """Achievable fp32 matmul FLOP/s on this CPU per torch thread count, owned by the training
    loop (docs/logging.md, "FLOPs, TFLOP/s and MFU")."""

    def __init__(self):
        self.best: Dict[int, float] = {}  # threads -> best fp32 matmul FLOP/s seen

    def measure(self, n: int = 1024, tries: int = 5) -> float:
        """The fastest of ``tries`` n x n matmuls, kept only if it beats what was seen (competing
        processes deflate a measurement, never inflate it)."""
        threads = torch.get_num_threads()
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        self.best[threads] = max(self.best.get(threads, 0.0), 2.0 * n ** 3 / best)
        return self.best[threads]

    def current(self) -> float:
        return self.best.get(torch.get_num_threads()) or self.measure()

    def at_least(self, achieved: float) -> float:
        """The peak once a step ran at ``achieved`` FLOP/s, never below it (docs/logging.md)."""
        threads = torch.get_num_threads()
        if achieved > self.best.get(threads, 0.0):
            self.measure()
            self.best[threads] = max(self.best[threads], achieved)
        return self.best[threads]


def peak_flops_per_device(device: torch.device, params_dtype: str = "bfloat16",
                          cpu: Optional[CpuPeak] = None) -> float:
    """The datasheet dense peak of a GPU (NaN for an unknown one, rather than a guess), or the
    CPU's measured one (``cpu``, else a fresh measurement)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(_GPU_PEAK_BF16, key=len, reverse=True):
            if key in name:
                peak = _GPU_PEAK_BF16[key]
                return peak / 2 if params_dtype == "float32" else peak
        return float("nan")
    return (cpu or CpuPeak()).current()


def _json_default(o):
    if torch.is_tensor(o):
        return o.item() if o.numel() == 1 else o.tolist()
    return str(o)


class MetricsLogger:
    """Console + metrics.jsonl + W&B + TensorBoard for one run; only ``is_writer`` writes."""

    def __init__(self, cfg: MegaliteConfig, is_writer: bool, stream=None):
        self.cfg = cfg
        self.is_writer = is_writer
        self.stream = stream or sys.stdout
        self.jsonl = None  # metrics.jsonl's file, opened at the first record
        self.wandb_run = None
        self.tb = None
        if not is_writer:
            return
        lc = cfg.logging
        self.metrics_path = lc.metrics_file or os.path.join(cfg.checkpoint.save or ".",
                                                            "metrics.jsonl")
        if lc.wandb_project:
            import wandb

            save_dir = lc.wandb_save_dir or (os.path.join(cfg.checkpoint.save, "wandb")
                                             if cfg.checkpoint.save else None)
            if save_dir:
                os.makedirs(save_dir, exist_ok=True)
            # wandb reads WANDB_MODE / WANDB_API_KEY itself; megalite never touches the key.
            self.wandb_run = wandb.init(project=lc.wandb_project, name=lc.wandb_exp_name,
                                        dir=save_dir, config=cfg.to_dict())
        if lc.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=lc.tensorboard_dir)

    def print(self, line: str) -> None:
        if self.is_writer:
            print(line, file=self.stream, flush=True)

    def log(self, metrics: dict, step: int, split: Optional[str] = None) -> None:
        """Write one record to every sink. ``split`` prefixes the W&B / TensorBoard names."""
        if not self.is_writer:
            return
        record = {"split": split} if split else {}
        record["iteration"] = int(step)
        record.update(metrics)
        if self.jsonl is None:  # (a run that fails at start-up leaves no empty metrics file)
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            self.jsonl = open(self.metrics_path, "a", buffering=1)  # readers see each record
        self.jsonl.write(json.dumps(record, default=_json_default) + "\n")
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and v is not None and math.isfinite(float(v))}
        prefix = f"{split}/" if split else ""
        if self.wandb_run is not None:
            self.wandb_run.log({prefix + k: v for k, v in scalars.items()}, step=int(step))
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(prefix + k, v, int(step))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def training_log_line(rec: dict, train_iters: int, eta_seconds: float) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [f"[{now}] iteration {rec['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {rec['consumed_samples']:10d}",
             f"elapsed time per iteration (ms): {rec['iteration_time_ms']:.1f}",
             f"learning rate: {rec['lr']:.3E}",
             f"global batch size: {rec['global_batch_size']:5d}",
             f"lm loss: {rec['lm_loss']:.6E}" if rec.get("lm_loss") is not None else "lm loss: nan",
             f"loss scale: {rec['loss_scale']:.1f}"]
    # multi-token prediction's losses, per depth (mtp_1_loss: "mtp_1 loss")
    parts += [f"{k[:-5]} loss: {v:.6E}" for k, v in rec.items() if k.startswith("mtp_")]
    if rec.get("grad_norm") is not None:
        parts.append(f"grad norm: {rec['grad_norm']:.3f}")
    if rec.get("moe_load_balancing_loss") is not None:  # mean over MoE layers; worst layer
        parts.append(f"moe aux loss: {rec['moe_load_balancing_loss']:.4E}")
        parts.append(f"moe imbalance: {rec['moe_max_imbalance']:.2f}")
    if rec.get("tokens_per_sec") is not None:
        parts.append(f"tokens/s: {rec['tokens_per_sec']:.0f}")
        parts.append(f"TFLOP/s/device: {rec['tflops_per_device']:.3f}")
        mfu = rec.get("mfu")
        parts.append(f"MFU: {100 * mfu:.1f}%" if mfu is not None else "MFU: n/a")
    parts.append(f"peak mem: {rec['peak_memory_bytes'] / 2 ** 30:.2f} GiB")
    parts.append(f"skipped: {rec.get('skipped_iterations', 0)}")
    eta = (str(datetime.timedelta(seconds=int(max(eta_seconds, 0))))
           if math.isfinite(eta_seconds) else "?")
    parts.append(f"ETA {eta}")
    return " | ".join(parts)
