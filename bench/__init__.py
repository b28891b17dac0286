"""Benchmark harness: autofit against exhaustive search and the batch-size finders people use today.

Run `python bench/run.py` (CPU) or `python bench/run.py --gpu`; see bench/README.md.
"""
