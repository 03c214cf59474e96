"""Checkpoints: format, save, load and the offline converter (docs/checkpoints.md)."""
