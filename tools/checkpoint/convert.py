#!/usr/bin/env python
"""Convert checkpoints: Hugging Face <-> megalite, and reshard megalite to any TP/PP/DP layout.

  hf-to-megalite   a local HF GPT-2 / Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen2-MoE /
                   Qwen3-MoE / OLMoE / GLM-4.5 directory -> megalite checkpoint (docs/models.md
                   lists the families and what is refused)
  megalite-to-hf   a megalite checkpoint (any layout) -> a directory AutoModelForCausalLM loads
  reshard          a megalite checkpoint -> the same training state for another layout (dense
                   or MoE; experts are stored by global index, so EP needs no resharding)

Conversion streams one layer at a time; output appears at --save only when complete. Any error is
one line on stderr and a non-zero exit (2: bad input, 1: failed). docs/checkpoints.md has details.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from megalite.config import V_SCHEDULES  # noqa: E402  (light: imports nothing from megalite)

PROG = "convert.py"
EXAMPLES = {
    "hf-to-megalite": "python tools/checkpoint/convert.py hf-to-megalite --hf-dir ./llama-hf "
                      "--save ./ckpt --tensor-model-parallel-size 2 "
                      "--pipeline-model-parallel-size 2\n"
                      "  then: torchrun --nproc-per-node 4 pretrain.py --load ./ckpt --finetune "
                      "--use-checkpoint-args --tensor-model-parallel-size 2 "
                      "--pipeline-model-parallel-size 2 --data-path ...",
    "megalite-to-hf": "python tools/checkpoint/convert.py megalite-to-hf --load ./ckpt "
                      "--save ./exported-hf\n"
                      "  then: AutoModelForCausalLM.from_pretrained('./exported-hf')",
    "reshard": "python tools/checkpoint/convert.py reshard --load ./ckpt --save ./ckpt-tp1pp2 "
               "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
               "--data-parallel-size 2\n"
               "  then: torchrun --nproc-per-node 4 pretrain.py --load ./ckpt-tp1pp2 "
               "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 ...",
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse's multi-line usage errors become one line (docs/design.md, contract 8)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        from megalite.config import ConfigError

        raise ConfigError(message)


def _layout_flags(p: argparse.ArgumentParser, required: bool) -> None:
    # --target-* are the spellings checkpoint.format.RESHARD_HINT (and Megatron's tool) use.
    p.add_argument("--tensor-model-parallel-size", "--target-tensor-model-parallel-size",
                   dest="tp", type=int, required=required, help="target TP size")
    p.add_argument("--pipeline-model-parallel-size", "--target-pipeline-model-parallel-size",
                   dest="pp", type=int, required=required, help="target PP size")
    v = p.add_mutually_exclusive_group()
    v.add_argument("--num-layers-per-virtual-pipeline-stage", dest="vpp_layers", type=int,
                   default=None, help="target interleaved layout: layers per virtual stage")
    v.add_argument("--num-virtual-stages-per-pipeline-rank", dest="vpp", type=int,
                   default=None, help="target interleaved layout: virtual stages per rank")
    p.add_argument("--pipeline-schedule", dest="v_schedule", choices=V_SCHEDULES,
                   default=None, help="target V layout (two chunks per rank, rank r holding "
                                      "stages r and 2p-1-r) for that schedule")


def build_parser() -> argparse.ArgumentParser:
    top = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="examples:\n" + "\n".join(f"  {v}" for v in EXAMPLES.values()))
    sub = top.add_subparsers(dest="command", metavar="{hf-to-megalite,megalite-to-hf,reshard}")
    sub.required = True

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text,
                              epilog="example:\n  " + EXAMPLES[name],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("hf-to-megalite", "import a local Hugging Face GPT-2, Llama, Qwen2, Qwen3, "
                              "Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or GLM-4.5 "
                              "(glm4_moe) model (safetensors, "
                              "sharded or not, or pytorch_model.bin) as a megalite checkpoint at "
                              "iteration 0 (with its tokenizer in SAVE/tokenizer)")
    p.add_argument("--hf-dir", required=True, help="directory with config.json and weights")
    p.add_argument("--save", required=True, help="new checkpoint directory")
    _layout_flags(p, required=False)
    p.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length (default: max_position_embeddings)")
    p.add_argument("--params-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight dtype in the checkpoint (default float32)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None)

    p = add("megalite-to-hf", "export a megalite checkpoint (any TP/PP/VPP layout, any ZeRO stage; "
                              "optimizer files are not read) for transformers.AutoModelForCausalLM")
    p.add_argument("--load", required=True, help="megalite checkpoint directory")
    p.add_argument("--save", required=True, help="new Hugging Face model directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--max-shard-size-mb", type=int, default=2048,
                   help="split model.safetensors into files of at most this size")

    p = add("reshard", "rewrite a megalite checkpoint for another TP/PP/VPP/DP layout: weights, "
                       "optimizer state (Adam moments, fp32 masters, step, grad scaler), LR "
                       "schedule position, RNG state, iteration and consumed samples. MoE models "
                       "too: their experts are stored by global index, so any "
                       "--expert-model-parallel-size loads the result (no EP flag here)")
    p.add_argument("--load", required=True, help="megalite checkpoint directory")
    p.add_argument("--save", required=True, help="new checkpoint directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    _layout_flags(p, required=True)
    p.add_argument("--data-parallel-size", type=int, default=None,
                   help="target DP size (sets the number of ZeRO optimizer files; checked "
                        "against the global batch size)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="target optimizer format: 0 plain (one state per TP/PP rank), 1/2 ZeRO "
                        "(one bucket-flat file per DP rank), 3 ZeRO-3 (one unit-flat file per "
                        "DP rank); default: the checkpoint's own")
    p.add_argument("--no-optim", action="store_true",
                   help="write model weights only (resume with --no-load-optim or --finetune)")
    return top


def _layout(a, default_tp: int = 1, default_pp: int = 1):
    from megalite.checkpoint.layout import Layout

    return Layout(a.tp if a.tp is not None else default_tp,
                  a.pp if a.pp is not None else default_pp, a.vpp_layers,
                  v_schedule=a.v_schedule, virtual_stages=a.vpp)


def run(a) -> str:
    from megalite.checkpoint import convert as ct

    log = print
    if a.command == "hf-to-megalite":
        return ct.hf_to_megalite(a.hf_dir, a.save, _layout(a), seq_length=a.seq_length,
                                 params_dtype=a.params_dtype,
                                 make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                                 log=log)
    if a.command == "megalite-to-hf":
        if a.max_shard_size_mb < 1:
            raise ct.CheckpointError("--max-shard-size-mb must be >= 1")
        return ct.megalite_to_hf(a.load, a.save, iteration=a.iteration,
                                 max_shard_bytes=a.max_shard_size_mb << 20, log=log)
    return ct.reshard(a.load, a.save, _layout(a), data_parallel_size=a.data_parallel_size,
                      no_optim=a.no_optim, iteration=a.iteration, zero_stage=a.zero_stage,
                      log=log)


def main(argv=None) -> int:
    from megalite.config import ConfigError

    try:
        a = build_parser().parse_args(argv)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        out = run(a)
    except ConfigError as e:  # bad input: flag, file, shape or layout (one line)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        print(f"{PROG}: error: {a.command} failed: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (nothing written at --save)", file=sys.stderr)
        return 130
    print(f" done: {out} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
