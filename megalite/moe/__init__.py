"""Mixture of Experts (docs/moe.md): routing, balancing losses and capacity (``router.py``), local
token permutation (``dispatch.py``), expert parallelism's exchange (``alltoall.py``) and the MoE
layer with its per-step hooks (``layer.py``)."""
