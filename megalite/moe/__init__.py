"""Mixture of Experts (docs/moe.md). For now the pure pieces: routing, balancing losses, capacity
(``router.py``) and local token permutation (``dispatch.py``); the layer, expert parallelism and
the flags come later."""
