#!/usr/bin/env python
"""Sample a continuation from a megalite checkpoint (one process, CPU or one GPU).

    python tools/generate.py --load CKPT_DIR --prompt "def " --max-new-tokens 64 --top-k 40

The model shape comes from the checkpoint's args.json, the tokenizer from CKPT_DIR/tokenizer
(pretrain.py saves it there at the start of training). A checkpoint saved with tensor or pipeline
parallelism must first be resharded to 1 x 1 with tools/checkpoint/convert.py reshard.
No KV cache: each new token re-runs the (at most seq_length) context; fine for a small model.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        from megalite.config import ConfigError

        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="generate.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain.py")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: sample from the whole vocabulary")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return p


def load_model(load_dir: str, iteration=None, device="cpu"):
    """(GPTModel in eval mode, its ModelConfig) from a tp=1, pp=1 checkpoint."""

    from megalite.checkpoint import format as ck
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState, resolve_device

    if not os.path.isdir(load_dir):
        raise ck.CheckpointError(f"--load {load_dir}: no such directory")
    if iteration is None:
        iteration = ck.read_tracker(load_dir)
        if iteration is None:
            raise ck.CheckpointError(f"--load {load_dir}: no {ck.TRACKER_FILE} there")
    cfg = ck.read_checkpoint_config(load_dir, iteration)
    par = cfg.parallel
    if par.tensor_model_parallel_size != 1 or par.pipeline_model_parallel_size != 1:
        raise ck.CheckpointError(
            f"--load {load_dir}: saved with tp={par.tensor_model_parallel_size}, "
            f"pp={par.pipeline_model_parallel_size}; generate.py needs tp=1, pp=1: reshard it "
            f"with `python tools/checkpoint/convert.py reshard` (docs/checkpoints.md)")
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0
    dev = resolve_device(device)
    model = GPTModel(m, ParallelState(device=dev), seed=None, device=dev)
    path = os.path.join(ck.loadable_iteration_dir(load_dir, iteration), ck.shard_dir_name(0, 0),
                        ck.MODEL_FILE)
    state = ck.load_file(path, f"--load {load_dir}")
    model.load_state_dict(state["model"] if "model" in state else state["model0"])
    model.eval()
    return model, m


def main(argv=None) -> int:
    from megalite.config import ConfigError

    try:
        a = build_parser().parse_args(argv)
        import torch

        from megalite.config import DataConfig
        from megalite.data import build_tokenizer

        model, mcfg = load_model(a.load, a.iteration, a.device)
        tok_dir = os.path.join(a.load, "tokenizer")
        if not os.path.isdir(tok_dir):
            raise ConfigError(f"--load {a.load}: no tokenizer/ folder (pretrain.py saves it when "
                              f"--save is given)")
        tokenizer = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                               tokenizer_model=tok_dir))
        if a.max_new_tokens < 0 or a.temperature <= 0 or a.top_k < 0:
            raise ConfigError("--max-new-tokens and --top-k must be >= 0, --temperature > 0")
    except ConfigError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2

    device = next(model.parameters()).device
    ids = tokenizer.encode(a.prompt) or [tokenizer.eod]
    gen = torch.Generator(device="cpu").manual_seed(a.seed)
    out = list(ids)
    with torch.no_grad():
        for _ in range(a.max_new_tokens):
            ctx = torch.tensor([out[-mcfg.seq_length:]], device=device)
            logits = model(ctx)[0, -1].float().cpu()
            if a.greedy:
                nxt = int(logits.argmax())
            else:
                logits = logits / a.temperature
                if a.top_k:
                    kth = torch.topk(logits, min(a.top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            out.append(nxt)
            if nxt == tokenizer.eod:
                break
    # Decode prompt and continuation together, so the tokenizer places the joins (spaces) itself.
    print(tokenizer.decode(out if a.prompt else out[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
