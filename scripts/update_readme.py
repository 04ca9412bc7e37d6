"""Fill README.md and docs/*.md from results/*.csv (never edit a rendered number by hand).

First it judges the paper's claims (periodic_async.bench.claims) and writes results/claims.csv;
then it fills two kinds of marker in the documents:

- `<!-- v:PREFIX.KEY.COLUMN -->1.49x<!-- /v -->` within a sentence: the cell COLUMN of the row KEY
  of PREFIX's table, formatted by FORMATS. PREFIX names a summary of bench/analysis.py
  (`analysis.SUMMARIES`: 'bal', 'rc', 'sim', ...) or a CSV (CSVS, its rows named by the columns
  given: 'lpush.vllm/lora.push_check_s'); `PREFIX.COLUMN` (no KEY) is the summary's row '' or the
  value every row of the CSV shares. A column `X_range` is (X_min, X_max), printed 'a-b'; a list
  prints 'a / b'. A reading that depends on the numbers is either a verdict (bench/claims.py) or
  fixed prose with an assertion over the committed CSVs in tests/test_update_readme.py.
- `<!-- results:NAME -->` ... `<!-- /results:NAME -->` around a block: TABLES (a CSV's columns
  under the line naming its file, commits and machines) or BLOCKS (the claims, the GPU check, ...).

Guarantees: every marker names an entry here, every value its file, row and column, else the
render stops with one line naming the document and the marker (never a silent 'n/a'); rendering
the committed results again changes nothing (tests/test_update_readme.py).

    python scripts/update_readme.py [--results results] [DOC ...]
"""

import argparse
import csv
import functools
import re
from datetime import datetime
from pathlib import Path

from periodic_async.bench import analysis, claims

DOCS = ["README.md", "docs/results.md", "docs/reproduce.md", "docs/gpu.md", "docs/scaling.md", "docs/usage.md",
        "docs/trl.md"]

