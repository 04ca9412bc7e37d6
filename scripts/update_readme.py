"""Fill README.md and docs/*.md from results/*.csv (never edit a rendered number by hand).

The documents hold the prose; this script holds the numbers and the verdicts of the paper's
claims ("Periodic Asynchrony", arXiv 2511.18871: Table 2, asynchrony against its bound,
shared-prompt attention, Figure 1, the reward curves, on-policy equivalence, the tri-model,
scaling). Two markers:

- `<!-- v:NAME -->1.49x<!-- /v -->` within a sentence: the render puts VALUES[NAME] between the
  two comments, so the Markdown reads as it renders. A reading that depends on the numbers is
  either a verdict computed here (the README's claims table and the GPU check's goals) or fixed
  prose with an assertion over the committed CSV in tests/test_update_readme.py, which fails
  when a new result flips it.
- `<!-- results:NAME -->` ... `<!-- /results:NAME -->` around a table: TABLES (a CSV's columns
  under the line naming its file, commits and machines) or BLOCKS (tables built from CSVs, from
  run_all.sh, from the tests' source, from trl_api.py).

Guarantees: every marker names an entry here (else an error naming the document); a value whose
file, row or column is missing renders `n/a` with one line on stderr naming it; rendering the
committed results again changes nothing (tests/test_update_readme.py).

    python scripts/update_readme.py [--results results] [DOC ...]
"""

import argparse
import ast
import csv
import functools
import re
import statistics
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

DOCS = ["README.md", "docs/results.md", "docs/reproduce.md", "docs/gpu.md", "docs/scaling.md", "docs/usage.md",
        "docs/trl.md"]

# --- the targets the claims are held to (the paper's numbers; README's claims table)
PAPER_ASYNC, PAPER_BOUND = 1.92, 2.0  # asynchrony alone on an 8B model, and its bound
ASYNC_TARGET = PAPER_ASYNC / PAPER_BOUND  # the share of its bound every asynchrony row must reach
TABLE2_TARGET = 3.0  # Table 2 on GPU: up to 3x a mainstream framework
SHARED_TARGET = 8.0  # shared-prompt attention on long prompts: about 8x
LINEAR_TARGET = 0.9  # near-linear scaling, read as at least 0.9 of linear
LORA_WEIGHTS, LORA_BYTES, LORA_GAIN = 1.1, 0.1, 0.2  # LoRA: tri-model weights / one model, push bytes / full's,
# held-out gain after the full fine-tuning curve's iterations
GPU_SECONDS, GPU_BOUND_TARGET, GPU_MFU_TARGET = 480, 0.8, 0.35  # the GPU check's goals
GPU_SHAPE = ("4096", "16", "256")  # P, G, R of the GPU attention goal


# --- formats: a cell (or a computed number) as the documents print it
def _f(spec: str, suffix: str = "", scale: float = 1.0):
    return lambda v: f"{float(v) * scale:{spec}}{suffix}"


X1, X2, X3, F1, F2, F3, G3, E1, INT = (_f(".1f", "x"), _f(".2f", "x"), _f(".3f", "x"), _f(".1f"), _f(".2f"),
                                       _f(".3f"), _f(".3g"), _f(".1e"), _f(".0f"))
PTS, PT, PCT, K = _f("+.1f", scale=100), _f(".1f", scale=100), _f("+.0f", "%", 100), _f(".1f", "k", 1e-3)
STR, CODE, COMMIT = str, "`{}`".format, (lambda v: v[:7])
MIN = lambda v: f"{float(v):.0f} s" if float(v) < 120 else f"{float(v) / 60:.0f} min"  # '74 s', else '3 min'

# --- row filters (a dict: the rows whose columns hold its values) and the derivations VALUES shares
PA, SEP, COL, OFF = ({"mode": m} for m in ("periodic-async", "sync-separated", "sync-colocated", "async-offpolicy"))
T2_BEST = {"system": "periodic-async", "shared_prompt": "True"}  # Table 2's rows of periodic-async at its best
BOTH = {"shared_prompt": "True", "mode": "periodic-async"}  # shared prompts and asynchrony together
_first = lambda rows: rows[:1]
_status = lambda prefix: lambda rows: [r for r in rows if r.get("status", "").startswith(prefix)]
_mode = lambda rows, mode: next(r for r in rows if r["mode"] == mode)
_median = lambda col: lambda rows: statistics.median(float(r[col]) for r in rows)
_mean = lambda col: lambda rows: statistics.fmean(float(r[col]) for r in rows if r[col] not in ("", None))
_range = lambda col: lambda rows: tuple(f(float(r[col]) for r in rows if r[col]) for f in (min, max))
_cpu = lambda rows: "; ".join(sorted({r["cpu"] for r in rows if r.get("cpu")})) or "not recorded"  # the machines
_split = lambda rows: [r for r in rows if r["backend"] == "split"] or rows  # shared_prompt.csv's split back-end
_gpu_seconds = lambda rows: int(re.search(r"== results \((\d+)s in all\)", rows[0]["text"]).group(1))
_parts = lambda rows: next(r for r in rows if float(r["identical_fraction"]) < 1)  # an equivalence case parts
_tps = lambda rows, devices: float(next(r for r in rows if int(r["devices"]) == int(devices))["tokens_per_s"])
_sizes = lambda rows: sorted({int(r["devices"]) for r in rows})
_gain = lambda rows, lo=None: _tps(rows, _sizes(rows)[-1]) / _tps(rows, lo or _sizes(rows)[0])  # largest over lo
_linear = lambda rows: _gain(rows) / (_sizes(rows)[-1] / _sizes(rows)[0])
_mfu = lambda rows: [max((r for r in _status("ok")(rows) if r["model"] == "qwen2.5-1.5b"),  # the GPU trainer's best
                         key=lambda r: float(r["mfu"]))]  # row on the 1.5B architecture
_steady = lambda trainer: lambda rows: [  # the soak's samples of the trainer (else the workers) between a leg's
    r for r in rows if r["fds"] and not r["event"] and (r["process"] == "trainer") == trainer]  # start and end


def _gpu_at_shape(rows):
    """The GPU check's shared-prompt rows at GPU_SHAPE, each with its fraction of the token bound."""
    return [{**r, "of_bound": float(r["speedup_vs_per_response"]) / float(r["token_bound"])} for r in rows
            if r.get("status", "").startswith("ok") and (r["P"], r["G"], r["R"]) == GPU_SHAPE
            and r.get("speedup_vs_per_response")]


def _leaves(rows):
    """The first iteration whose off-policy training reward differs from sync-separated's."""
    sync = {r["iteration"]: r["reward_mean"] for r in rows if r["mode"] == "sync-separated"}
    return next(r["iteration"] for r in rows if r["mode"] == "async-offpolicy" and r["reward_mean"]
                and r["reward_mean"] != sync.get(r["iteration"]))


def _best(device="H100-SXM-80GB", **match):
    """The simulated predictions' best split per mode and size on `device` ("measured": the device
    whose costs the GPU check measured), sorted by size."""
    return lambda rows: sorted((r for r in rows if r["kind"] == "simulated" and r["section"] == "prediction"
                                and r["best"] == "True" and (r["device_type"] == device or device == "measured"
                                                             and r["device_type"].endswith(" (measured)"))
                                and all(r[k] == v for k, v in match.items())), key=lambda r: int(r["devices"]))


def _vs(mode, device):
    """Periodic-async's tokens/s over `mode`'s at the smallest and the largest size on `device`."""
    def ratio(rows):
        pa, other = _best(device, mode="periodic-async")(rows), _best(device, mode=mode)(rows)
        return tuple(_tps(pa, d) / _tps(other, d) for d in (_sizes(pa)[0], _sizes(pa)[-1]))
    return ratio


