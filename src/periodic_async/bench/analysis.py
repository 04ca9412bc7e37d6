"""What the experiments compute from the runs they made: pure functions of traces, rollouts,
evaluation records and phase times, shared by experiments/*.py and tested in tests/test_bench.py.

    overlap_bound         (T_gen + T_train) / max(T_gen, T_train): the most asynchrony can give
    iteration_phases      per iteration of a trace: first finished request, first micro-step, ...
    trained_orders        the order the trainer took each iteration's requests (Figure 1's labels)
    compare_iteration     two runs' samples of one iteration: identical tokens, other order
    identical_iterations  how many iterations, from the first, two runs sampled the same tokens
    max_abs_diff          the largest gap between two curves
    paired_gain_stderr    the standard error of an accuracy gain on the same held-out problems
    memory_growth         per process, the least-squares slope of resident memory over iterations
"""

from __future__ import annotations

import math
from pathlib import Path

from periodic_async.trace import read_jsonl


# --- asynchrony ---------------------------------------------------------------------------------

def overlap_bound(t_gen: float, t_train: float) -> float:
    """The speedup of overlapping the two phases perfectly over running them one after the other:
    (T_gen + T_train) / max(T_gen, T_train), between 1 (one phase is all) and 2 (equal phases).
    The paper's 1.92x on an 8B model is measured against this bound of 2x."""
    if t_gen < 0 or t_train < 0 or max(t_gen, t_train) == 0:
        raise ValueError(f"phase times must be >= 0 and not both 0: T_gen={t_gen}, T_train={t_train}")
    return (t_gen + t_train) / max(t_gen, t_train)


# --- Figure 1: phases and orders of one run -------------------------------------------------------

def iteration_phases(events: list[dict]) -> list[dict]:
    """Per iteration, from one run's trace (trace.jsonl events): times from the end of the weight
    sync that started it (version t on the engines) to its first finished request
    (`first_group_s`), the trainer's first micro-step (`train_start_s`), the last finished
    request (`generation_s`) and the end of the next weight sync (`wall_s`); and whether the
    trainer trained while requests were still generating. A group is done when its last sample is.
    Only iterations closed by a weight sync are listed."""
    syncs = {e["args"]["version"]: e["start"] + e["dur"] for e in events if e["name"] == "weight_sync"}
    rows = []
    for it in sorted(v for v in syncs if v + 1 in syncs):
        t0 = syncs[it]
        ends: dict[str, float] = {}  # request -> its last sample's end
        for e in events:
            if e["name"] == "generate" and e["args"]["request"].startswith(f"it{it}-"):
                ends[e["args"]["request"]] = max(ends.get(e["args"]["request"], 0.0), e["start"] + e["dur"])
        train_start = min(e["start"] for e in events if e["name"] == "micro_step"
                          and e["args"].get("iteration") == it)
        rows.append({"iteration": it, "wall_s": syncs[it + 1] - t0, "first_group_s": min(ends.values()) - t0,
                     "train_start_s": train_start - t0, "generation_s": max(ends.values()) - t0,
                     "trains_while_generating": train_start < max(ends.values())})
    return rows


def trained_orders(rollouts: list[dict]) -> dict[int, str]:
    """Iteration -> the requests, numbered 1..B by dataset position, in the order the trainer
    took them (rollouts.jsonl rows: iteration, arrival, position)."""
    out: dict[int, list[int]] = {}
    for r in sorted(rollouts, key=lambda r: (r["iteration"], r["arrival"])):
        out.setdefault(r["iteration"], []).append(r["position"] + 1)
    return {it: " ".join(map(str, order)) for it, order in out.items()}


# --- two runs from one seed ---------------------------------------------------------------------

