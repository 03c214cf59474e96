"""Command-line flags -> :class:`MegaliteConfig`, the parser derived from megalite.config's
declarations plus Megatron's compound flags (docs/design.md, "Adding a setting")."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Dict, Optional, Sequence

from megalite.config import (
    GROUPS,
    SECTIONS,
    ConfigError,
    MegaliteConfig,
    check_compound_flags,
    flag_name,
    virtual_stages,
)

_BASE_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list}

# Megatron's compound flags: (help group, flag, argparse keywords). _translate gives their meaning.
COMPOUND_FLAGS = (
    ("model", "--group-query-attention",
     dict(action="store_true",
          help="use grouped-query attention with --num-query-groups KV heads")),
    ("model", "--disable-bias-linear", dict(action="store_true")),
    ("model", "--add-qkv-bias",
     dict(action="store_true", help="q/k/v bias even with --disable-bias-linear (Qwen2)")),
    ("parallelism", "--num-layers-per-virtual-pipeline-stage",
     dict(type=int, default=None, help="K: gives --num-virtual-stages-per-pipeline-rank "
                                       "L / (PP x K)")),
    ("mixed precision", "--bf16", dict(action="store_true")),
    ("mixed precision", "--fp16", dict(action="store_true")),
    ("data parallelism and ZeRO", "--use-distributed-optimizer",
     dict(action="store_true", help="Megatron's spelling of --zero-stage 1")),
)
# The compound flags that pin a planner layout field (tools/plan.py), beside the declared ones.
_COMPOUND_LAYOUT = {"--use-distributed-optimizer": "zero_stage",
                    "--num-layers-per-virtual-pipeline-stage":
                        "virtual_pipeline_model_parallel_size"}


def _translate(a: argparse.Namespace, v: Dict[str, dict]) -> None:
    """The compound flags of ``a`` into the section keyword dicts ``v`` (the one place)."""
    m, par, opt = v["model"], v["parallel"], v["optimizer"]
    check_compound_flags(a)
    m["add_bias_linear"] = not a.disable_bias_linear
    m["add_qkv_bias"] = True if a.add_qkv_bias else None
    m["params_dtype"] = "bfloat16" if a.bf16 else "float16" if a.fp16 else "float32"
    vpp, per = par["virtual_pipeline_model_parallel_size"], a.num_layers_per_virtual_pipeline_stage
    if per is not None:
        vpp = virtual_stages(m["num_layers"], par["pipeline_model_parallel_size"], per)
    par["virtual_pipeline_model_parallel_size"] = None if vpp == 1 else vpp
    if a.use_distributed_optimizer and opt["zero_stage"] == 0:
        opt["zero_stage"] = 1


class _OneLineParser(argparse.ArgumentParser):
    """Any problem is one line naming the flag, not argparse's usage (design.md, contract 8)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        raise ConfigError(message)


class _HelpFormatter(argparse.HelpFormatter):
    """Short metavars (INT, FLOAT, STR) and every default shown, so --help fits on a screen."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=44, width=100)

    def _get_default_metavar_for_optional(self, action):
        return {int: "INT", float: "FLOAT"}.get(action.type, "STR")

    def _format_action(self, action):
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if action.option_strings and shown and "%(default)" not in (action.help or ""):
            action.help = ((action.help + " ") if action.help else "") + "(default: %(default)s)"
        return super()._format_action(action)


def _argument(f) -> dict:
    """argparse keywords of a declared field."""
    meta = f.metadata
    base = _BASE_TYPES[str(f.type).removeprefix("Optional[").removesuffix("]")]
    kw = dict(dest=f.name, default=f.default, help=meta["help"], **meta["cli"])
    if base is bool:
        kw["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        return kw
    if base is not list:
        kw["type"] = base
    if meta["choices"] is not None:
        kw["choices"] = list(meta["choices"])
    return kw


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="pretrain.py",
        usage="[torchrun ...] %(prog)s [flags]   (flags by group below; spellings as Megatron-LM)",
        description="Pretrain a GPT model with tensor, sequence, context, pipeline and data "
                    "parallelism. Launch several processes with torchrun; flags follow "
                    "Megatron-LM.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for cls in SECTIONS.values():
        for f in fields(cls):
            if flag_name(f) is not None:
                groups[f.metadata["group"] or cls.GROUP].add_argument(flag_name(f), **_argument(f))
    for group, flag, kw in COMPOUND_FLAGS:
        groups[group].add_argument(flag, **kw)
    return p


def layout_flags() -> Dict[str, str]:
    """flag -> the layout field it pins (tools/plan.py searches the fields not pinned)."""
    out = {flag_name(f): f.name for cls in SECTIONS.values() for f in fields(cls)
           if f.metadata.get("layout")}
    return {**out, **_COMPOUND_LAYOUT}


def config_from_namespace(a: argparse.Namespace) -> MegaliteConfig:
    """Parsed flags -> MegaliteConfig (not validated)."""
    values = {key: {f.name: getattr(a, f.name) for f in fields(cls) if flag_name(f)}
              for key, cls in SECTIONS.items()}
    _translate(a, values)
    return MegaliteConfig(**{key: cls(**values[key]) for key, cls in SECTIONS.items()})


def parse_args(argv: Optional[Sequence[str]] = None) -> MegaliteConfig:
    """Flags -> validated MegaliteConfig. Raises ConfigError (one line) on any bad input."""
    parser = build_parser()
    ns = parser.parse_args(list(argv) if argv is not None else None)
    if ns.min_lr > ns.lr and parser.get_default("min_lr") == ns.min_lr:
        # the default floor is for the default --lr; a smaller --lr brings the floor down with it
        ns.min_lr = ns.lr
    return config_from_namespace(ns).validate()
