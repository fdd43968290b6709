"""Benchmarks, one per hot path. Run as `python -m bench.<name>` from the repo root (figures: BENCHMARKS.md)."""
