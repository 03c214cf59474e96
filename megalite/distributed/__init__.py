"""Data parallelism: gradient finalization, grad buffers and buckets, ZeRO sharding."""
