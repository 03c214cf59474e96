"""GPTModel: embedding -> transformer layers -> final norm -> output layer (-> loss), every
family through :class:`ModelConfig` (docs/models.md; its forward's contract: docs/design.md,
contract 2). Per-token losses (fp32) with ``labels`` on the last stage, full logits without, and
hidden states ``[s(/t), b, h]`` on any other stage. ``pre_process``, ``post_process`` and
``layer_range`` cut the model into pipeline stages (layers keep their global numbers, contract 3).
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from megalite import collectives as C
from megalite.config import ExecutionConfig, ModelConfig, dtype_from_name
from megalite.context_parallel.sharding import positions as cp_positions
from megalite.masks import Documents
from megalite.models.init import initialize_parameters
from megalite.models.mtp import MultiTokenPrediction
from megalite.models.norms import build_norm
from megalite.models.transformer import TransformerLayer, hidden_dropout
from megalite.moe.layer import MoEGroups
from megalite.param_meta import set_param_meta
from megalite.parallel_state import ParallelState, get_parallel_state
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
)
from megalite.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
)
from megalite.tensor_parallel.random import checkpoint

EMBEDDING_WEIGHT_NAME = "embedding.word_embeddings.weight"


class LossOutput(NamedTuple):
    """The last stage's output given loss weights: the weighted loss with its gradients formed
    in the loss head (docs/tensor_parallel.md, "The chunked loss head")."""

    token_loss: torch.Tensor  # [b, s] per-token loss, detached: the logged statistics
    loss: torch.Tensor  # scalar, sum of weight x token loss (+ added terms): backward from it
    logged: Dict[str, torch.Tensor]  # further detached sums the step logs


class Embedding(nn.Module):
    """Word (vocab-parallel) + learned absolute position embeddings, then dropout."""

    def __init__(self, config: ModelConfig, padded_vocab: int, tp_group, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        dtype = dtype_from_name(config.params_dtype)
        self.sequence_parallel = sequence_parallel and C.group_size(tp_group) > 1
        self.tp_group = tp_group
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, config.hidden_size, tp_group=tp_group,
            sequence_parallel=self.sequence_parallel, init_std=config.init_method_std,
            params_dtype=dtype, device=device)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size, dtype=dtype, device=device)
            # Under SP each rank adds the positions of its own sequence shard: partial gradient.
            set_param_meta(self.position_embeddings.weight,
                           init_method=("normal", config.init_method_std),
                           grad_partial_over_tp=self.sequence_parallel)
        self.dropout = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
        x = self.word_embeddings(input_ids)  # [s(/t), b, h]
        if self.position_embeddings is not None:
            s_local = x.shape[0]
            if position_ids is None:
                start = C.group_rank(self.tp_group) * s_local if self.sequence_parallel else 0
                positions = torch.arange(start, start + s_local, device=x.device)
                # Call the module (not slice its weight): wrappers that gather or wait for a
                # parameter in a forward pre-hook (ZeRO param all-gather overlap) must see it run.
                pos = self.position_embeddings(positions).unsqueeze(1)
            else:
                pos = self.position_embeddings(position_ids.t())
                if self.sequence_parallel:
                    pos = pos.chunk(C.group_size(self.tp_group), 0)[C.group_rank(self.tp_group)]
            x = x + pos
        return hidden_dropout(x, self.dropout, self.training, self.sequence_parallel)


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: Optional[Tuple[int, int]] = None, seed: Optional[int] = 1234,
                 device=None, sequence_parallel: bool = False,  # ParallelConfig's
                 execution: ExecutionConfig = ExecutionConfig()):
        super().__init__()
        ps = parallel_state or get_parallel_state()
        self.parallel_state = ps
        self.config, self.execution = config.validate(ps.tp_size), execution
        self.tp_group = ps.tp_group
        self.tp_size = C.group_size(ps.tp_group)
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.padded_vocab_size = config.padded_vocab_size(self.tp_size)
        self.layer_range = layer_range or (0, config.num_layers)
        device = device if device is not None else ps.device
        dtype = dtype_from_name(config.params_dtype)

        # MTP's depths embed tokens: the last stage holds an embedding copy (partition.py)
        self.mtp = None
        if pre_process or (post_process and config.mtp_num_layers):
            self.embedding = Embedding(config, self.padded_vocab_size, ps.tp_group, device,
                                       self.sequence_parallel)
        start, end = self.layer_range
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, i, ps.tp_group, device, self.sequence_parallel,
                                      ps.cp_group, ps.cp_comm_type, MoEGroups.of(ps), execution)
             for i in range(start, end)})
        if post_process:
            self.final_layernorm = build_norm(config, self.sequence_parallel, dtype, device,
                                              execution.use_apex)
            share = config.tie_embeddings and hasattr(self, "embedding")
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, bias=False, gather_output=False,
                tp_group=ps.tp_group, sequence_parallel=self.sequence_parallel,
                init_std=config.init_method_std, params_dtype=dtype, device=device,
                skip_weight_param_allocation=share)
            if not share:
                set_param_meta(self.output_layer.weight,
                               init_method=("normal_vocab", config.init_method_std))
                if config.tie_embeddings:
                    # the last stage's copy of the tied embedding: the same seed name, and its
                    # gradient summed with the first stage's every step (finalize_model_grads)
                    set_param_meta(self.output_layer.weight, init_seed_name=EMBEDDING_WEIGHT_NAME,
                                   tied_embedding=True)
            if config.mtp_num_layers:
                self.mtp = MultiTokenPrediction(config, ps, device, self.sequence_parallel,
                                                execution)
        if pre_process and post_process is False and config.tie_embeddings:
            set_param_meta(self.embedding.word_embeddings.weight, tied_embedding=ps.pp_size > 1)
        self._input_tensor: Optional[torch.Tensor] = None
        if seed is not None:
            initialize_parameters(self, seed, ps.tp_rank, self.tp_size, config,
                                  ps.etp_rank, ps.etp_size)

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        """Hidden states received from the previous pipeline stage."""
        self._input_tensor = tensor

    def _output_weight(self) -> torch.Tensor:
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def _run_layers(self, x: torch.Tensor, *extra) -> torch.Tensor:
        """``extra``: the layers' position_ids and documents (TransformerLayer.forward)."""
        cfg = self.execution
        layers = list(self.layers.values())
        if cfg.recompute_granularity != "full" or not self.training:
            for layer in layers:
                x = layer(x, *extra)
            return x
        n = cfg.recompute_num_layers or 1
        if cfg.recompute_method == "block":
            # Recompute the first n layers of this stage, keep activations for the rest.
            for i, layer in enumerate(layers):
                x = checkpoint(layer, x.device, x, *extra) if i < n else layer(x, *extra)
            return x
        # uniform: checkpoint chunks of n layers, storing only each chunk's input
        for i in range(0, len(layers), n):
            chunk = layers[i:i + n]

            def run(h, *extra, chunk=chunk):
                for layer in chunk:
                    h = layer(h, *extra)
                return h

            x = checkpoint(run, x.device, x, *extra)
        return x

    def forward(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                decoder_input: Optional[torch.Tensor] = None,
                documents: Optional[Documents] = None,
                loss_weights: Optional[torch.Tensor] = None, mtp_targets=None):
        """``position_ids`` [b, s(/C)]: None for 0..s-1 (CP: this rank's global positions),
        else every position embedding (RoPE too) takes them; ``documents``: attention stays
        within them (docs/data.md, "Packed documents"); ``loss_weights`` [b, s] (the training
        path: loss mask / global token count): a LossOutput instead of per-token losses, with
        MTP's term when ``mtp_targets`` (models/mtp.py:mtp_targets, the weights as loss_weights)."""
        ps = self.parallel_state
        layer_positions = position_ids
        if self.pre_process and position_ids is None and ps.cp_size > 1:  # CP: global positions
            position_ids = cp_positions(input_ids.shape[1] * ps.cp_size, ps.cp_rank, ps.cp_size,
                                        input_ids.device).expand_as(input_ids)
        if self.pre_process:
            x = self.embedding(input_ids, position_ids)
        else:
            x = decoder_input if decoder_input is not None else self._input_tensor
            if x is None:
                raise ValueError("a non-first pipeline stage needs its input hidden states")
        x = self._run_layers(x, layer_positions, documents)
        if not self.post_process:
            return x
        hidden, x = x, self.final_layernorm(x)
        if labels is None:
            logits = self.output_layer(x, self._output_weight())  # [s, b, Vp/t]
            logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
            return logits[..., : self.config.output_vocab_size].transpose(0, 1).contiguous()
        if loss_weights is None:
            return self.loss_head(x, labels)
        token_loss, loss = self.loss_head(x, labels, loss_weights)
        if mtp_targets is None:
            return LossOutput(token_loss, loss, {})
        extra, logged = self._mtp_loss(hidden, labels, mtp_targets, position_ids,
                                       (layer_positions, documents))
        return LossOutput(token_loss, loss + extra, logged)

    def _mtp_loss(self, h: torch.Tensor, labels: torch.Tensor, targets, position_ids, extra):
        """MTP's term, factor / D x sum_k L_k (docs/models.md, "Multi-token prediction"), and each
        L_k detached as ``mtp_k_loss``; ``targets``: models/mtp.py:mtp_targets's, weighted."""
        mtp_labels, weights = targets
        # depth k reads the token k positions further: the main labels, then depth k - 1's
        inputs = torch.cat([labels.unsqueeze(-1), mtp_labels[..., :-1]], dim=-1)
        full = self.execution.recompute_granularity == "full" and self.training
        total, logged = 0.0, {}
        for k, layer in enumerate(self.mtp.layers):
            embedded = self.embedding(inputs[..., k], position_ids)
            args = (h, embedded) + extra
            h, normed = checkpoint(layer, h.device, *args) if full else layer(*args)
            _, loss_k = self.loss_head(normed, mtp_labels[..., k], weights[..., k])
            logged[f"mtp_{k + 1}_loss"] = loss_k.detach()
            total = total + loss_k
        return total * (self.config.mtp_loss_scaling_factor / len(self.mtp.layers)), logged

    def loss_head(self, x: torch.Tensor, labels: torch.Tensor,
                  loss_weights: Optional[torch.Tensor] = None):
        """The output layer and its cross entropy on final-normed ``x`` [s, b, h]: the per-token
        loss [b, s]; with ``loss_weights`` [b, s], (that loss detached, the differentiable sum
        of weight x loss). Chunked, the logits are never whole (docs/tensor_parallel.md)."""
        chunk, out, weight = (self.execution.cross_entropy_chunk_tokens, self.output_layer,
                              self._output_weight())
        vocab = self.config.output_vocab_size
        if chunk:
            kw = dict(vocab_size=vocab, chunk_tokens=chunk)
            if loss_weights is None:
                return out(x, weight, labels.t(), **kw).t()
            loss, token_loss = out(x, weight, labels.t(), loss_weights=loss_weights.t(), **kw)
            return token_loss.t(), loss
        token_loss = vocab_parallel_cross_entropy(out(x, weight), labels.t(), self.tp_group,
                                                  vocab_size=vocab).t()
        if loss_weights is None:
            return token_loss
        return token_loss.detach(), (token_loss * loss_weights).sum()
