"""Benchmarks: one protocol for every throughput experiment, and the figures drawn from results.

    protocol.py   systems interleaved over repeats, medians with min-max, commit and config per row
    trl.py        the peer baseline of Table 2: TRL's GRPOTrainer on our model, prompts and reward
    hf_generate.py  the peer baseline of the engine benchmark: transformers' static-batch `generate`
    plots.py      figures from saved artifacts (trace.jsonl, results/*.csv); notebooks call these
    memory.py     the peak memory of a call: CUDA's allocator statistics, or torch's profiler on CPU
    gpu/          the steps of scripts/gpu_check.sh, a module each: the claims and their costs on one
                  CUDA device
"""
