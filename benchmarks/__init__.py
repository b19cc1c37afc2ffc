"""Benchmarks of rope-dispatch against a device copy and its peers; not installed with the package.

Run from the repository root: ``python -m benchmarks.bench``, ``python -m benchmarks.sweep``,
``python -m benchmarks.hf_train_step``, ``python -m benchmarks.hf_rope_calls``,
``python -m benchmarks.autotune_figures`` (docs/performance.md).
"""