# --- verdicts: each claim's measurement against its target (README's claims table)
def _verdict(missed, by: str = "", reason: str = "", detail: str = "") -> str:
    """**met**, or when `missed`: by how much, why in a word (CPU, scale, ...), then what says so."""
    return f"**missed by {by}** ({reason}" + (f": {detail}" if detail else "") + ")" if missed else "**met**"


def _table2_verdict(rows):
    low = [r for r in rows if float(r["speedup_vs_trl"]) < TABLE2_TARGET]
    met = [r["setting"] for r in rows if r not in low]
    return _verdict(low, f"{TABLE2_TARGET - min((float(r['speedup_vs_trl']) for r in low), default=0):.1f}x", "CPU",
                    ", ".join(f"{r['setting']} {X1(r['speedup_vs_trl'])}" for r in low)
                    + (f"; met on {' and '.join(met)}" if met else ""))


def _async_verdict(rows):
    """Asynchrony on the median of its runs (one periodic-async row each), met at the paper's share
    of the bound; a miss is put on the CPU when most of the gap is the two phases slowing each other
    (bound -> bound_overlapped), else on scale (the head and tail of each iteration)."""
    speedup, bound, efficiency = (statistics.median(float(r[k]) for r in rows)
                                  for k in ("speedup_vs_sync_separated", "bound", "efficiency"))
    over = [float(r["bound_overlapped"]) for r in rows if r.get("bound_overlapped")]
    cpu = over and bound - statistics.median(over) > statistics.median(over) - speedup
    return _verdict(efficiency < ASYNC_TARGET - 1e-9, f"{ASYNC_TARGET - efficiency:.2f} of the bound",
                    *(("CPU", "most of the gap is the two phases slowing each other on shared cores") if cpu else
                      ("scale", "most of the gap is each iteration's head and tail, large at a CPU-sized batch")))


def _shared_verdict(rows):
    top = max(rows, key=lambda r: float(r["token_bound"]))
    return _verdict(float(top["speedup"]) < SHARED_TARGET, f"{SHARED_TARGET - float(top['speedup']):.1f}x", "scale",
                    f"P={top['P']}, G={top['G']}, R={top['R']}: {X1(top['speedup'])}, token bound "
                    f"{X1(top['token_bound'])}")


def _shared_async_verdict(rows):
    joint, asyn = (next(r for r in rows if r["shared_prompt"] == s and r["mode"] == "periodic-async")
                   for s in ("True", "False"))
    gap = float(_mode(rows, "product")["speedup"]) - float(joint["speedup"])
    return _verdict(gap > 0, f"{gap:.2f}x", "scale", f"with the shared prompt asynchrony keeps "
                    f"{float(joint['efficiency']):.2f} of its bound, without it {float(asyn['efficiency']):.2f}"
                    if joint.get("efficiency") and asyn.get("efficiency") else "")


def _fig1_verdict(rows):
    """Met when periodic-async trains while generating in every iteration, sync-separated in none,
    and periodic-async's iterations are the shorter."""
    asyn, sync = [r for r in rows if r["mode"] == "periodic-async"], [r for r in rows if r["mode"] == "sync-separated"]
    if wrong := sum((r["trains_while_generating"] == "True") != (r["mode"] == "periodic-async") for r in asyn + sync):
        return _verdict(True, f"{wrong} of {len(asyn) + len(sync)} iterations", "scale")
    gap = _mean("wall_s")(asyn) - _mean("wall_s")(sync)
    return _verdict(gap >= 0, f"{gap:.2f} s an iteration", "scale")


def _overlap_verdict(rows):
    """Met when periodic-async ends within two standard errors of sync-separated's held-out
    accuracy in every run given (one file per seed)."""
    gaps = []
    for file in dict.fromkeys(r["_file"] for r in rows):
        sync, pa = (_mode([r for r in rows if r["_file"] == file], m) for m in ("sync-separated", "periodic-async"))
        gaps.append(abs(float(pa["eval_accuracy_end"]) - float(sync["eval_accuracy_end"]))
                    - 2 * float(sync["eval_stderr"]))
    return _verdict(max(gaps) > 0, f"{100 * max(gaps):.1f} points", "scale")


EQUIVALENT = {"equivalent": "two-steps", "real-model": "real-model-two-steps",
              "real-model-lora": "real-model-lora-two-steps"}
"""The equivalence cases and their negative controls (2 optimizer steps per iteration)."""


def _equivalence_verdict(rows):
    eq = [r for r in rows if r["case"] in EQUIVALENT]
    if differ := sum(int(r["samples"]) - int(r["identical_samples"]) for r in eq):
        return _verdict(True, f"{differ} of {sum(int(r['samples']) for r in eq)} samples", "precision")
    blind = [c for c in EQUIVALENT.values() if any(r["case"] == c for r in rows)
             and all(float(r["identical_fraction"]) == 1 for r in rows if r["case"] == c)]
    return _verdict(blind, "a control that never parts", "check", ", ".join(blind))


def _lora_verdict(rows):
    """LoRA's tri-model (lora_trimodel.csv), barrier (lora_push.csv), trajectory (equivalence.csv's
    real-model-lora) and learning (lora_learning.csv) against LORA_*: every goal it misses, each with its reason."""
    of = lambda file, **match: [r for r in rows if r["_file"] == file and all(r[k] == v for k, v in match.items())]
    kept = float(of("lora_trimodel.csv", mode="lora", variant="all_kept")[0]["weights_vs_one_model"])
    push, final = of("lora_push.csv", mode="lora"), of("lora_learning.csv", kind="final")
    eq = of("equivalence.csv", case="real-model-lora")
    differ = sum(int(r["samples"]) - int(r["identical_samples"]) for r in eq)
    missed = ([(f"{kept - LORA_WEIGHTS:.3f}x one model's weights", "layout")] if kept > LORA_WEIGHTS else []) \
        + ([("the trajectory", "not measured")] if not eq else
           [(f"{differ} samples off sync-separated's", "precision")] if differ else []) \
        + ([("its push bytes", "layout")] if not push or any(float(r["bytes_vs_full"]) > LORA_BYTES for r in push)
           else []) \
        + [(f"{float(r['push_check_vs_full']) - 1:.3f}x of full's push + check ({r['engine']}: "
            f"{float(r['push_check_vs_full']):.3f}x, rounds {X2(r['push_check_vs_full_min'])}-"
            f"{X2(r['push_check_vs_full_max'])})",
            "CPU: the check's two forwards through the unmerged adapter")
           for r in push if float(r["push_check_vs_full"]) > 1] \
        + ([("the learning run", "not measured")] if not final else
           [(f"{PT(LORA_GAIN - float(final[0]['gain']))} points of held-out gain", "learning")]
           if float(final[0]["gain"]) < LORA_GAIN else [])
    return _verdict(missed, "; ".join(m for m, _ in missed), ", ".join(dict.fromkeys(r for _, r in missed)))


def _48_vs_64_verdict(rows):
    a48 = _tps(_best(mode="periodic-async")(rows), 48)
    above = [m for m in ("sync-separated", "sync-colocated") if a48 > _tps(_best(mode=m)(rows), 64)]
    below = [m for m in ("sync-separated", "sync-colocated") if m not in above]
    return ("**simulated** (" + (f"above {' and '.join(above)}" if above else "above neither")
            + (f", below {' and '.join(below)}" if above and below else "") + ")")


# --- VALUES: every number the documents quote, by the name of its marker:
#   NAME -> (file under results/ (a tuple: several files, globs allowed, rows concatenated; None: no file),
#            row filter (a dict of column values, or a function of the rows),
#            the column (a tuple of columns prints "a-b"), or a function of the filtered rows (a list prints "a / b"),
#            format (left out: as it is))
# A column names the one row the filter leaves; a function gets every row it leaves.
T2, SIM, SOAK, TC, EQ = ("table2_throughput.csv", "scaling_simulated.csv", "soak_summary.csv", "test_costs.csv",
                         "equivalence.csv")
