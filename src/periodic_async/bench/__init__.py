"""Benchmarks: one protocol for every throughput experiment, and the figures drawn from results.

    protocol.py   systems interleaved over repeats, medians with min-max, commit and config per row
    plots.py      figures from saved artifacts (trace.jsonl, results/*.csv); notebooks call these
    gpu_check.py  the steps of scripts/gpu_check.sh: the claims and their costs on one CUDA device
"""