# --- values: (file, row, column, format), the row named in the marker
CSVS = {  # prefix -> (CSV under results/, the columns whose values, '/'-joined, name a row)
    "tri": ("trimodel_cost.csv", ("variant",)), "ltri": ("lora_trimodel.csv", ("mode", "variant")),
    "lpush": ("lora_push.csv", ("engine", "mode")), "liter": ("lora_iteration.csv", ("variant", "mode")),
    "llearn": ("lora_learning.csv", ("kind",)), "lsweep": ("lora_learning.csv", ("kind", "chosen")),
    "sm": ("scaling_measured.csv", ("system",)), "ds": ("dynamic_sampling.csv", ("workload", "mode", "variant")),
    "mtc": ("multiturn.csv", ("p99_s", "mode")),
    "ws": ("weight_sync_collective.csv", ("preset", "path")),
}
LISTS = {"llearn"}  # prefixes whose row may be several rows: one value per row, ' / '-joined
ALIASES = {"sm.spread": "speedup_vs_1_range"}  # PREFIX.COLUMN -> the column it reads
MINUTES, MIB, KILO, POINTS = "minutes", ("{:.1f}", 2 ** -20), ("{:.1f}k", 1e-3), ("{:+.1f}", 100)
FORMATS = {  # COLUMN or PREFIX.COLUMN -> a str.format template, (template, scale) or MINUTES (as is if absent)
    **dict.fromkeys(("speedup_vs_sync_separated", "speedup_vs_sync_colocated", "bound", "bound_overlapped", "shared",
                     "async", "both", "product", "speedup", "speedup_vs_1", "gain_half", "vs_sep",
                     "vs_col", "micro_step_vs_full", "peak_rss_vs_full", "push_check_vs_full", "gen_vs_full",
                     "tokens_per_s_vs_full", "ratio_vs_policy_only", "sim.gain"), "{:.2f}x"),
    **dict.fromkeys(("speedup_vs_trl", "token_bound", "speedup_vs_per_response", "memory_ratio", "shared.speedup"),
                    "{:.1f}x"),
    **dict.fromkeys(("efficiency", "of_overlapped", "of_bound", "trainer", "engine", "wall", "linear", "linear_half",
                     "push_check_s", "generate_s", "train_s", "reward_first", "reward_last", "trace", "sm.spread",
                     "sm.speedup_vs_1_range"), "{:.2f}"),
    **{f"mean_{p}_s": "{:.2f}" for p in ("generate", "train", "iteration", "sync", "first_group", "after_generation",
                                         "train_thread_cpu")},
    **dict.fromkeys(("generate_slower", "train_slower", "train_thread_cpu_slower", "waits"), "{:+.0%}"),
    **dict.fromkeys(("eval_accuracy_start", "eval_accuracy_end", "eval_stderr", "bytes_vs_full", "ratio_abs_dev",
                     "ratio_abs_dev_peak"), "{:.3f}"),
    **dict.fromkeys(("max_abs_diff_vs_sync", "max_abs_diff_reward", "max_abs_diff_eval"), "{:.3g}"),
    **dict.fromkeys(("clip_frac", "clip_frac_peak"), "{:.2%}"),
    **dict.fromkeys(("rel_error_min", "rel_error_max", "rel_error_leave_out_min", "rel_error_leave_out_max"),
                    "{:+.1%}"),
    **dict.fromkeys(("mean_prompt_tokens", "rss", "fds", "seconds", "suite_wall_s"), "{:.0f}"),
    **dict.fromkeys(("sim.periodic-async", "sim.sync-separated", "sim.sync-colocated", "sim.48", "sim.64"), KILO),
    "gain": POINTS, "gain_stderr": ("{:.1f}", 100), "gain_stderr_paired": ("{:.1f}", 100), "lost": ("{:.0f}", 100),
    "wall_s": MINUTES, "wall_min": "{:.1f}", "weights": "{:.1e}", "parts": "{:.0%}", "slope": "{:.1f}",
    "mfu": "{:.1%}", "commit": "{:.7}", "git_commit": "{:.7}", "tc.git_commit": "`{:.12}`",
    "tcb.git_commit": "`{:.12}`", "soak.trainer": "{:.0f}", "soak.workers": "{:.0f}", "pytest_args": "`{}`",
    "preset": "`{}`", "weights_vs_one_model": "{:.3f}x", "lpush.bytes": MIB, "lr": "{:g}",
    "llearn.eval_accuracy_start": ("{:.1f}", 100), "llearn.eval_accuracy_end": ("{:.1f}", 100),
    "validation_accuracy": "{:.0%}", "ds.mean_filtered": "{:.1f}", "ds.mean_drawn": "{:.1f}",
    "mtc.single_turn_speedup": "{:.2f}x",
    **{f"tasks.{p}{c}": POINTS for p in ("", "dyn_", "sdyn_", "off_") for c in ("gain", "ci95_low", "ci95_high")},
    **{f"tasks.{c}": ("{:.1f}%", 100) for c in ("warm_start", "base", "pa_end", "sync_end", "dyn_eval_accuracy_end",
                                                "sdyn_eval_accuracy_end", "off_eval_accuracy_end")},
    "tasks.dyn_drawn": "{:.0f}", "tasks.dyn_filtered_share": "{:.0%}", "tasks.informative": "{:.0%}",
    "tasks.batch_accuracy": ("{:.1f}%", 100),
}


def _format(v, spec) -> str:
    if isinstance(v, (list, tuple)):
        return (" / " if isinstance(v, list) else "-").join(_format(x, spec) for x in v)
    if v in ("", None):
        raise ValueError("an empty cell")
    if spec == MINUTES:  # '74 s', else '3 min'
        return f"{float(v):.0f} s" if float(v) < 120 else f"{float(v) / 60:.0f} min"
    template, scale = spec if isinstance(spec, tuple) else (spec, 1)
    return template.format(float(v) * scale if re.search(r"[efg%]}", template) else v)


@functools.cache
def table(results: Path, prefix: str) -> list[dict]:
    """PREFIX's rows, each with its `key` (a CSV's also the row '' of the values every row shares)."""
    if prefix in analysis.SUMMARIES:
        return analysis.summary(results, prefix)
    file, keys = CSVS[prefix]
    rows = analysis.read_results(results, file)
    return [{**r, "key": "/".join(r[k] for k in keys)} for r in rows] + [{**analysis.common(rows), "key": ""}]