def compare_iteration(sync_rows: list[dict], async_rows: list[dict]) -> dict:
    """The samples of one iteration in two runs (rollouts.jsonl rows): how many are the same token
    sequence in both, matched by prompt and sample index, and whether the trainer took the
    groups in another order."""
    a = {r["prompt_index"]: r["response_ids"] for r in async_rows}
    pairs = [(s, a.get(r["prompt_index"], [None] * len(r["response_ids"]))[i])
             for r in sync_rows for i, s in enumerate(r["response_ids"])]
    same = sum(s == t for s, t in pairs)

    def order(rows):
        return [r["prompt_index"] for r in sorted(rows, key=lambda r: r["arrival"])]

    return {"samples": len(pairs), "identical_samples": same, "identical_fraction": round(same / len(pairs), 4),
            "trained_in_other_order": order(sync_rows) != order(async_rows)}


def identical_iterations(run_a: Path, run_b: Path) -> str:
    """'k/n': of the n iterations of run_a's rollouts.jsonl, the first k sampled exactly the
    tokens run_b sampled (counting stops at the first that differs)."""
    by = [{(g["iteration"], g["prompt_index"]): g["response_ids"] for g in read_jsonl(Path(o) / "rollouts.jsonl")}
          for o in (run_a, run_b)]
    its = sorted({k[0] for k in by[0]})
    same = 0
    for it in its:
        if not all(v == by[1].get(k) for k, v in by[0].items() if k[0] == it):
            break
        same += 1
    return f"{same}/{len(its)}"


def max_abs_diff(a: list[dict], b: list[dict], key: str) -> float | None:
    """Largest |a[i][key] - b[i][key]| over the rows where both have a value ('' = none); None
    when there is no such row."""
    pairs = [(x[key], y[key]) for x, y in zip(a, b) if x[key] != "" and y[key] != ""]
    return max((abs(x - y) for x, y in pairs), default=None)


# --- accuracy -------------------------------------------------------------------------------------

def paired_gain_stderr(run_dir: Path, first: int, last: int) -> float | None:
    """Standard error of the held-out accuracy gain from version `first` to `last` on the same
    problems (eval.jsonl rows with `correct`): sd(d) / sqrt(n) with d = correct_last -
    correct_first per problem. The independent estimate, sqrt(se_first^2 + se_last^2), ignores
    that the problems are the same. None when either version, or its per-problem record, is missing."""
    evals = {e["step"]: e.get("correct") for e in read_jsonl(Path(run_dir) / "eval.jsonl")}
    a, b = evals.get(first), evals.get(last)
    if not a or not b or len(a) != len(b):
        return None
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    return (sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d)) ** 0.5


# --- memory over a long run ------------------------------------------------------------------------

def slope_per_100(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x, times 100 (nan when every x is the same)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")


def memory_growth(samples: list[dict], warmup: int) -> list[dict]:
    """One row per process (process name, leg, pid: a restarted worker is a new process) from
    samples {leg, iteration, process, pid, rss_mib} (a dead process's rss_mib is nan): its first
    and last iteration and RSS, and the RSS slope in MiB per 100 iterations fitted from its
    samples `warmup` iterations after its first (start-up allocations left out; '' with fewer
    than 3 samples)."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r in samples:
        rss = float(r["rss_mib"])
        if not math.isnan(rss):
            series.setdefault((r["process"], int(r["leg"]), int(r["pid"])), []).append((int(r["iteration"]), rss))
    out = []
    for (name, leg, pid), pts in sorted(series.items(), key=lambda kv: (kv[0][1], kv[1][0][0], kv[0][0])):
        fitted = [p for p in pts if p[0] >= pts[0][0] + warmup]
        out.append({"process": name, "leg": leg, "pid": pid, "first_iteration": pts[0][0],
                    "last_iteration": pts[-1][0], "samples_fitted": len(fitted), "rss_first_mib": pts[0][1],
                    "rss_last_mib": pts[-1][1],
                    "rss_slope_mib_per_100_iterations": round(slope_per_100(fitted), 2) if len(fitted) >= 3 else ""})
    return out