RUNS = ("async_speedup_balanced.csv", "async_speedup_balanced_run*/async_speedup_balanced.csv")
GA, GC, GT, GLOG = "gpu/attention.csv", "gpu/correctness.csv", "gpu/trainer.csv", "gpu/gpu_check.log"
GPU_ALL = (GC, GA, GT, "gpu/engine.csv")
SEEDS = ("reward_curves_summary.csv", "reward_curves_seed1/reward_curves_summary.csv")
SLOWEST = 10  # how many of the slowest default tests docs/reproduce.md lists


def _cols(prefix, file, where, plain="", **formatted):
    """VALUES entries `prefix.column` for several columns of one row: `plain` (space-separated) as they are."""
    return {f"{prefix}.{c}": (file, where, c, fmt) for c, fmt in {**dict.fromkeys(plain.split(), STR),
                                                                  **formatted}.items()}


VALUES: dict[str, tuple] = {  # the targets (the paper's numbers) the claims' verdicts hold the measurements to
    f"target.{k}": (None, None, lambda _, v=v: v, fmt) for k, v, fmt in (
        ("table2", TABLE2_TARGET, _f("g", "x")), ("async", ASYNC_TARGET, F2), ("shared", SHARED_TARGET, _f("g", "x")),
        ("linear", LINEAR_TARGET, _f("g")), ("lora_weights", LORA_WEIGHTS, _f("g", "x")),
        ("lora_bytes", LORA_BYTES, _f("g")), ("lora_gain", LORA_GAIN, PTS), ("gpu_minutes", GPU_SECONDS / 60, _f("g")),
        ("gpu_bound", GPU_BOUND_TARGET, _f("g")), ("gpu_mfu", GPU_MFU_TARGET, _f(".0%")),
        ("gpu_shape", "P={}, G={}, R={}".format(*GPU_SHAPE), STR))}
VALUES |= {  # Table 2: periodic-async with the shared prompt against TRL, per setting
    "verdict.table2": (T2, T2_BEST, _table2_verdict),
    "t2.vs_colocated": (T2, T2_BEST, lambda rows: [r["speedup_vs_sync_colocated"] for r in rows
                                                   if r["speedup_vs_sync_colocated"]], X2),
    "t2.measured_iterations": (T2, T2_BEST, lambda rows: sorted({r["measured_iterations"] for r in rows} - {""})),
    "t2.cpu": (T2, T2_BEST, _cpu),
}
for _s in ("real-model", "long-prompt", "short-prompt"):
    VALUES |= _cols(f"t2.{_s}", T2, _row := {**T2_BEST, "setting": _s}, "repeats", speedup_vs_trl=X1,
                    mean_prompt_tokens=INT)
    VALUES[f"t2.{_s}.range"] = (T2, _row, ("speedup_vs_trl_min", "speedup_vs_trl_max"), X1)

# Asynchrony alone, one run: its modes' ratios (pa, col) and the phases alone (sep) and overlapped (pa)
for _tag, _main in (("bal", "async_speedup_balanced"), ("real", "async_speedup_real"), ("tuned", "async_speedup")):
    _main, _phases = f"{_main}.csv", f"{_main}_phases.csv"
    VALUES |= _cols(f"{_tag}.pa", _main, PA, "repeats", speedup_vs_sync_separated=X2, bound=X2, efficiency=F2,
                    bound_overlapped=X2, speedup_vs_sync_colocated=X2)
    VALUES |= {f"{_tag}.col.speedup_vs_sync_separated": (_main, COL, "speedup_vs_sync_separated", X2),
               f"{_tag}.pa.speedup_range": (_main, PA, ("speedup_min", "speedup_max"), X2),
               f"{_tag}.pa.of_overlapped": (_main, PA, lambda rows: float(rows[0]["speedup_vs_sync_separated"])
                                            / float(rows[0]["bound_overlapped"]), F2)}
    for _m, _where in (("sep", SEP), ("pa", PA)):
        VALUES |= {f"{_tag}.{_m}.mean_{p}_s": (_phases, _where, f"mean_{p}_s", F2) for p in
                   ("generate", "train", "iteration", "sync", "first_group", "after_generation", "train_thread_cpu")}
    for _p in ("generate", "train", "train_thread_cpu"):  # overlapped against alone, a relative change
        VALUES[f"{_tag}.{_p}_slower"] = (_phases, None, lambda rows, c=f"mean_{_p}_s": float(
            _mode(rows, "periodic-async")[c]) / float(_mode(rows, "sync-separated")[c]) - 1, PCT)
# ... the balanced workload's runs together: the median over the runs (one periodic-async row each) and its range
VALUES |= {"runs.count": (RUNS, PA, len), "verdict.runs": (RUNS, PA, _async_verdict),
           "verdict.real": ("async_speedup_real.csv", PA, _async_verdict)}
for _m, _where in (("pa", PA), ("col", COL)):
    for _c, _fmt in (("speedup_vs_sync_separated", X2), ("efficiency", F2), ("bound", X2),
                     ("speedup_vs_sync_colocated", X2)):
        VALUES |= {f"runs.{_m}.{_c}": (RUNS, _where, _median(_c), _fmt),
                   f"runs.{_m}.{_c}.range": (RUNS, _where, _range(_c), _fmt)}
# ... and the two phases as bare processes: pinned apart, and the trainer waiting before each step
for _model in ("sft-qwen2-1m", "smollm2-135m-instruct"):
    for _p in ("trainer", "engine"):
        VALUES[f"contention.{_model}.{_p}"] = ("phase_contention.csv", dict(model=_model, case="pinned", process=_p),
                                               "vs_alone", F2)
    VALUES[f"contention.{_model}.waits"] = (
        "phase_contention.csv", dict(model=_model, process="trainer"),
        lambda rows: float(next(r for r in rows if r["case"] == "trainer_waits")["step_cpu_ms"])
        / float(next(r for r in rows if r["case"] == "alone")["step_cpu_ms"]) - 1, PCT)

VALUES |= {  # shared-prompt attention alone: the best shape, and the share of the bound over the shapes
    "verdict.shared": ("shared_prompt.csv", _split, _shared_verdict),
    **_cols("shared.top", "shared_prompt.csv", lambda rows: [max(_split(rows), key=lambda r: float(r["speedup"]))],
            "P G R", speedup=X1, token_bound=X1),
    "shared.efficiency": ("shared_prompt.csv", _split, _range("efficiency"), F2),
    "shared.shapes": ("shared_prompt.csv", _split, len),
}
VALUES |= {  # the GPU check (results/gpu): its goals and the shared-prompt attention at the paper's shapes
    **_cols("gpu", GC, _first, "gpu memory_gb torch cuda src_sha", commit=COMMIT),
    "gpu.seconds": (GLOG, None, _gpu_seconds),
    "verdict.gpu_seconds": (GLOG, None, lambda rows: "**met**" if _gpu_seconds(rows) < GPU_SECONDS else "**missed**"),
    "verdict.gpu_failed": (GPU_ALL, _status("FAILED"), lambda rows: _verdict(
        rows, f"{len(rows)} check{'s' * (len(rows) > 1)}", "GPU", "which and why: the correctness table")),
    "gpu.passed": (GC, _status("ok"), len),
    "gpu.failed": (GC, _status("FAILED"), len),
    "gpu.skipped": (GPU_ALL, _status("skipped"), lambda rows: ", ".join(
        f"{Path(f).stem} {n}" for f, n in Counter(r["_file"] for r in rows).items()) or "none"),
    "verdict.gpu_shared": (GA, _gpu_at_shape, lambda rows: (lambda best: _verdict(
        best["of_bound"] < GPU_BOUND_TARGET, f"{GPU_BOUND_TARGET - best['of_bound']:.2f} of the bound", "GPU",
        f"best {best['backend']}"))(max(rows, key=lambda r: r["of_bound"]))),
    "gpu.token_bound": (GA, _gpu_at_shape, lambda rows: rows[0]["token_bound"], X1),
    "gpu.repeats": (GA, lambda rows: [r for r in _status("ok")(rows) if (r["P"], r["G"], r["R"]) == GPU_SHAPE],
                    lambda rows: " to ".join(dict.fromkeys(str(f(int(r["repeats"]) for r in rows))
                                                           for f in (min, max)))),
    "verdict.gpu_mfu": (GT, _mfu, lambda rows: _verdict(float(rows[0]["mfu"]) < GPU_MFU_TARGET, "{:.0f} points".format(
        100 * (GPU_MFU_TARGET - float(rows[0]["mfu"]))), "GPU", "the trainer table")),
    **_cols("gpu.mfu", GT, _mfu, "models attention packed_tokens", mfu=_f(".1%")),
    "gpu.peak_tflops": (GT, _first, "peak_tflops"),
}
for _b in ("flex", "split"):
    VALUES |= _cols(f"gpu.{_b}", GA, lambda rows, b=_b: [r for r in _gpu_at_shape(rows) if r["backend"] == b],
                    speedup_vs_per_response=X1, of_bound=F2)

