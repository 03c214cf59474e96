"""Context parallelism (CP): the sequence dimension split across ranks, through attention too
(docs/context_parallel.md)."""