def value(results: Path, name: str) -> str:
    """The marker NAME's value from the CSVs under `results`, formatted."""
    prefix = max((p for p in [*analysis.SUMMARIES, *CSVS] if name.startswith(p + ".")), key=len, default=None)
    if prefix is None:
        raise KeyError(f"no summary or CSV named {name.split('.')[0]!r}")
    key, _, column = name[len(prefix) + 1:].rpartition(".")
    column = ALIASES.get(f"{prefix}.{column}", column)
    rows = [r for r in table(results, prefix) if r["key"] == key]
    if not rows or len(rows) > 1 and prefix not in LISTS:
        raise KeyError(f"{len(rows)} rows named {key!r} in {prefix}")
    base = column.removesuffix("_range")
    cells = [r[column] if column in r else (r[f"{base}_min"], r[f"{base}_max"]) if column != base else r[column]
             for r in rows]
    spec = FORMATS.get(f"{prefix}.{column}") or FORMATS.get(column) or FORMATS.get(f"{prefix}.{base}") or \
        FORMATS.get(base, "{}")
    return " / ".join(_format(c, spec) for c in cells)


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
    "reward_curves_tasks": ("reward_curves_tasks_summary.csv", "experiments/reward_curves_tasks.sh",
                            "task mode base_accuracy warm_start_accuracy eval_accuracy_end eval_stderr_end eval_n "
                            "iterations gain gain_stderr_paired ci95_low ci95_high max_abs_diff_vs_sync "
                            "mean_iteration_s mean_drawn mean_filtered cap_reached_iterations"),
    "dynamic_sampling": ("dynamic_sampling.csv", "experiments/async_speedup.sh --settings dynamic",
                         "workload mode variant mean_iteration_s mean_iteration_s_min mean_iteration_s_max "
                         "mean_generate_s mean_train_s mean_drawn mean_filtered growth_vs_plain growth_min growth_max "
                         "repeats measured_iterations git_commit"),
    "multiturn": ("multiturn.csv", "experiments/multiturn.sh",
                  "p99_s mode tokens_per_s speedup_vs_sync_separated speedup_min speedup_max bound efficiency "
                  "mean_iteration_s mean_generate_s mean_train_s single_turn_speedup target_met repeats git_commit"),
    "multiturn_warm_start": ("multiturn_warm_start.csv", "experiments/multiturn.sh", None),
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
GPU_TABLES = {  # docs/gpu.md's tables of the GPU check: results/gpu/NAME.csv's columns shown, or its summary
    "correctness": "check model dtype backend value tolerance passed status detail",
    "attention": analysis.gpu_attention,
    "trainer": "model models packed_tokens tokens_per_s model_tflops_per_s mfu optimizer_step_s peak_memory_gib status",
    "engine": "engine model dtype slots generated_tokens wall_s step_ms tokens_per_s vs_hf_generate status",
}


def _md(head: list[str], body) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in body])


def _csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open() as f:
        head, *body = list(csv.reader(f))
    return head, body


def table_block(results: Path, name: str) -> str:
    """TABLES[name]: the CSV's columns (picked and ordered) under the line naming the file, where its
    rows were measured (their commits and machines, or that the CSV predates the column) and the script."""
    file, script, columns = TABLES[name]
    head, body = _csv(results / file)
    rows = [r for r in (dict(zip(head, b)) for b in body) if r.get("git_commit") or "git_commit" not in r]
    commits, cpus = sorted({r["git_commit"][:7] for r in rows if r.get("git_commit")}), analysis.machines(rows)
    where = (f"commit {', '.join(commits)}" if commits else "commit not recorded: the CSV predates its `git_commit` "
             "column") + ("; CPU not recorded: the CSV predates its `cpu` column" if cpus == "not recorded" else
                          f"; {cpus}" + ("; rows written before the `cpu` column do not say"
                                         if any(not r.get("cpu") for r in rows) else ""))
    # a git_commit or cpu column whose every row holds the one value the line above names is left out
    said = {c for c in ("git_commit", "cpu") if c in head and len({b[head.index(c)] for b in body}) == 1
            and body[0][head.index(c)]}
    keep = [head.index(c) for c in (columns.split() if columns else head) if c in head and c not in said]
    head, body = [head[i] for i in keep], [[r[i] for i in keep] for r in body]
    return f"`{results / file}` ({where}), written by `bash {script}`:\n\n{_md(head, body)}"


