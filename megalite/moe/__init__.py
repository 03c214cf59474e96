"""Mixture of Experts (docs/moe.md; the modules: docs/design.md, "moe/")."""