# Shared prompts and asynchrony together: speedups over per-response sync-separated
for _tag, _file in (("sa", "shared_async.csv"), ("sar", "shared_async_real.csv")):
    VALUES[f"{_tag}.verdict"] = (_file, None, _shared_async_verdict)
    for _name, _where in (("shared", {"shared_prompt": "True", "mode": "sync-separated"}), ("both", BOTH),
                          ("async", {"shared_prompt": "False", "mode": "periodic-async"}),
                          ("product", {"mode": "product"})):
        VALUES[f"{_tag}.{_name}"] = (_file, _where, "speedup", X2)
    VALUES |= _cols(f"{_tag}.both", _file, BOTH, "repeats", mean_prompt_tokens=INT)

# Figure 1: does training start while generating, the order trained, the iteration's time
VALUES["verdict.fig1"] = ("fig1_timeline.csv", None, _fig1_verdict)
for _m, _where in (("pa", PA), ("sep", SEP)):
    VALUES |= {f"fig1.{_m}.trains": ("fig1_timeline.csv", _where, lambda rows: "{}/{}".format(
                   sum(r["trains_while_generating"] == "True" for r in rows), len(rows))),
               f"fig1.{_m}.order": ("fig1_timeline.csv", _where, lambda rows: rows[0]["trained_order"]),
               f"fig1.{_m}.wall": ("fig1_timeline.csv", _where, _mean("wall_s"), F2),
               f"fig1.{_m}.iterations": ("fig1_timeline.csv", _where, len)}

# Reward curves, per run: each mode's held-out accuracy and gaps to sync, the training reward over the first
# and last `_n` iterations, the off-policy mode's importance ratios and where it leaves sync's reward
VALUES |= {"verdict.rc": (SEEDS, None, _overlap_verdict),
           "rc.seeds": (SEEDS, None, lambda rows: len({r["_file"] for r in rows})),
           "verdict.rcr": ("reward_curves_real_summary.csv", None, _overlap_verdict)}
for _tag, _summary, _curves, _n in (("rc", SEEDS[0], "reward_curves.csv", 10),
                                    ("rc1", SEEDS[1], "reward_curves_seed1/reward_curves.csv", 10),
                                    ("rcr", "reward_curves_real_summary.csv", "reward_curves_real.csv", 5),
                                    ("rct", "reward_curves_real_time_summary.csv", None, 0)):
    VALUES[f"{_tag}.cpu"] = (_summary, None, _cpu)
    VALUES[f"{_tag}.off.lost"] = (_summary, None, lambda rows: float(_mode(rows, "sync-separated")["eval_accuracy_end"])
                                  - float(_mode(rows, "async-offpolicy")["eval_accuracy_end"]), _f(".0f", scale=100))
    for _m, _where in (("sync", SEP), ("pa", PA), ("off", OFF)):
        VALUES |= _cols(f"{_tag}.{_m}", _summary, _where, "eval_n tokens_identical_iterations", eval_accuracy_start=F3,
                        eval_accuracy_end=F3, eval_stderr=F3, gain=PTS, gain_stderr=PT, gain_stderr_paired=PT,
                        max_abs_diff_vs_sync=G3, max_abs_diff_reward=G3, max_abs_diff_eval=G3, wall_s=MIN)
        VALUES[f"{_tag}.{_m}.wall_min"] = (_summary, _where, "wall_s", _f(".1f", scale=1 / 60))
        for _i, _part in enumerate(("same", "iterations")):  # of tokens_identical_iterations, "same/iterations"
            VALUES[f"{_tag}.{_m}.{_part}"] = (_summary, _where, lambda rows, i=_i: rows[0][
                "tokens_identical_iterations"].split("/")[i])
    for _m in ("sync-separated", "async-offpolicy") if _curves else ():
        _key = f"{_tag}.{'sync' if _m == 'sync-separated' else 'off'}"
        _trained = lambda rows, m=_m: [r for r in rows if r["mode"] == m and r["reward_mean"]]
        VALUES |= {f"{_key}.reward_first": (_curves, _trained, lambda rows, n=_n: _mean("reward_mean")(rows[:n]), F2),
                   f"{_key}.reward_last": (_curves, _trained, lambda rows, n=_n: _mean("reward_mean")(rows[-n:]), F2),
                   f"{_key}.trained": (_curves, _trained, len)}
        for _c, _fmt in (("ratio_abs_dev", F3), ("clip_frac", _f(".2f", "%", 100))):
            VALUES |= {f"{_key}.{_c}": (_curves, _trained, _mean(_c), _fmt), f"{_key}.{_c}_peak": (
                _curves, _trained, lambda rows, c=_c: max(float(r[c]) for r in rows if r[c]), _fmt)}
    if _curves:
        VALUES[f"{_tag}.off.leaves"] = (_curves, None, _leaves)

# On-policy equivalence per case and its control: samples identical, the weights' largest gap, where it parts
VALUES["verdict.eq"] = (EQ, None, _equivalence_verdict)
for _tag, _case in (("tiny", "equivalent"), ("real", "real-model"), ("tiny_control", "two-steps"),
                    ("real_control", "real-model-two-steps"), ("lora", "real-model-lora"),
                    ("lora_control", "real-model-lora-two-steps")):
    _where = {"case": _case}
    VALUES |= {f"eq.{_tag}.identical": (EQ, _where, lambda rows: "{}/{}".format(
                   sum(int(r["identical_samples"]) for r in rows), sum(int(r["samples"]) for r in rows))),
               f"eq.{_tag}.weights": (EQ, _where, lambda rows: max(float(r["max_abs_weight_diff"]) for r in rows), E1),
               f"eq.{_tag}.iterations": (EQ, _where, len),
               f"eq.{_tag}.parts": (EQ, _where, lambda rows: _parts(rows)["identical_fraction"], _f(".0%")),
               f"eq.{_tag}.parts_at": (EQ, _where, lambda rows: _parts(rows)["iteration"])}

