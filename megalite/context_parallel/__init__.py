"""Context parallelism (CP): the sequence dimension split across ranks, through attention too.

See docs/context_parallel.md. ``sharding`` says which tokens a CP rank keeps; ``attention``
computes causal attention of the local queries against the whole sequence's keys and values.
"""