def gpu_table(results: Path, name: str) -> str:
    rows, shown = analysis.read_results(results, f"gpu/{name}.csv"), GPU_TABLES[name]
    rows = shown(rows) if callable(shown) else [{c: r.get(c, "") for c in shown.split()} for r in rows]
    return _md(list(rows[0]), [list(r.values()) for r in rows])


def claims_table(results: Path) -> str:
    """README's claims: one line per claim from results/claims.csv."""
    rows = analysis.read_results(results, "claims.csv")
    return _md(["claim", "paper", "ours", "verdict", "details"],
               [[r["claim"], r["paper"], r["headline"], r["verdict"], f"[details]({r['details']})"] for r in rows])


def claim_block(results: Path, claim_id: str) -> str:
    """docs/results.md's table of one claim, and where its numbers come from."""
    r = next(r for r in analysis.read_results(results, "claims.csv") if r["id"] == claim_id)
    return (_md(["paper", "target", "ours", "verdict"], [[r["paper"], r["target"], r["headline"], r["verdict"]]])
            + f"\n\nPaper: {r['paper_source']}. Ours: `{r['command']}`, commit {r['commits']} "
            f"(`{results}/claims.csv`).")


def gpu_goals(results: Path) -> str:
    return _md(["goal", "measured", "verdict"], claims.gpu_goals(results))


def gpu_status(results: Path) -> str:
    """What has run on an accelerator, from results/gpu (README's status line and docs/gpu.md's)."""
    g = next(r for r in analysis.summary(results, "gpu") if r["key"] == "")
    failed = "; ".join(c.replace(" (", " on ").rstrip(")") for c in g["failed_checks"])
    return (f"On an accelerator one GPU check has run (`scripts/gpu_check.sh`, one {g['gpu']}, commit "
            f"{g['commit'][:7]}): {g['passed']} of {g['checks']} correctness checks passed, {g['failed']} failed"
            + (f" ({failed})" if failed else "")
            + "; Ray engine workers, trainer ranks, vLLM and NPUs have not run on one.")


def vllm_speed(results: Path) -> str:
    """vLLM's generation speed over the built-in engine, per model: the range over engine.csv's rows."""
    return ", ".join(f"{'-'.join(sorted({f'{x:.2f}' for x in r['vllm_vs_builtin']}, key=float))}x the built-in "
                     f"engine on {r['key']}" for r in analysis.summary(results, "engine_speed")) + \
        f" (`{results}/engine.csv`)"


def summary_table(results: Path, name: str) -> str:
    """A summary of bench/analysis.py that is a table already (its columns but `key`)."""
    rows = [{k: v for k, v in r.items() if k != "key"} for r in analysis.summary(results, name)]
    return _md(list(rows[0]), [list(r.values()) for r in rows])


def trl_fields(results: Path, kind: str) -> str:
    """docs/trl.md's tables of the TRL fields, from trl_api itself (the code is the one list)."""
    from periodic_async import trl_api

    if kind == "ONLY_DEFAULT":
        return _md(["TRL field", "the value", "why"], [[f"`{k}`", f"`{d!r}`", str(v).replace("|", "\\|")]
                                                       for k, (d, v) in sorted(trl_api.ONLY_DEFAULT.items())])
    if kind == "NO_EFFECT":  # many fields share one reason: one row per reason
        fields = {}
        for k, why in sorted(trl_api.NO_EFFECT.items()):
            fields.setdefault(why, []).append(f"`{k}`")
        return _md(["TRL fields", "why"], [[", ".join(ks), why.replace("|", "\\|")] for why, ks in fields.items()])
    return _md(["TRL field", "here" if kind == "DEFAULTS_DIFFER" else "why"],
               [[f"`{k}`", str(v).replace("|", "\\|")] for k, v in sorted(getattr(trl_api, kind).items())])