VALUES |= {  # the tri-model, and LoRA's tri-model and barrier against full fine-tuning
    "verdict.tri": ("trimodel_cost.csv", {"variant": "tri_full"}, lambda rows: _verdict(
        round(float(rows[0]["memory_ratio"]), 1) != 3.0, f"{abs(3 - float(rows[0]['memory_ratio'])):.1f}x one "
        "model's weights", "layout")),
    **_cols("tri.full", "trimodel_cost.csv", {"variant": "tri_full"}, "dtype packed_tokens repeats", memory_ratio=X1,
            ratio_vs_policy_only=X2, preset=CODE),
    **_cols("tri.skip_old", "trimodel_cost.csv", {"variant": "tri_skip_old"}, memory_ratio=X1,
            ratio_vs_policy_only=X2),
    "verdict.lora": (("lora_trimodel.csv", "lora_push.csv", "lora_learning.csv", EQ), None, _lora_verdict),
    **_cols("lora.kept", "lora_trimodel.csv", {"mode": "lora", "variant": "all_kept"}, "model lora_rank rounds",
            weights_vs_one_model=X3, micro_step_vs_full=X2, peak_rss_vs_full=X2),
    **_cols("lora.learn", "lora_learning.csv", {"kind": "final"}, "iterations eval_n chosen_by", lr=_f("g"),
            eval_accuracy_start=PT, eval_accuracy_end=PT, gain=PTS, gain_stderr_paired=PT),
    "lora.full_gain": ("reward_curves_real_summary.csv", {"mode": "sync-separated"}, "gain", PTS),
    "lora.sweep.lr": ("lora_learning.csv", {"kind": "sweep"}, lambda rows: [r["lr"] for r in rows], _f("g")),
    "lora.sweep.validation": ("lora_learning.csv", {"kind": "sweep"},
                              lambda rows: [r["validation_accuracy"] for r in rows], _f(".0f", "%", 100)),
    **_cols("lora.sweep.best", "lora_learning.csv", {"kind": "sweep", "chosen": "True"}, "iterations validation_n",
            lr=_f("g")),
    **{f"lora.{_e}.gen_vs_full": ("lora_push.csv", {"engine": _e, "mode": "lora"}, "gen_vs_full", X2)
       for _e in ("local", "vllm")},
    **_cols("lora.full", "lora_trimodel.csv", {"mode": "full", "variant": "all_kept"}, weights_vs_one_model=X1),
    "lora.push_rounds": ("lora_push.csv", _first, "rounds"),
}
for _v in ("full", "lora"):  # the iteration with LoRA (merged push) against full, each mode its best setting
    for _m, _t in (("periodic-async", "pa"), ("sync-separated", "ss")):
        VALUES |= _cols(f"lora.iter.{_v}.{_t}", "lora_iteration.csv", {"variant": _v, "mode": _m}, "repeats",
                        speedup_vs_sync_separated=X2, tokens_per_s_vs_full=X2, mean_train_s=F1, mean_sync_s=F2,
                        mean_generate_s=F1)
        VALUES[f"lora.iter.{_v}.{_t}.vs_full_range"] = ("lora_iteration.csv", {"variant": _v, "mode": _m}, (
            "tokens_per_s_vs_full_min", "tokens_per_s_vs_full_max"), X2)
for _e in ("local", "vllm"):
    _where = {"engine": _e, "mode": "lora"}
    VALUES |= _cols(f"lora.{_e}", "lora_push.csv", _where, push_check_s=F2, push_check_vs_full=X2, bytes_vs_full=F3)
    VALUES[f"lora.{_e}.mib"] = ("lora_push.csv", _where, "bytes", _f(".1f", scale=2 ** -20))
    VALUES[f"lora.{_e}.vs_full_range"] = ("lora_push.csv", _where, ("push_check_vs_full_min",
                                                                    "push_check_vs_full_max"), X2)

# Scaling: measured at 1-2 engine workers and trainer ranks, simulated beyond (best split per mode and size)
VALUES |= _cols("sm", "scaling_measured.csv", _first, "repeats measured_iterations_per_run cpu_cores",
                git_commit=COMMIT)
for _s in ("sync-separated/e1", "sync-separated/e2", "periodic-async/e1", "periodic-async/e2", "sync-separated/r1",
           "sync-separated/r2"):
    VALUES |= _cols(f"sm.{_s}", "scaling_measured.csv", {"system": _s}, speedup_vs_1=X2, generate_s=F2, train_s=F2)
    VALUES[f"sm.{_s}.spread"] = ("scaling_measured.csv", {"system": _s}, ("speedup_vs_1_min", "speedup_vs_1_max"), F2)
