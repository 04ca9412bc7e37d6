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

and, below them, what the documents and the claims (bench/claims.py) quote from the committed
results/*.csv: each function summarises the rows of one experiment's CSVs into a small table, a
list of rows each with a `key` (the row the documents name: 'periodic-async' as 'pa', a case, a
setting; '' for numbers of the whole run). Cells are numbers or text, a tuple (lo, hi) for a range
and a list for one value per row; `python scripts/update_readme.py` formats them. A summary raises
on rows it cannot read (a missing column, no periodic-async row): never a silent blank.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from periodic_async.records import read_csv
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


# --- the committed results, summarised (the documents' numbers and the claims' inputs) ------------

Rows = Sequence[dict[str, Any]]
SHORT = {"periodic-async": "pa", "sync-separated": "sep", "sync-colocated": "col", "async-offpolicy": "off"}
"""The documents' short names of the modes, the keys of the mode rows below."""
GPU_SHAPE = ("4096", "16", "256")
"""P, G, R of the GPU check's long-prompt attention goal (bench/claims.py)."""


def _f(v: Any) -> float:
    return float(v)


def read_results(results: Path, *patterns: str) -> list[dict]:
    """The rows of every CSV under `results` matching `patterns` (globs, in order), each tagged with
    its `_file`; a non-CSV file is one row holding its `text`. Raises FileNotFoundError when none matches."""
    paths = [p for pattern in patterns for p in sorted(Path(results).glob(pattern))]
    if not paths:
        raise FileNotFoundError(f"{results}/{patterns[0]}: not found (its experiment has not run)")
    rows: list[dict] = []
    for p in paths:
        tag = {"_file": str(p.relative_to(results))}
        if p.suffix != ".csv":
            rows.append({**tag, "text": p.read_text()})
            continue
        rows += [{**r, **tag} for r in read_csv(p)]
    return rows


def common(rows: Rows) -> dict[str, Any]:
    """The columns whose value every row shares (a run's commit, machine, rounds)."""
    return {k: v for k, v in rows[0].items() if k != "_file" and all(r.get(k) == v for r in rows)} if rows else {}


def machines(rows: Rows) -> str:
    """The CPUs the rows were measured on ('; '-joined), or 'not recorded' (a CSV from before the `cpu` column)."""
    return "; ".join(sorted({r["cpu"] for r in rows if r.get("cpu")})) or "not recorded"


def mode_row(rows: Rows, mode: str) -> dict:
    """The one row of `mode`; a clear error when the CSV has none."""
    found = [r for r in rows if r.get("mode") == mode]
    if len(found) != 1:
        where = rows[0].get("_file", "the rows") if rows else "no rows"
        raise ValueError(f"{len(found)} rows of mode {mode} in {where}")
    return found[0]


def table2(rows: Rows) -> list[dict]:
    """Table 2 (table2_throughput.csv): periodic-async with the shared prompt per setting (key: the
    setting); key '': the machines and measured iterations."""
    best = [r for r in rows if r["system"] == "periodic-async" and r["shared_prompt"] == "True"]
    out = [{**r, "key": r["setting"]} for r in best]
    return out + [{"key": "", "cpu": machines(best),
                   "measured_iterations": sorted({r["measured_iterations"] for r in best} - {""})}]


def async_run(main: Rows, phases: Rows) -> list[dict]:
    """One asynchrony run (async_speedup*.csv and its _phases.csv): per mode (key pa/sep/col) its row
    with its phase times beside it; periodic-async's share of the bound over the
    phases as they ran overlapped (`of_overlapped`); key '': how much slower each phase ran beside the
    other than alone (`generate_slower`, `train_slower`, `train_thread_cpu_slower`: +0.1 is 10%)."""
    by = {r["mode"]: r for r in phases}
    out = [{**by.get(r["mode"], {}), **r, "key": SHORT[r["mode"]]} for r in main]
    pa = next(r for r in out if r["key"] == "pa")
    if pa.get("bound_overlapped"):
        pa["of_overlapped"] = _f(pa["speedup_vs_sync_separated"]) / _f(pa["bound_overlapped"])
    alone, both = mode_row(phases, "sync-separated"), mode_row(phases, "periodic-async")
    slower = {f"{p}_slower": _f(both[f"mean_{p}_s"]) / _f(alone[f"mean_{p}_s"]) - 1
              for p in ("generate", "train", "train_thread_cpu") if alone.get(f"mean_{p}_s")}
    return out + [{"key": "", **slower}]


def over_runs(rows: Rows) -> list[dict]:
    """Several runs of one asynchrony workload (rows tagged by `_file`): per mode (key pa/sep/col)
    the median over the runs of each ratio, with `<ratio>_range` the lowest and highest run; key '': `count`."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        row: dict[str, Any] = {"key": SHORT[mode]}
        for c in ("speedup_vs_sync_separated", "efficiency", "bound", "speedup_vs_sync_colocated"):
            values = [_f(r[c]) for r in rows if r["mode"] == mode]
            row |= {c: statistics.median(values), f"{c}_range": (min(values), max(values))}
        out.append(row)
    return out + [{"key": "", "count": len({r["_file"] for r in rows})}]


def contention(rows: Rows) -> list[dict]:
    """The two phases as bare processes (phase_contention.csv), per model (key): the speed each keeps
    pinned apart (`trainer`, `engine`: of its speed alone) and the change in the trainer's CPU time per
    step when it waits before each step (`waits`)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        get = {(r["case"], r["process"]): r for r in rows if r["model"] == model}
        out.append({"key": model, "trainer": get[("pinned", "trainer")]["vs_alone"],
                    "engine": get[("pinned", "engine")]["vs_alone"],
                    "waits": _f(get[("trainer_waits", "trainer")]["step_cpu_ms"])
                    / _f(get[("alone", "trainer")]["step_cpu_ms"]) - 1})
    return out


def shared_prompt(rows: Rows) -> list[dict]:
    """Shared-prompt attention alone (shared_prompt.csv, its split back-end): key 'top' the shape of
    the largest speed-up; key '': the share of the token bound kept (`efficiency`, a range) and `shapes`."""
    split = [r for r in rows if r["backend"] == "split"] or list(rows)
    top, efficiency = max(split, key=lambda r: _f(r["speedup"])), [_f(r["efficiency"]) for r in split]
    return [{**top, "key": "top"},
            {"key": "", "efficiency": (min(efficiency), max(efficiency)), "shapes": len(split)}]


def gpu_check(rows: Rows) -> list[dict]:
    """The GPU check (results/gpu/*.csv and gpu_check.log, rows tagged by `_file`): key '' the card,
    commit, versions, the check's seconds, correctness checks passed and failed (`failed_checks`:
    check (model) of each failure), rows skipped per file, and the attention at GPU_SHAPE (`token_bound`,
    `repeats`); keys 'flex' and 'split': that back-end's speed-up at GPU_SHAPE and its share of the
    token bound; key 'mfu': the trainer's best row on the 1.5B architecture."""
    def of(name: str) -> list[dict]:
        return [r for r in rows if Path(r["_file"]).name == name]

    def ok(r: dict) -> bool:
        return r.get("status", "").startswith("ok")

    correctness, log = of("correctness.csv"), of("gpu_check.log")
    at_shape = [{**r, "key": r["backend"], "of_bound": _f(r["speedup_vs_per_response"]) / _f(r["token_bound"])}
                for r in of("attention.csv") if ok(r) and (r["P"], r["G"], r["R"]) == GPU_SHAPE
                and r.get("speedup_vs_per_response")]
    failed = [r for r in correctness if r["status"].startswith("FAILED")]
    repeats = sorted({int(r["repeats"]) for r in of("attention.csv")
                      if ok(r) and (r["P"], r["G"], r["R"]) == GPU_SHAPE})
    first = correctness[0]
    whole = {"key": "", **{k: first[k] for k in ("gpu", "memory_gb", "torch", "cuda", "src_sha", "commit")},
             "seconds": int(re.search(r"== results \((\d+)s in all\)", log[0]["text"]).group(1)) if log else "",
             "checks": len(correctness), "passed": sum(ok(r) for r in correctness), "failed": len(failed),
             "failed_checks": [f"{r['check']} ({r['model']})" for r in failed],
             "skipped": ", ".join(f"{Path(f).stem} {n}" for f, n in Counter(
                 r["_file"] for r in rows if r.get("status", "").startswith("skipped")).items()) or "none",
             "token_bound": at_shape[0]["token_bound"] if at_shape else "",
             "repeats": " to ".join(dict.fromkeys(str(x) for x in (repeats[0], repeats[-1]))) if repeats else "",
             "peak_tflops": of("trainer.csv")[0]["peak_tflops"]}
    mfu = max((r for r in of("trainer.csv") if ok(r) and r["model"] == "qwen2.5-1.5b"), key=lambda r: _f(r["mfu"]))
    return [whole, *at_shape, {**mfu, "key": "mfu"}]


def gpu_attention(rows: Rows) -> list[dict]:
    """The GPU check's attention.csv as docs/gpu.md shows it: per back-end and shape that ran, the
    per-response and shared seconds, the speed-up and its share of the token bound."""
    ok = [r for r in rows if r.get("status", "").startswith("ok")]
    return [{"back-end": r["backend"], "P": r["P"], "R": r["R"], "token bound": r["token_bound"],
             "per-response s": next((q["time_s"] for q in ok if (q["backend"], q["P"], q["R"], q["packing"])
                                     == (r["backend"], r["P"], r["R"], "per_response")), ""),
             "shared s": r["time_s"], "speed-up": f"{_f(r['speedup_vs_per_response']):.2f}x",
             "of the bound": f"{_f(r['speedup_vs_per_response']) / _f(r['token_bound']):.2f}",
             "peak GiB (shared)": r["peak_memory_gib"], "repeats": r["repeats"]}
            for r in ok if r.get("speedup_vs_per_response")]


def fig1(rows: Rows) -> list[dict]:
    """Figure 1 (fig1_timeline.csv), per mode (key pa/sep): iterations that trained while generating
    ('k/n'), the order the first was trained in, the mean iteration time `wall` and `iterations`."""
    out = []
    for mode in ("periodic-async", "sync-separated"):
        its = [r for r in rows if r["mode"] == mode]
        overlapping = sum(r["trains_while_generating"] == "True" for r in its)
        out.append({"key": SHORT[mode], "trains": f"{overlapping}/{len(its)}", "overlapping": overlapping,
                    "order": its[0]["trained_order"], "wall": statistics.fmean(_f(r["wall_s"]) for r in its),
                    "iterations": len(its)})
    return out


def reward_curves(summary: Rows, curves: Rows = (), n: int = 10) -> list[dict]:
    """A reward-curve run (its _summary.csv, and its per-iteration curves): per mode (key sync/pa/off)
    its summary row, `wall_min`, `same` and `iterations` (of tokens_identical_iterations), and from the
    curves the mean training reward over the first and last `n` trained iterations, `trained`, the
    importance ratio's mean deviation from 1 and clipped share (mean and `_peak`); the off-policy mode's
    accuracy `lost` against sync and the iteration its reward `leaves` sync's; key '': the machines."""
    keys = {"sync-separated": "sync", "periodic-async": "pa", "async-offpolicy": "off"}
    out = []
    for r in summary:
        row = {**r, "key": keys[r["mode"]], "wall_min": _f(r["wall_s"]) / 60 if r.get("wall_s") else ""}
        if r.get("tokens_identical_iterations"):
            row["same"], row["iterations"] = r["tokens_identical_iterations"].split("/")
        trained = [c for c in curves if c["mode"] == r["mode"] and c["reward_mean"] not in ("", None)]
        if trained:
            row |= {"reward_first": statistics.fmean(_f(c["reward_mean"]) for c in trained[:n]),
                    "reward_last": statistics.fmean(_f(c["reward_mean"]) for c in trained[-n:]),
                    "trained": len(trained)}
            for c in ("ratio_abs_dev", "clip_frac"):
                values = [_f(x[c]) for x in trained if x[c] not in ("", None)]
                row |= {c: statistics.fmean(values), f"{c}_peak": max(values)}
        out.append(row)
    sync = mode_row(summary, "sync-separated")
    for row in out:
        if row["key"] == "off":
            row["lost"] = _f(sync["eval_accuracy_end"]) - _f(row["eval_accuracy_end"])
            if curves:
                ref = {c["iteration"]: c["reward_mean"] for c in curves if c["mode"] == "sync-separated"}
                row["leaves"] = next(c["iteration"] for c in curves if c["mode"] == "async-offpolicy"
                                     and c["reward_mean"] and c["reward_mean"] != ref.get(c["iteration"]))
    return out + [{"key": "", "cpu": machines(summary)}]


def equivalence(rows: Rows) -> list[dict]:
    """On-policy equivalence (equivalence.csv) per case (key): samples identical to sync-separated's
    ('k/n', and `differ`), the weights' largest gap, `iterations`, and where a case parts (`parts`:
    the first iteration's identical fraction below 1, `parts_at`: that iteration; '' when it never does)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        its = [r for r in rows if r["case"] == case]
        same, total = sum(int(r["identical_samples"]) for r in its), sum(int(r["samples"]) for r in its)
        parts = next((r for r in its if _f(r["identical_fraction"]) < 1), None)
        out.append({"key": case, "identical": f"{same}/{total}", "same": same, "samples": total, "differ": total - same,
                    "weights": max(_f(r["max_abs_weight_diff"]) for r in its), "iterations": len(its),
                    "parts": parts["identical_fraction"] if parts else "",
                    "parts_at": parts["iteration"] if parts else ""})
    return out


def multiturn(rows: Rows) -> list[dict]:
    """Episodes with a slow tool (multiturn.csv): per latency spread and mode (key 'p99/mode') the
    speed-up over sync-separated and its spread, the bound and the share of it reached; key 'pa':
    periodic-async at the widest spread, with the single-turn speed-up at the same batch."""
    out = [{"key": f"{r['p99_s']}/{r['mode']}", "p99_s": _f(r["p99_s"]), "mode": r["mode"],
            "speedup": _f(r["speedup_vs_sync_separated"]), "speedup_min": _f(r["speedup_min"]),
            "speedup_max": _f(r["speedup_max"]), "bound": _f(r["bound"]),
            "single_turn": _f(r["single_turn_speedup"]) if r.get("single_turn_speedup") not in (None, "") else None}
           for r in rows]
    widest = max(r["p99_s"] for r in out)
    pa = next(r for r in out if r["p99_s"] == widest and r["mode"] == "periodic-async")
    return out + [{**pa, "key": "pa"}]


def shared_async(rows: Rows) -> list[dict]:
    """Shared prompts and asynchrony together (shared_async*.csv, speed-ups over per-response
    sync-separated): key '' the speed-up of the shared prompt alone, asynchrony alone, both, and the
    product of the two alone; keys 'both' and 'async': those rows."""
    def row(shared: str, mode: str) -> dict:
        return next(r for r in rows if r["shared_prompt"] == shared and r["mode"] == mode)

    both, asyn = row("True", "periodic-async"), row("False", "periodic-async")
    return [{"key": "", "shared": row("True", "sync-separated")["speedup"], "async": asyn["speedup"],
             "both": both["speedup"], "product": mode_row(rows, "product")["speedup"]},
            {**both, "key": "both"}, {**asyn, "key": "async"}]


def _tps(rows: Rows, devices: int) -> float:
    return _f(next(r for r in rows if int(r["devices"]) == devices)["tokens_per_s"])


def best_splits(rows: Rows, mode: str, device: str = "H100-SXM-80GB") -> list[dict]:
    """The simulator's best split per size for `mode` on `device` (scaling_simulated.csv's predictions;
    device 'measured': the device whose costs a GPU check measured), sorted by size."""
    return sorted((r for r in rows if r["kind"] == "simulated" and r["section"] == "prediction" and r["best"] == "True"
                   and r["mode"] == mode and (r["device_type"] == device or device == "measured"
                                              and r["device_type"].endswith(" (measured)"))),
                  key=lambda r: int(r["devices"]))


def scaling(rows: Rows) -> list[dict]:
    """The simulated scale-out (scaling_simulated.csv, example H100 costs): key '' periodic-async's sizes,
    its gain from the smallest and from half the largest size to the largest (`gain`, `gain_half`) and
    each as a share of linear (`linear`, `linear_half`), each mode's tokens/s per size (a list), the
    calibration points and machines; per mode (key): tokens/s by size (column: the size); key 'error':
    the simulator's relative error on the measured points; key 'measured': the same on the GPU check's
    measured costs, with periodic-async over each synchronous mode at the smallest and largest size."""
    modes = ("periodic-async", "sync-separated", "sync-colocated")
    best = {m: best_splits(rows, m) for m in modes}
    sizes = [int(r["devices"]) for r in best["periodic-async"]]
    lo, hi = sizes[0], sizes[-1]
    gain = {s: _tps(best["periodic-async"], hi) / _tps(best["periodic-async"], s) for s in (lo, hi // 2)}
    points = [r for r in rows if r["section"] == "cpu-measured-point"]
    out = [{"key": "", "sizes": sizes, "smallest": lo, "largest": hi, "half": hi // 2, "gain": gain[lo],
            "linear": gain[lo] / (hi / lo), "gain_half": gain[hi // 2], "linear_half": gain[hi // 2] / 2,
            "points": len(points), "cpu": machines(points), **{m: [r["tokens_per_s"] for r in best[m]] for m in modes}},
           {"key": "error", **{f"{c}_{f.__name__}": f(_f(r[c]) for r in points)
                               for c in ("rel_error", "rel_error_leave_out") for f in (min, max)}}]
    out += [{"key": m, **{r["devices"]: r["tokens_per_s"] for r in best[m]}} for m in modes]
    measured = {m: best_splits(rows, m, "measured") for m in modes}
    if measured["periodic-async"]:
        pa, ends = measured["periodic-async"], (int(measured["periodic-async"][0]["devices"]),
                                                int(measured["periodic-async"][-1]["devices"]))
        out.append({"key": "measured", "device": " and ".join(sorted({r["device_type"].removesuffix(" (measured)")
                                                                      for m in modes for r in measured[m]})),
                    "sizes": [int(r["devices"]) for r in pa], "periodic-async": [r["tokens_per_s"] for r in pa],
                    **{f"vs_{SHORT[m]}": tuple(_tps(pa, d) / _tps(measured[m], d) for d in ends) for m in modes[1:]}})
    return out


def soak(summary: Rows, samples: Rows) -> list[dict]:
    """The soak run (soak_summary.csv, soak.csv): key '' its iterations, wall time, requests re-sent
    by the restarted worker and the trace's largest size; 'trainer' and 'workers': mean last RSS
    (`rss`), the workers' RSS slope range (`slope`); 'trainer1'/'trainer2': the trainer's slope and
    iterations per leg; 'fds': open descriptors between a leg's start and end (trainer, workers)."""
    trainer = [r for r in summary if r["process"] == "trainer"]
    workers = [r for r in summary if r["process"] != "trainer"]
    slope = "rss_slope_mib_per_100_iterations"

    def fds(is_trainer: bool) -> tuple[float, float]:
        values = [_f(r["fds"]) for r in samples
                  if r["fds"] and not r["event"] and (r["process"] == "trainer") == is_trainer]
        return min(values), max(values)

    resent = next(r["requests_resent"] for r in summary if r["restarted"] == "yes")
    out = [{**common(summary), "key": "", "resent": resent, "trace": max(_f(r["trace_mib"] or 0) for r in samples)},
           {"key": "trainer", "rss": statistics.fmean(_f(r["rss_last_mib"]) for r in trainer)},
           {"key": "workers", "rss": statistics.fmean(_f(r["rss_last_mib"]) for r in workers),
            "slope": (min(_f(r[slope]) for r in workers if r[slope]), max(_f(r[slope]) for r in workers if r[slope]))},
           {"key": "fds", "trainer": fds(True), "workers": fds(False)}]
    return out + [{"key": f"trainer{r['leg']}", "slope": r[slope], "iterations": (r["first_iteration"],
                                                                                 r["last_iteration"])} for r in trainer]


def test_costs(rows: Rows) -> list[dict]:
    """The default suite's costs (test_costs*.csv): key '' the run's shared columns (commit, machine,
    load, pytest arguments, wall time), `tests` and their summed `seconds`."""
    return [{**common(rows), "key": "", "tests": len(rows), "seconds": sum(_f(r["seconds"]) for r in rows)}]


def weight_sync(rows: Rows) -> list[dict]:
    """weight_sync_collective.csv as docs/scaling.md shows it, one row per preset (key): its weights
    and the seconds of a push through the object store and through the collective (median, min-max)."""
    def s(v: Any) -> str:
        return f"{_f(v):.2g}" if _f(v) < 0.01 else f"{_f(v):.3f}" if _f(v) < 0.1 else f"{_f(v):.2f}"

    by, out = {(r["preset"], r["path"]): r for r in rows}, []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        store, coll = by[(preset, "object_store")], by[(preset, "collective")]
        mb = _f(store["param_bytes"]) / 1e6
        out.append({"key": preset, "preset": preset, "weights": f"{mb:.0f} MB" if mb >= 10 else f"{mb:.1f} MB",
                    **{name: f"{s(r['median_s'])} ({s(r['min_s'])}-{s(r['max_s'])})"
                       for name, r in (("object store", store), ("collective", coll))},
                    "ratio": f"{_f(coll['speedup_vs_object_store']):.2f}x"})
    return out


def test_cost_groups(rows: Rows) -> list[dict]:
    """The default suite's time (test_costs.csv) by what each test starts (key), longest first."""
    total, groups = sum(_f(r["seconds"]) for r in rows), {}
    for r in rows:
        groups.setdefault(r["group"], []).append(_f(r["seconds"]))
    return [{"key": name, "what the test starts": name, "tests": len(s), "seconds": f"{sum(s):.0f}",
             "share": f"{sum(s) / total:.0%}"} for name, s in sorted(groups.items(), key=lambda x: -sum(x[1]))]


def slowest_tests(rows: Rows, n: int = 10) -> list[dict]:
    """The `n` slowest default tests (test_costs.csv lists them slowest first) and what each starts."""
    starts = ("ray", "engine_workers", "vllm_workers", "subprocess_cli", "subprocess_script", "subprocess_other")
    return [{"key": r["test"], "test": f"`{r['test']}`", "seconds": f"{_f(r['seconds']):.1f}",
             "starts": ", ".join(f"{k}={r[k]}" for k in starts if r[k] != "0") or "-"} for r in rows[:n]]


def task_curves(summary: Rows, curves: Rows = ()) -> list[dict]:
    """The reasoning-gym learning runs (reward_curves_tasks_summary.csv): per task (key TASK) its
    sync-separated and periodic-async rows' end accuracies, periodic-async's `gap` to sync-separated
    and the `slack` of two of sync's standard errors, its gain and 95% interval, and the warm start;
    where the task ran them, the gain, interval and end accuracy of periodic-async and sync-separated
    with dynamic sampling (`dyn_*`, with periodic-async's prompts drawn and share filtered per
    iteration; `sdyn_*`) and of the off-policy baseline (`off_*`). From the per-iteration `curves`
    (reward_curves_tasks.csv), periodic-async's mean share of informative groups (rewards not all
    equal) and of fully correct samples in its batches."""
    out = []
    for task in dict.fromkeys(r["task"] for r in summary):
        rows = {r["mode"]: r for r in summary if r["task"] == task}
        sync, pa = rows["sync-separated"], rows["periodic-async"]
        out.append({"key": task, "sync_end": _f(sync["eval_accuracy_end"]), "pa_end": _f(pa["eval_accuracy_end"]),
                    "gap": abs(_f(pa["eval_accuracy_end"]) - _f(sync["eval_accuracy_end"])),
                    "slack": 2 * _f(sync["eval_stderr_end"]), "gain": _f(pa["gain"]),
                    "ci95_low": _f(pa["ci95_low"]), "ci95_high": _f(pa["ci95_high"]),
                    "warm_start": _f(pa["warm_start_accuracy"]), "base": _f(pa["base_accuracy"]),
                    "eval_n": pa["eval_n"], "iterations": pa["iterations"]})
        for mode, short in (("periodic-async+dynamic", "dyn"), ("sync-separated+dynamic", "sdyn"),
                            ("async-offpolicy", "off")):
            if mode in rows:
                out[-1] |= {f"{short}_{c}": _f(rows[mode][c]) for c in ("gain", "ci95_low", "ci95_high",
                                                                        "eval_accuracy_end")}
        if "periodic-async+dynamic" in rows:  # the share of drawn groups that dynamic sampling filtered
            dyn = rows["periodic-async+dynamic"]
            out[-1] |= {"dyn_drawn": _f(dyn["mean_drawn"]),
                        "dyn_filtered_share": _f(dyn["mean_filtered"]) / _f(dyn["mean_drawn"])}
        trained = [r for r in curves if (r["task"], r["mode"]) == (task, "periodic-async") and r["accuracy"] != ""]
        if trained:
            out[-1] |= {c: statistics.mean(_f(r[k]) for r in trained) for c, k in (
                ("informative", "informative_frac"), ("batch_accuracy", "accuracy"))}
    return out


def engine_speed(rows: Rows) -> list[dict]:
    """vLLM's generation speed over the built-in engine per model (key): the range over engine.csv's rows."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        ratios.setdefault(r["model"], []).append(_f(r["vllm_vs_builtin"]))
    return [{"key": m, "vllm_vs_builtin": (min(v), max(v))} for m, v in ratios.items()]


SUMMARIES: dict[str, tuple[Callable[..., list[dict]], tuple[tuple[str, ...], ...]]] = {
    # name -> (the summary, the CSVs (globs) under results/ each of its arguments reads)
    "table2": (table2, (("table2_throughput.csv",),)),
    "tuned": (async_run, (("async_speedup.csv",), ("async_speedup_phases.csv",))),
    "bal": (async_run, (("async_speedup_balanced.csv",), ("async_speedup_balanced_phases.csv",))),
    "real": (async_run, (("async_speedup_real.csv",), ("async_speedup_real_phases.csv",))),
    "runs": (over_runs, (("async_speedup_balanced.csv", "async_speedup_balanced_run*/async_speedup_balanced.csv"),)),
    "contention": (contention, (("phase_contention.csv",),)),
    "shared": (shared_prompt, (("shared_prompt.csv",),)),
    "gpu": (gpu_check, (("gpu/correctness.csv", "gpu/attention.csv", "gpu/trainer.csv", "gpu/engine.csv",
                         "gpu/gpu_check.log"),)),
    "fig1": (fig1, (("fig1_timeline.csv",),)),
    "rc": (reward_curves, (("reward_curves_summary.csv",), ("reward_curves.csv",))),
    "rc1": (reward_curves, (("reward_curves_seed1/reward_curves_summary.csv",),
                            ("reward_curves_seed1/reward_curves.csv",))),
    "rcr": (functools.partial(reward_curves, n=5), (("reward_curves_real_summary.csv",), ("reward_curves_real.csv",))),
    "rct": (reward_curves, (("reward_curves_real_time_summary.csv",),)),
    "tasks": (task_curves, (("reward_curves_tasks_summary.csv",), ("reward_curves_tasks.csv",))),
    "eq": (equivalence, (("equivalence.csv",),)),
    "mt": (multiturn, (("multiturn.csv",),)),
    "sa": (shared_async, (("shared_async.csv",),)),
    "sar": (shared_async, (("shared_async_real.csv",),)),
    "sim": (scaling, (("scaling_simulated.csv",),)),
    "soak": (soak, (("soak_summary.csv",), ("soak.csv",))),
    "tc": (test_costs, (("test_costs.csv",),)),
    "tcb": (test_costs, (("test_costs_busy.csv",),)),
    "weight_sync_collective": (weight_sync, (("weight_sync_collective.csv",),)),
    "test_cost_groups": (test_cost_groups, (("test_costs.csv",),)),
    "test_cost_slowest": (slowest_tests, (("test_costs.csv",),)),
    "engine_speed": (engine_speed, (("engine.csv",),)),
}
"""Every summary of the committed results, by the name the documents' markers start with."""


def summary(results: Path, name: str) -> list[dict]:
    """SUMMARIES[name] of the CSVs under `results`."""
    fn, inputs = SUMMARIES[name]
    return fn(*(read_results(results, *patterns) for patterns in inputs))