def times_table(results: Path) -> str:
    """Each experiment's wall time in the full run (run_all_times.csv: one at a time, so the run is
    their sum) and in the smoke run (run_all_times_quick.csv: two at a time, so the run is the span
    from first start to last end), each with the commit it measured."""
    if not (match := re.search(r"^EXPERIMENTS=\((.*?)\)", Path("run_all.sh").read_text(), flags=re.S | re.M)):
        raise SystemExit("run_all.sh: no EXPERIMENTS=(...) array")
    experiments = match.group(1).split()
    full, quick = ({r["experiment"]: r for r in analysis.read_results(results, name)}
                   for name in ("run_all_times.csv", "run_all_times_quick.csv"))
    body = [[f"`{e}`"] + [f"{_format(t[e]['seconds'], MINUTES)} ({t[e]['git_commit'][:7]})" if e in t else "not timed"
                          for t in (full, quick)] for e in experiments]
    end = [datetime.fromisoformat(r["finished"].replace("Z", "+00:00")).timestamp() for r in quick.values()]
    span = max(end, default=0) - min((e - float(r["seconds"]) for e, r in zip(end, quick.values())), default=0)
    body.append(["**the whole run**", f"{sum(float(r['seconds']) for r in full.values()) / 3600:.1f} h (the sum)"
                 if set(experiments) <= set(full) else "not timed end to end",
                 f"{span:.0f} s (two at a time)" if set(experiments) <= set(quick) else "not timed end to end"])
    where = [f"`{results}/{name}`, commit {', '.join(sorted({r['git_commit'][:7] for r in rows.values()})) or '-'}, "
             + analysis.machines(list(rows.values())).replace("not recorded", "CPU not recorded")
             for name, rows in (("run_all_times.csv", full), ("run_all_times_quick.csv", quick))]
    return (f"Measured ({'; '.join(where)}).\n\n"
            + _md(["experiment", "`bash run_all.sh`", "`QUICK=1 bash run_all.sh`"], body))


BLOCKS = {  # marker -> the block's text from the results directory
    **{name: functools.partial(table_block, name=name) for name in TABLES},
    **{f"gpu_{name}": functools.partial(gpu_table, name=name) for name in GPU_TABLES},
    **{f"trl_{kind.lower()}": functools.partial(trl_fields, kind=kind)
       for kind in ("NO_EFFECT", "ONLY_DEFAULT", "REFUSED", "DEFAULTS_DIFFER")},
    **{f"claim.{c.id}": functools.partial(claim_block, claim_id=c.id) for c in claims.CLAIMS},
    **{name: functools.partial(summary_table, name=name)
       for name in ("weight_sync_collective", "test_cost_groups", "test_cost_slowest")},
    "claims": claims_table, "gpu_goals": gpu_goals, "gpu_status": gpu_status, "vllm_speed": vllm_speed,
    "run_all_times": times_table,
}
BLOCK = re.compile(r"<!-- results:([\w.-]+) -->(\n?).*?<!-- /results:\1 -->", flags=re.S)
INLINE = re.compile(r"<!-- v:([\w./@-]+) -->(.*?)<!-- /v -->")


def render(path: Path, results: Path, used: set) -> None:
    """Fill every marker of `path` from `results`; `used` collects the blocks' names. A block whose
    opening marker ends its line is a block of lines; one within a line of prose stays within it."""
    def fill(kind: str, name: str, make) -> str:
        try:
            return make()
        except Exception as e:  # noqa: BLE001 (any failure names the document and the marker)
            raise SystemExit(f"update_readme: {path}: {kind}:{name}: {type(e).__name__}: {e}") from e

    def block(m: re.Match) -> str:
        name, sep = m.group(1), m.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"{path}: <!-- results:{name} --> names no table or block of scripts/update_readme.py")
        if "\n" in (body := fill("results", name, lambda: BLOCKS[name](results))) and not sep:
            raise SystemExit(f"{path}: <!-- results:{name} --> sits within a line, and its body has several")
        used.add(name)
        return f"<!-- results:{name} -->{sep}{body}{sep}<!-- /results:{name} -->"

    def inline(m: re.Match) -> str:
        return f"<!-- v:{m.group(1)} -->{fill('v', m.group(1), lambda: value(results, m.group(1)))}<!-- /v -->"

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
    try:
        claims.write(Path(args.results))
    except Exception as e:  # noqa: BLE001 (one line naming what failed)
        raise SystemExit(f"update_readme: {args.results}/claims.csv: {type(e).__name__}: {e}") from e
    used: set[str] = set()
    for doc in args.docs:
        render(Path(doc), Path(args.results), used)
    if args.docs == DOCS and (unused := BLOCKS.keys() - used):
        raise SystemExit(f"tables no document shows: {sorted(unused)} (scripts/update_readme.py)")


if __name__ == "__main__":
    main()