_POINTS, _PA = {"section": "cpu-measured-point"}, _best(mode="periodic-async")
VALUES |= {
    **{f"sim.error.{c}_{f.__name__}": (SIM, _POINTS, lambda rows, c=c, f=f: f(float(r[c]) for r in rows),
                                       _f("+.1%")) for c in ("rel_error", "rel_error_leave_out") for f in (min, max)},
    "sim.points": (SIM, _POINTS, len),
    "sim.cpu": (SIM, _POINTS, _cpu),
    "sim.sizes": (SIM, _PA, _sizes),
    "sim.smallest": (SIM, _PA, lambda rows: _sizes(rows)[0]),
    "sim.largest": (SIM, _PA, lambda rows: _sizes(rows)[-1]),
    "sim.half": (SIM, _PA, lambda rows: _sizes(rows)[-1] // 2),
    "sim.gain": (SIM, _PA, _gain, X2),
    "sim.linear": (SIM, _PA, _linear, F2),
    "sim.gain_half": (SIM, _PA, lambda rows: _gain(rows, _sizes(rows)[-1] // 2), X2),
    "sim.linear_half": (SIM, _PA, lambda rows: _gain(rows, _sizes(rows)[-1] // 2) / 2, F2),
    "verdict.scaling": (SIM, _PA, lambda rows: f"**simulated** ({_linear(rows):.2f} of linear: "
                        f"{'at or above' if _linear(rows) >= LINEAR_TARGET else 'below'} the target)"),
    "verdict.48_vs_64": (SIM, None, _48_vs_64_verdict),
    "sim.measured.device": (SIM, _best("measured"), lambda rows: " and ".join(sorted(
        {r["device_type"].removesuffix(" (measured)") for r in rows}))),
    "sim.measured.sizes": (SIM, _best("measured", mode="periodic-async"), _sizes),
    "sim.measured.periodic-async": (SIM, _best("measured", mode="periodic-async"),
                                    lambda rows: [r["tokens_per_s"] for r in rows], K),
    "sim.measured.vs_sep": (SIM, None, _vs("sync-separated", "measured"), X2),
    "sim.measured.vs_col": (SIM, None, _vs("sync-colocated", "measured"), X2),
    **_cols("ws", "weight_sync_collective.csv", _first, "workers", git_commit=COMMIT),
}
for _m in ("periodic-async", "sync-separated", "sync-colocated"):
    VALUES[f"sim.{_m}"] = (SIM, _best(mode=_m), lambda rows: [r["tokens_per_s"] for r in rows], K)
    for _d in ("48", "64"):
        VALUES[f"sim.{_m}.{_d}"] = (SIM, _best(mode=_m, devices=_d), "tokens_per_s", K)

# The soak run (docs/usage.md): each process's memory growth, open descriptors, the trace on disk
_WORKERS = lambda rows: [r for r in rows if r["process"] != "trainer"]
VALUES |= {
    **_cols("soak", SOAK, _first, "iterations", wall_s=MIN),
    "soak.resent": (SOAK, {"restarted": "yes"}, "requests_resent"),
    "soak.trainer.rss": (SOAK, {"process": "trainer"}, _mean("rss_last_mib"), INT),
    "soak.workers.rss": (SOAK, _WORKERS, _mean("rss_last_mib"), INT),
    "soak.workers.slope": (SOAK, _WORKERS, _range("rss_slope_mib_per_100_iterations"), F1),
    "soak.fds.trainer": ("soak.csv", _steady(True), _range("fds"), INT),
    "soak.fds.workers": ("soak.csv", _steady(False), _range("fds"), INT),
    "soak.trace": ("soak.csv", None, lambda rows: max(float(r["trace_mib"] or 0) for r in rows), F2),
}
for _leg in ("1", "2"):
    _where = {"process": "trainer", "leg": _leg}
    VALUES[f"soak.trainer{_leg}.slope"] = (SOAK, _where, "rss_slope_mib_per_100_iterations", F1)
    VALUES[f"soak.trainer{_leg}.iterations"] = (SOAK, _where, ("first_iteration", "last_iteration"))

# The default suite's time (docs/reproduce.md), quiet and beside a busy process
for _tag, _file in (("tc", TC), ("tcb", "test_costs_busy.csv")):
    VALUES |= _cols(_tag, _file, _first, "cpu cores load", pytest_args=CODE, git_commit=lambda v: f"`{v[:12]}`",
                    suite_wall_s=INT)
VALUES |= {"tc.tests": (TC, None, len), "tc.top": (None, None, lambda _: SLOWEST),
           "tc.seconds": (TC, None, lambda rows: sum(float(r["seconds"]) for r in rows), INT)}

class Missing(Exception):
    """A value's file, row or cell is not there."""


@functools.cache
def _load(results: Path, file) -> list[dict] | None:
    """The rows of `file` under `results` (a CSV; a tuple of names and globs: every CSV found, in
    order; another file: one row holding its `text`), each tagged with its `_file`; None if absent."""
    paths = [p for name in ([file] if isinstance(file, str) else file) for p in sorted(results.glob(name))]
    if not paths:
        return None
    rows = []
    for p in paths:
        tag = {"_file": str(p.relative_to(results))}
        if p.suffix != ".csv":
            rows.append({**tag, "text": p.read_text()})
            continue
        with p.open() as f:
            rows += [{**r, **tag} for r in csv.DictReader(f)]
    return rows


def value(results: Path, name: str) -> str:
    """VALUES[name] from the CSVs under `results`, formatted."""
    file, where, what, fmt = (*VALUES[name], STR)[:4]
    rows = [] if file is None else _load(results, file)
    if rows is None:
        raise Missing(f"{results / (file if isinstance(file, str) else file[0])} not found")
    if isinstance(where, dict):
        rows = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    elif where is not None:
        rows = where(rows)
    if callable(what):
        v = what(rows)
    elif len(rows) != 1:
        raise Missing(f"{len(rows)} rows of {file} match {where}")
    else:
        v = rows[0][what] if isinstance(what, str) else tuple(rows[0][c] for c in what)

    def one(x):
        if x in ("", None):
            raise Missing(f"empty cell in {file}")
        return fmt(x)
    return "-".join(map(one, v)) if isinstance(v, tuple) else " / ".join(map(one, v)) if isinstance(v, list) else one(v)


# --- tables: TABLES are a CSV's columns; BLOCKS build theirs
ASYNC = ("mode tokens_per_s tokens_per_s_min tokens_per_s_max speedup_vs_sync_separated speedup_min speedup_max bound "
         "efficiency efficiency_min efficiency_max bound_overlapped speedup_vs_sync_colocated repeats")
"""The columns shown of every async_speedup*.csv."""
TABLES = {  # marker -> (csv under results/, script that writes it, columns shown: all when None)
    "sft": ("sft.csv", "experiments/warm_start.sh", None),
    "fig1_timeline": ("fig1_timeline.csv", "experiments/fig1_timeline.sh", None),
    "equivalence": ("equivalence.csv", "experiments/equivalence.sh", None),
    "async_speedup": ("async_speedup.csv", "experiments/async_speedup.sh", ASYNC),
    "async_balanced": ("async_speedup_balanced.csv", "experiments/async_speedup.sh", ASYNC),
    **{f"async_balanced_{r}": (f"async_speedup_balanced_{r}/async_speedup_balanced.csv", "experiments/async_speedup.sh "
                               f"--settings balanced (RESULTS_DIR=results/async_speedup_balanced_{r})",
                               ASYNC + " git_commit") for r in ("run2", "run3")},
    "phase_contention": ("phase_contention.csv", "experiments/async_speedup.sh",
                         "model case process rate rate_min rate_max vs_alone step_cpu_ms repeats cpu"),
    "async_real": ("async_speedup_real.csv", "experiments/async_speedup.sh --settings real-model",
                   ASYNC + " git_commit"),
    "async_real_phases": ("async_speedup_real_phases.csv", "experiments/async_speedup.sh --settings real-model",
                          "mode mean_generate_s mean_train_s mean_iteration_s mean_sync_s mean_first_group_s "
                          "mean_after_generation_s repeats"),
    "reward_curves_real_time": ("reward_curves_real_time_summary.csv", "experiments/reward_curves_real.sh",
                                "mode eval_accuracy_start eval_accuracy_end eval_stderr eval_n gain "
                                "max_abs_diff_vs_sync tokens_identical_iterations tokens_per_s wall_s git_commit"),
    "async_real_prediction": ("async_real_prediction.csv", "experiments/reward_curves_real.sh",
                              "kind mode engines iteration_s generate_s train_busy_s tokens_per_s "
                              "speedup_vs_sync_separated speedup_vs_1_engine rel_error"),
    "shared_async": ("shared_async.csv", "experiments/shared_async.sh",
                     "shared_prompt mode tokens_per_s speedup speedup_min speedup_max mean_generate_s mean_train_s "
                     "mean_prompt_tokens repeats"),
    "shared_async_real": ("shared_async_real.csv", "experiments/async_speedup.sh --settings real-model",
                          "shared_prompt mode tokens_per_s speedup speedup_min speedup_max mean_generate_s "
                          "mean_train_s bound efficiency repeats git_commit"),
    "reward_curves": ("reward_curves_summary.csv", "experiments/reward_curves.sh", None),
    "reward_curves_real": ("reward_curves_real_summary.csv", "experiments/reward_curves_real.sh",
                           "mode eval_accuracy_start eval_accuracy_end eval_stderr eval_n gain gain_stderr_paired "
                           "max_abs_diff_vs_sync max_abs_diff_reward max_abs_diff_eval tokens_identical_iterations "
                           "tokens_per_s wall_s"),
    "reward_curves_seed1": ("reward_curves_seed1/reward_curves_summary.csv",
                            "experiments/reward_curves.sh data.seed=1 --results results/reward_curves_seed1 "
                            "--figures figures/reward_curves_seed1",
                            "mode eval_accuracy_start eval_accuracy_end eval_stderr gain gain_stderr_paired "
                            "max_abs_diff_vs_sync max_abs_diff_reward max_abs_diff_eval tokens_identical_iterations"),
    "shared_prompt": ("shared_prompt.csv", "experiments/shared_prompt_ablation.sh", None),
    "vllm_push": ("vllm_push.csv", "experiments/engine_throughput.sh", None),
    "engine": ("engine.csv", "experiments/engine_throughput.sh",
               "model distribution workers builtin_tok_s vllm_tok_s hf_tok_s vllm_vs_builtin vllm_vs_builtin_min "
               "vllm_vs_builtin_max builtin_vs_hf vllm_vs_hf faster tokens repeats"),
    "lora_trimodel": ("lora_trimodel.csv", "experiments/lora.sh",
                      "mode variant policy_bytes old_bytes ref_bytes total_bytes weights_vs_one_model micro_step_s "
                      "micro_step_s_min micro_step_s_max micro_step_vs_full packed_tokens peak_rss_mib "
                      "peak_rss_vs_full rounds model lora_rank"),
    "lora_push": ("lora_push.csv", "experiments/lora.sh",
                  "engine mode bytes bytes_vs_full tensors extract_s push_s check_s push_check_s push_check_s_min "
                  "push_check_s_max push_check_vs_full push_check_vs_full_min push_check_vs_full_max gen_tok_s "
                  "gen_vs_full max_gap rounds versions_per_round"),
    "lora_iteration": ("lora_iteration.csv", "experiments/lora.sh",
                       "variant mode tokens_per_s tokens_per_s_min tokens_per_s_max speedup_vs_sync_separated "
                       "tokens_per_s_vs_full tokens_per_s_vs_full_min tokens_per_s_vs_full_max mean_iteration_s "
                       "mean_generate_s mean_train_s mean_sync_s repeats measured_iterations"),
    "lora_learning": ("lora_learning.csv", "experiments/lora.sh",
                      "kind lr chosen_by chosen iterations validation_accuracy validation_n eval_accuracy_start "
                      "eval_accuracy_end eval_n gain gain_stderr gain_stderr_paired wall_s"),
    "trimodel_cost": ("trimodel_cost.csv", "experiments/trimodel_cost.sh", None),
    "table2_throughput": ("table2_throughput.csv", "experiments/table2_throughput.sh",
                          "setting system shared_prompt tokens_per_s tokens_per_s_min tokens_per_s_max speedup_vs_trl "
                          "speedup_vs_trl_min speedup_vs_trl_max trl_baseline speedup_vs_sync_colocated paper_speedup "
                          "devices repeats mean_prompt_tokens samples_per_iteration"),
    "table2_batch_effect": ("table2_batch_effect.csv", "experiments/table2_throughput.sh",
                            "setting system prompts_per_iteration samples_per_iteration engine_slots tokens_per_s "
                            "tokens_per_s_min tokens_per_s_max speedup_vs_sync_separated speedup_min speedup_max "
                            "mean_generate_s mean_train_s repeats"),
    "trl_dropin": ("trl_dropin.csv", "experiments/trl_dropin.sh",
                   "system step_s step_s_min step_s_max speedup speedup_min speedup_max train_s repeats git_commit"),
}


def _md(head: list[str], body) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in body])


def table_block(results: Path, name: str) -> str:
    """TABLES[name]: the CSV's columns (picked and ordered) under the line naming the file, where its
    rows were measured (their commits and machines, or that the CSV predates the column: the
    experiments stamp both on every row they write now) and the script that writes it."""
    file, script, columns = TABLES[name]
    if not (path := results / file).is_file():
        return f"_not measured yet: `bash {script}`_"
    with path.open() as f:
        head, *body = list(csv.reader(f))
    rows = [r for r in (dict(zip(head, b)) for b in body) if r.get("git_commit") or "git_commit" not in r]
    commits, cpus = sorted({r["git_commit"][:7] for r in rows if r.get("git_commit")}), _cpu(rows)
    where = (f"commit {', '.join(commits)}" if commits else "commit not recorded: the CSV predates its `git_commit` "
             "column") + ("; CPU not recorded: the CSV predates its `cpu` column" if cpus == "not recorded" else
                          f"; {cpus}" + ("; rows written before the `cpu` column do not say"
                                         if any(not r.get("cpu") for r in rows) else ""))
    if columns:
        keep = [head.index(c) for c in columns.split() if c in head]
        head, body = [head[i] for i in keep], [[r[i] for i in keep] for r in body]
    return f"`{path}` ({where}), written by `bash {script}`:\n\n{_md(head, body)}"


def _rows(results: Path, name: str) -> list[dict]:
    return _load(results, name) or []


def vllm_speed(results: Path) -> str:
    """vLLM's generation speed over the built-in engine, per model: the range of the medians over the
    rows of engine.csv (workers x length distribution)."""
    ratios: dict[str, list[float]] = {}
    for r in _rows(results, "engine.csv"):
        ratios.setdefault(r["model"], []).append(float(r["vllm_vs_builtin"]))
    if not ratios:
        return "not measured yet: `bash experiments/engine_throughput.sh`"
    return ", ".join(f"{'-'.join(sorted({f'{min(v):.1f}', f'{max(v):.1f}'}, key=float))}x the built-in engine on {m}"
                     for m, v in ratios.items()) + f" (`{results}/engine.csv`)"


def weight_sync(results: Path) -> str:
    """weight_sync_collective.csv as one row per preset: object store against collective."""
    if not (rows := _rows(results, "weight_sync_collective.csv")):
        return "_not measured yet: `python experiments/weight_sync_collective.py`_"
    s = lambda v: f"{float(v):.2g}" if float(v) < 0.01 else f"{float(v):.3f}" if float(v) < 0.1 else F2(v)
    by, body = {(r["preset"], r["path"]): r for r in rows}, []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        store, coll = by[(preset, "object_store")], by[(preset, "collective")]
        mb = float(store["param_bytes"]) / 1e6
        body.append([preset, f"{mb:.0f} MB" if mb >= 10 else f"{mb:.1f} MB",
                     *(f"{s(r['median_s'])} ({s(r['min_s'])}-{s(r['max_s'])})" for r in (store, coll)),
                     X2(coll["speedup_vs_object_store"])])
    return _md(["preset", "weights", "object store", "collective", "ratio"], body)


_ok = lambda r: r.get("status", "").startswith("ok")
GPU_TABLES = {  # docs/gpu.md's tables of the GPU check: results/gpu/NAME.csv, its columns shown or a function
    "correctness": "check model dtype backend value tolerance passed status detail",  # of a row, its cells (None:
    "attention": lambda r, rows: None if not (_ok(r) and r.get("speedup_vs_per_response")) else {  # left out)
        "back-end": r["backend"], "P": r["P"], "R": r["R"], "token bound": r["token_bound"],
        "per-response s": next((q["time_s"] for q in rows if _ok(q) and (q["backend"], q["P"], q["R"], q["packing"])
                                == (r["backend"], r["P"], r["R"], "per_response")), ""),
        "shared s": r["time_s"], "speed-up": X2(r["speedup_vs_per_response"]),
        "of the bound": F2(float(r["speedup_vs_per_response"]) / float(r["token_bound"])),
        "peak GiB (shared)": r["peak_memory_gib"], "repeats": r["repeats"]},
    "trainer": lambda r, rows: None if not _ok(r) else {
        "model": r["model"], "models": r["models"], "packed tokens": r["packed_tokens"],
        "tokens/s": f"{float(r['tokens_per_s']):,.0f}", "model TFLOP/s": r["model_tflops_per_s"],
        "MFU": f"{float(r['mfu']):.1%}", "AdamW step s": r["optimizer_step_s"], "peak GiB": r["peak_memory_gib"]},
    "engine": "engine model dtype slots generated_tokens wall_s step_ms tokens_per_s vs_hf_generate status",
}


def gpu_table(results: Path, name: str) -> str:
    if not (rows := _rows(results, f"gpu/{name}.csv")):
        return f"_not measured yet: `bash scripts/gpu_check.sh {results}/gpu` on a GPU_"
    cells = GPU_TABLES[name]
    body = [c for r in rows if (c := {k: r.get(k, "") for k in cells.split()} if isinstance(cells, str)
                                else cells(r, rows))]
    return _md(list(body[0]), [list(c.values()) for c in body])


def test_cost_groups(results: Path) -> str:
    """The default suite's time by what each test starts (test_costs.csv, scripts/test_costs.py)."""
    if not (rows := _rows(results, "test_costs.csv")):
        return "_not measured yet: `python scripts/test_costs.py`_"
    total, groups = sum(float(r["seconds"]) for r in rows), {}
    for r in rows:
        groups.setdefault(r["group"], []).append(float(r["seconds"]))
    return _md(["what the test starts", "tests", "seconds", "share"],
               [[name, len(s), f"{sum(s):.0f}", f"{sum(s) / total:.0%}"]
                for name, s in sorted(groups.items(), key=lambda x: -sum(x[1]))])


def test_cost_slowest(results: Path) -> str:
    starts = ("ray", "engine_workers", "vllm_workers", "subprocess_cli", "subprocess_script", "subprocess_other")
    return _md(["test", "seconds", "starts"], [[f"`{r['test']}`", f"{float(r['seconds']):.1f}", ", ".join(
        f"{k}={r[k]}" for k in starts if r[k] != "0") or "-"] for r in _rows(results, "test_costs.csv")[:SLOWEST]])


def trl_fields(kind: str) -> str:
    """docs/trl.md's tables of the TRL fields, from trl_api.py itself (the code is the one list)."""
    from periodic_async import trl_api

    esc = lambda text: str(text).replace("|", "\\|")
    if kind == "ONLY_DEFAULT":
        return _md(["TRL field", "the value", "why"], [[f"`{k}`", f"`{d!r}`", esc(v)]
                                                       for k, (d, v) in sorted(trl_api.ONLY_DEFAULT.items())])
    return _md(["TRL field", "here" if kind == "DEFAULTS_DIFFER" else "why"],
               [[f"`{k}`", esc(v)] for k, v in sorted(getattr(trl_api, kind).items())])


def default_claims(tests: Path) -> str:
    """Every test the default suite runs (not marked slow or gpu, module marks included), by module,
    with the first sentence of its docstring: what the default suite checks. Read from the source
    (ast), so that rendering runs no test; a test with slow parameter cases says so."""
    lines, count = [], 0
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
               and ("mark.slow" in ast.unparse(node.value) or "mark.gpu" in ast.unparse(node.value))
               for node in tree.body):
            continue  # the whole module is slow or gpu
        funcs = [(None, n) for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")):
            funcs += [(cls.name, n) for n in cls.body if isinstance(n, ast.FunctionDef)]
        items = []
        for cls, fn in funcs:
            decorators = [ast.unparse(d) for d in fn.decorator_list]  # @pytest.mark.slow or @pytest.mark.gpu(...)
            if not fn.name.startswith("test_") or any(re.match(r"[\w.]+\.mark\.(slow|gpu)\b", d) for d in decorators):
                continue
            doc = " ".join((ast.get_docstring(fn) or "").split())
            first = re.match(r"(.+?[a-z0-9)`'\]]\.)(\s+[A-Z(`]|$)", doc)  # not at "e.g. x" or "1.5"
            items.append(f"  - `{f'{cls}.{fn.name}' if cls else fn.name}`" + (f": {first[1] if first else doc}"
                                                                            if doc else "")
                         + (" (its slow cases run with `-m slow`)" if any(
                             "parametrize" in d and "marks=pytest.mark.slow" in d for d in decorators) else ""))
        if items:
            lines += [f"- `{path.relative_to(tests.parent)}` ({len(items)})", *items]
            count += len(items)
    return (f"{count} test functions run by default on a CPU (parametrized cases counted once; the tests marked "
            "`gpu`, which skip without CUDA, are not listed), each with the first sentence of its docstring.\n\n"
            "<details><summary>The list</summary>\n\n" + "\n".join(lines) + "\n\n</details>")


def times_table(results: Path) -> str:
    """Each experiment's wall time in the full run (run_all_times.csv: one at a time, so the run is
    their sum, over however many sittings it was resumed in) and in the smoke run
    (run_all_times_quick.csv: two at a time, so the run is the span from first start to last end)."""
    if not (match := re.search(r"^EXPERIMENTS=\((.*?)\)", Path("run_all.sh").read_text(), flags=re.S | re.M)):
        raise SystemExit("run_all.sh: no EXPERIMENTS=(...) array")
    experiments = match.group(1).split()
    full = {r["experiment"]: r for r in _rows(results, "run_all_times.csv")}
    quick = {r["experiment"]: r for r in _rows(results, "run_all_times_quick.csv")}
    body = [[f"`{e}`"] + [f"{MIN(t[e]['seconds'])} ({t[e]['git_commit'][:7]})" if e in t else "not timed"
                          for t in (full, quick)] for e in experiments]  # each time with the commit it measured
    end = [datetime.fromisoformat(r["finished"].replace("Z", "+00:00")).timestamp() for r in quick.values()]
    span = max(end, default=0) - min((e - float(r["seconds"]) for e, r in zip(end, quick.values())), default=0)
    body.append(["**the whole run**", f"{sum(float(r['seconds']) for r in full.values()) / 3600:.1f} h (the sum)"
                 if set(experiments) <= set(full) else "not timed end to end",
                 f"{span:.0f} s (two at a time)" if set(experiments) <= set(quick) else "not timed end to end"])
    where = [f"`{results}/{name}`, commit {', '.join(sorted({r['git_commit'][:7] for r in rows.values()})) or '-'}, "
             + _cpu(rows.values()).replace("not recorded", "CPU not recorded")  # the file, its commits and machines
             for name, rows in (("run_all_times.csv", full), ("run_all_times_quick.csv", quick))]
    return (f"Measured ({'; '.join(where)}).\n\n"
            + _md(["experiment", "`bash run_all.sh`", "`QUICK=1 bash run_all.sh`"], body))


BLOCKS = {  # marker -> the block's text from the results directory
    **{name: functools.partial(table_block, name=name) for name in TABLES},
    **{f"gpu_{name}": functools.partial(gpu_table, name=name) for name in GPU_TABLES},
    **{f"trl_{kind.lower()}": (lambda results, kind=kind: trl_fields(kind))
       for kind in ("NO_EFFECT", "ONLY_DEFAULT", "REFUSED", "DEFAULTS_DIFFER")},
    "vllm_speed": vllm_speed, "weight_sync_collective": weight_sync, "test_cost_groups": test_cost_groups,
    "test_cost_slowest": test_cost_slowest, "default_claims": lambda results: default_claims(Path("tests")),
    "run_all_times": times_table,
}
BLOCK = re.compile(r"<!-- results:([\w-]+) -->(\n?).*?<!-- /results:\1 -->", flags=re.S)
INLINE = re.compile(r"<!-- v:([\w./@-]+) -->(.*?)<!-- /v -->")


def render(path: Path, results: Path, used: set, told: set) -> None:
    """Fill every marker of `path` from `results`; `used` collects the blocks' names, `told` the
    problems already reported on stderr. A block whose opening marker ends its line is a block of
    lines; one within a line of prose stays within it (Markdown ends a paragraph at a line that
    starts with a comment)."""
    def block(m: re.Match) -> str:
        name, sep = m.group(1), m.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"{path}: <!-- results:{name} --> names no table or block of scripts/update_readme.py")
        if "\n" in (body := BLOCKS[name](results)) and not sep:
            raise SystemExit(f"{path}: <!-- results:{name} --> sits within a line, and its body has several")
        used.add(name)
        return f"<!-- results:{name} -->{sep}{body}{sep}<!-- /results:{name} -->"

    def inline(m: re.Match) -> str:
        if (name := m.group(1)) not in VALUES:
            raise SystemExit(f"{path}: <!-- v:{name} --> names no entry of VALUES in scripts/update_readme.py")
        try:
            text = value(results, name)
        except (Missing, KeyError, ValueError, StopIteration, IndexError, ZeroDivisionError, TypeError,
                AttributeError, statistics.StatisticsError) as e:
            missing_file = isinstance(e, Missing) and str(e).endswith(" not found")
            why = f"{e}: its values render n/a" if missing_file else f"{path}: v:{name}: {type(e).__name__}: {e}"
            if why not in told:  # a missing file once, not once per value
                print(f"update_readme: {why}", file=sys.stderr)
                told.add(why)
            text = "n/a"
        return f"<!-- v:{name} -->{text}<!-- /v -->"

    text = BLOCK.sub(block, path.read_text())
    if text.count("<!-- v:") != len(INLINE.findall(text)):
        raise SystemExit(f"{path}: a <!-- v:NAME --> marker without its <!-- /v --> on the same line")
    if starts := re.search(r"^<!-- v:", text, flags=re.M):
        raise SystemExit(f"{path}:{text.count(chr(10), 0, starts.start()) + 1}: a line starts with a value marker "
                         "(Markdown would end the paragraph there): keep it on the line of the word before it")
    path.write_text(INLINE.sub(inline, text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results", help="the directory of the CSVs")
    ap.add_argument("docs", nargs="*", default=DOCS, help="the documents to fill (default: all)")
    args = ap.parse_args()
    used: set[str] = set()
    told: set[str] = set()
    for doc in args.docs:
        render(Path(doc), Path(args.results), used, told)
    if args.docs == DOCS and (unused := BLOCKS.keys() - used):
        raise SystemExit(f"tables no document shows: {sorted(unused)} (scripts/update_readme.py)")


if __name__ == "__main__":
    main()
