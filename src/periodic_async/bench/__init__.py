"""Benchmarks: one protocol for every throughput experiment, and the figures drawn from results.

    protocol.py   systems interleaved over repeats, medians with min-max, commit and config per row
    plots.py      figures from saved artifacts (trace.jsonl, results/*.csv); notebooks call these
"""
