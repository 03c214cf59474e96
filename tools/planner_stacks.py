"""What other training stacks do that megalite does not, as planner inputs for their published rows.

megalite/planner.py models megalite's own layers. The published rows the planner is validated on
ran other stacks (docs/planner.md, "Validation"), and each row takes what its stack did:

* ``cross_entropy="megatron"``: Megatron-LM's unfused vocab-parallel cross entropy, the
  Narayanan et al. and Megatron-Core rows (tests/test_planner.py's PUBLISHED);
* ``activation_model="fused"``: each tensor of a layer saved once in 16 bits (Transformer
  Engine's, Meta's layers), the Llama 3 405B rows (without it the published layout does not fit)
  and the MoE rows (benchmarks/planner_moe.py);
* ``embedding_slot``/``loss_slot``: the embedding and the loss each take a layer's slot of the
  pipeline split (Megatron-LM's --account-for-embedding/loss-in-pipeline-split), Llama 3 405B and
  Qwen3-235B;
* ``precision="fp8"``: the linear GEMMs at twice the 16-bit peak and FP8_GEMM_EFFICIENCY, the
  Qwen3 MoE rows (fit set and held out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megalite.config import ConfigError
from megalite.config import V_SCHEDULES
from megalite.pipeline_parallel.partition import virtual_layer_ranges
from megalite.planner import GPU, Layout, Model, _router_bytes, moe_rows

# fp8 linear GEMMs: of twice the 16-bit peak, with the per-tensor scaling and casts; 0.45 x 2 =
# 1.41x the 16-bit GEMM at 0.64 (docs/planner.md, "Constants and where they come from")
FP8_GEMM_EFFICIENCY = 0.45


@functools.lru_cache(maxsize=4096)
def _slot_ranges(L: int, p: int, v: int, v_shape: bool, first, last, emb: bool,
                 loss: bool) -> tuple:
    """virtual_layer_ranges over L + emb + loss slots: slot 0 the embedding's, the last the loss
    head's (p > 1), each taken out of the layers it would have held."""
    e, n = (emb and p > 1), L + (emb and p > 1) + (loss and p > 1)
    if n != L and (first is not None or last is not None):
        raise ConfigError("the embedding/loss pipeline slots cannot be combined with "
                          "--decoder-first/last-pipeline-num-layers")
    return tuple(tuple(range(max(s - e, 0), min(x - e, L)) for s, x in rank)
                 for rank in virtual_layer_ranges(
                     n, p, n // (p * v) if v > 1 and not v_shape else None, first, last, v_shape))


@dataclass
class Stack(Model):
    """A planner.Model of another stack: each field one of its differences (defaults: megalite's)."""
    cross_entropy: str = "megalite"  # megalite | megatron
    activation_model: str = "megalite"  # megalite | fused
    embedding_slot: bool = False
    loss_slot: bool = False
    precision: str = "bf16"  # bf16 | fp8
    loss_chunk_tokens: int = 0  # the published rows' stacks made their logits whole

    def pipeline_slots(self, p: int) -> int:
        return self.cfg.num_layers + (p > 1) * (self.embedding_slot + self.loss_slot)

    def stage_ranges(self, lay: Layout) -> tuple:
        return _slot_ranges(self.cfg.num_layers, lay.pipeline_model_parallel_size,
                            lay.virtual_pipeline_model_parallel_size,
                            lay.pipeline_schedule in V_SCHEDULES,
                            lay.decoder_first_pipeline_num_layers,
                            lay.decoder_last_pipeline_num_layers, self.embedding_slot,
                            self.loss_slot)

    def saved_per_token(self, recompute: str) -> tuple:
        if self.activation_model != "fused":
            return super().saved_per_token(recompute)
        # Korthikanti et al.'s Table 2 terms: no fp32 norm copy, no GQA or RoPE copies; SwiGLU's
        # fc1 output and product (its silu recomputed in the kernel)
        cfg = self.cfg
        q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
        return 0, 2 * q + 2 * kv, (3 if cfg.swiglu else 2) * cfg.ffn_hidden_size

    def moe_activation_bytes(self, tokens: float, ep: int, etp: int) -> float:
        if self.activation_model != "fused":
            return super().moe_activation_bytes(tokens, ep, etp)
        # the router's logits (its dtype), probabilities (fp32) and routing map (bool); per
        # received row the expert input, fc1 output and activation, an int32 row map; per sent
        # row the expert output to combine
        cfg, E = self.cfg, self.bytes_per_value
        h, n_exp, fs = cfg.hidden_size, cfg.num_experts, cfg.moe_shared_expert_intermediate_size
        sent, recv = moe_rows(self, tokens, ep)
        act = (3 if cfg.swiglu else 2) * cfg.moe_ffn_hidden_size / etp
        return tokens * n_exp * (_router_bytes(cfg) + 4 + 1) + etp * recv * ((h + act) * E + 4) \
            + sent * (h * E + 4) + (tokens * 3 * fs * E if fs else 0.0)

    def cross_entropy_bytes(self, n: float, vt: float) -> tuple:
        if self.cross_entropy != "megatron":
            return super().cross_entropy_bytes(n, vt)
        # logits upcast to fp32, kept as the softmax, then made the gradient in place and cast
        # back; ~10 fp32 passes moved per logit
        E = self.bytes_per_value
        return n * vt * (4 + E), 48 + 2 * E

    def linear_gemms(self, gpu: GPU) -> tuple:
        if self.precision != "fp8":
            return super().linear_gemms(gpu)
        # attention core, router and output layer stay in 16 bits, as the FP8 recipes keep them;
        # a cast of each expert GEMM's input forward and of its output gradient backward
        return gpu._replace(peak_tflops=2 * gpu.peak_tflops,
                            gemm_efficiency=FP8_GEMM_EFFICIENCY), 2
