"""Figures drawn from saved run artifacts (trace.jsonl, results/*.csv); notebooks call these.

`plot_timeline` redraws the paper's Figure 1 from real runs: one panel per run (e.g.
sync-separated above periodic-async), same workload and time axis; a row per engine slot
with one bar per sample (labelled with its prompt), a trainer row with micro-steps,
optimizer steps and weight syncs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from periodic_async.records import read_csv
from periodic_async.trace import read_jsonl


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


_TRAINER_COLORS = {"micro_step": "#4C72B0", "optimizer_step": "#C44E52", "weight_sync": "#8172B2"}


def plot_timeline(runs: Sequence[tuple[str, str | Path]], out_path: str | Path, iterations: int | None = 2,
                  max_slots: int = 16, bar_label: Callable[[dict], str] | None = None):
    """Draw one panel per (label, trace.jsonl) on a shared time axis; saves `out_path`.

    iterations: draw only the first N iterations after the first weight sync (None: all).
    bar_label: text of a sample's bar from its event args (default: the prompt's dataset index;
    `request_number` numbers the iteration's requests 1..B, as the paper's Figure 1 does).
    """
    plt = _pyplot()

    panels = []
    for label, path in runs:
        events = read_jsonl(path)
        syncs = sorted(e["start"] for e in events if e["name"] == "weight_sync")
        t0 = syncs[0] + next(e["dur"] for e in events if e["name"] == "weight_sync") if syncs else \
            min(e["start"] for e in events)
        t1 = syncs[iterations] + 1e-3 if iterations is not None and len(syncs) > iterations else float("inf")
        chosen = [e for e in events if e["start"] >= t0 - 1e-6 and e["start"] < t1]
        panels.append((label, chosen, t0))
    span = max((max(e["start"] + e["dur"] for e in ev) - t0) for _, ev, t0 in panels if ev)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.2 + 0.32 * max_slots * len(panels)), sharex=True,
                             squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (label, events, t0) in zip(axes[:, 0], panels):
        slots = sorted({e["track"] for e in events if e["name"] == "generate"})[:max_slots]
        rows = {track: i for i, track in enumerate(["trainer"] + slots[::-1])}
        for e in events:
            if e["track"] not in rows:
                continue
            y, x = rows[e["track"]], e["start"] - t0
            if e["name"] == "generate":
                p = e["args"].get("prompt", 0)
                ax.barh(y, e["dur"], left=x, height=0.8, color=cmap(p % 20), edgecolor="black", linewidth=0.3)
                if e["dur"] > span / 60:
                    text = bar_label(e["args"]) if bar_label else str(p)
                    ax.text(x + e["dur"] / 2, y, text, ha="center", va="center", fontsize=6)
            elif e["name"] in _TRAINER_COLORS:
                ax.barh(y, max(e["dur"], span / 800), left=x, height=0.8, color=_TRAINER_COLORS[e["name"]])
        ax.set_yticks(list(rows.values()), list(rows.keys()), fontsize=7)
        ax.set_title(label, fontsize=10, loc="left")
        ax.set_xlim(0, span * 1.01)
    axes[-1, 0].set_xlabel("seconds (bars on engine slots: one sample, labelled with its prompt; trainer: "
                           "micro-steps blue, optimizer step red, weight sync purple)", fontsize=8)
    fig.tight_layout()
    return _save(fig, out_path)


def plot_async_speedup(csv_path: str | Path, out_path: str | Path):
    """Bar chart of results/async_speedup.csv: speedup over sync-separated per mode, and the bound."""
    plt = _pyplot()

    rows = read_csv(csv_path)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    speedups = [float(r["speedup_vs_sync_separated"]) for r in rows]
    err = None
    if "speedup_min" in rows[0]:  # min-max of the paired (same-round) speedups
        err = [[max(v - float(r["speedup_min"]), 0) for v, r in zip(speedups, rows)],
               [max(float(r["speedup_max"]) - v, 0) for v, r in zip(speedups, rows)]]
    ax.bar([r["mode"] for r in rows], speedups, color=["#999999", "#C44E52", "#4C72B0"][: len(rows)], yerr=err,
           capsize=3)
    ax.axhline(float(rows[0]["bound"]), ls="--", color="black", lw=1,
               label=f"bound (T_gen+T_train)/max = {float(rows[0]['bound']):.2f}")
    for i, v in enumerate(speedups):
        ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("tokens/s vs sync-separated")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, out_path)


def plot_reward_curves(csv_path: str | Path, out_path: str | Path):
    """results/reward_curves.csv, one line per mode: training reward per iteration (left),
    held-out greedy accuracy with binomial standard-error bars (middle), and the staleness the
    off-policy mode trains with, mean |ratio - 1| and clip fraction (right; 0 on-policy)."""
    plt = _pyplot()

    rows = read_csv(csv_path)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    styles = {"sync-separated": ("-", "#4C72B0"), "periodic-async": ("--", "#C44E52"),
              "async-offpolicy": (":", "#55A868")}
    has_ratio = any(r.get("ratio_abs_dev") not in (None, "") for r in rows)
    fig, axes = plt.subplots(1, 3 if has_ratio else 2, figsize=(13 if has_ratio else 9, 3.4))
    num = lambda r, k: r.get(k) not in (None, "")  # noqa: E731
    for i, mode in enumerate(modes):
        ls, color = styles.get(mode, ("-.", f"C{i}"))
        mine = [r for r in rows if r["mode"] == mode]
        tr = [(int(r["iteration"]), float(r["reward_mean"])) for r in mine if num(r, "reward_mean")]
        if tr:
            axes[0].plot(*zip(*tr), ls, color=color, lw=1.2, label=mode)
        ev = [r for r in mine if num(r, "eval_accuracy")]
        if ev:
            shift = 0.25 * (i - 1)  # side by side: identical curves would hide each other's bars
            axes[1].errorbar([int(r["iteration"]) + shift for r in ev], [float(r["eval_accuracy"]) for r in ev],
                             yerr=[float(r["eval_stderr"]) if num(r, "eval_stderr") else 0 for r in ev],
                             fmt=ls + "o", color=color, ms=4, capsize=3, lw=1.2, label=mode)
        if has_ratio:
            st = [(int(r["iteration"]), float(r["ratio_abs_dev"]), float(r["clip_frac"]) if num(r, "clip_frac") else 0)
                  for r in mine if num(r, "ratio_abs_dev")]
            if st:
                its, dev, clip = zip(*st)
                axes[2].plot(its, dev, ls, color=color, lw=1.2, label=f"{mode}: mean |ratio - 1|")
                if max(clip) > 0:
                    axes[2].plot(its, clip, ls, color=color, lw=0.8, alpha=0.5, label=f"{mode}: clip fraction")
    axes[0].set(xlabel="iteration", ylabel="training reward (mean of B x G samples)")
    n = next((r["eval_n"] for r in rows if num(r, "eval_n")), "?")
    axes[1].set(xlabel="iteration (optimizer steps done)", ylabel=f"held-out accuracy, greedy (n={n}, ±1 s.e.)")
    if has_ratio:
        axes[2].set(xlabel="iteration", ylabel="importance ratio vs behaviour policy")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out_path)


def plot_reward_vs_time(csv_path: str | Path, out_path: str | Path):
    """results/reward_curves*.csv against wall-clock time (its time_s column): training reward
    (left) and held-out accuracy with ±1 s.e. (right), one line per mode. On-policy modes that
    sample the same tokens draw the same curve; the faster one reaches each point sooner."""
    plt = _pyplot()
    rows = read_csv(csv_path)
    styles = {"sync-separated": ("-", "#4C72B0"), "periodic-async": ("--", "#C44E52"),
              "async-offpolicy": (":", "#55A868")}
    num = lambda r, k: r.get(k) not in (None, "")  # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        ls, color = styles.get(mode, ("-.", f"C{i}"))
        mine = [r for r in rows if r["mode"] == mode and num(r, "time_s")]
        end = max((float(r["time_s"]) for r in mine), default=0.0)
        label = f"{mode} ({end / 60:.1f} min)"
        tr = [(float(r["time_s"]) / 60, float(r["reward_mean"])) for r in mine if num(r, "reward_mean")]
        if tr:
            axes[0].plot(*zip(*tr), ls + "o", color=color, ms=3, lw=1.2, label=label)
        ev = [r for r in mine if num(r, "eval_accuracy")]
        if ev:
            axes[1].errorbar([float(r["time_s"]) / 60 for r in ev], [float(r["eval_accuracy"]) for r in ev],
                             yerr=[float(r["eval_stderr"]) if num(r, "eval_stderr") else 0 for r in ev],
                             fmt=ls + "o", color=color, ms=4, capsize=3, lw=1.2, label=label)
    n = next((r["eval_n"] for r in rows if num(r, "eval_n")), "?")
    axes[0].set(xlabel="wall-clock time (min, start-up excluded)", ylabel="training reward (mean of B x G samples)")
    axes[1].set(xlabel="wall-clock time (min, start-up excluded)", ylabel=f"held-out accuracy, greedy (n={n}, ±1 s.e.)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out_path)


def request_number(args: dict) -> str:
    """Bar label for `plot_timeline`: the request's position in its iteration, 1..B (the paper's
    Figure 1 numbering), from the request id `it<iteration>-p<prompt>-<position>`."""
    return str(int(str(args["request"]).rsplit("-", 1)[1]) + 1)


def plot_equivalence(csv_path: str | Path, out_path: str | Path):
    """results/equivalence.csv: per iteration, the largest weight difference between the sync
    and async runs (log scale; an exact 0 is drawn at the floor) and the fraction of samples
    identical in both, for the method (one optimizer step) and the negative control."""
    return _save(equivalence_figure(read_csv(csv_path)), out_path)


def equivalence_figure(rows: list[dict]):
    """`plot_equivalence`'s figure of equivalence.csv's rows: one line per case in each panel."""
    plt = _pyplot()
    floor = 1e-18
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for i, case in enumerate(dict.fromkeys(r["case"] for r in rows)):  # the controls (two-steps) dashed
        style = "osd^vP*X"[i % 8] + ("--" if case.endswith("two-steps") else "-")
        mine = [r for r in rows if r["case"] == case]
        its = [int(r["iteration"]) for r in mine]
        axes[0].plot(its, [max(float(r["max_abs_weight_diff"]), floor) for r in mine], style, label=case)
        axes[1].plot(its, [float(r["identical_fraction"]) for r in mine], style, label=case)
    axes[0].set_yscale("log")
    axes[0].set(xlabel="iteration", ylabel="max |w_sync - w_async| after it", ylim=(floor / 10, None))
    axes[1].set(xlabel="iteration", ylabel="samples identical to sync", ylim=(-0.05, 1.05))
    axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))  # one legend, beside the data
    for ax in axes:
        ax.set_xticks(sorted({int(r["iteration"]) for r in rows}))
    fig.tight_layout()
    return fig


def plot_table2(csv_path: str | Path, out_path: str | Path, batch_csv: str | Path | None = None):
    """Table 2 (results/table2_throughput.csv): tokens/s over trl-grpo per system, one panel per
    setting, per-response and shared-prompt side by side, min-max of the paired ratios as error
    bars; with `batch_csv` (results/table2_batch_effect.csv) a last panel: tokens/s against B."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    plt = _pyplot()

    rows = read_csv(csv_path)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    batch = read_csv(batch_csv) if batch_csv and Path(batch_csv).is_file() else []
    panels = len(settings) + (1 if batch else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6), squeeze=False)
    colors = {"False": "#8DA0CB", "True": "#C44E52"}
    for ax, setting in zip(axes[0], settings):
        mine = [r for r in rows if r["setting"] == setting]
        systems = list(dict.fromkeys(r["system"] for r in mine))
        for r in mine:
            offset = 0.0 if r["system"] == "trl-grpo" else (0.2 if r["shared_prompt"] == "True" else -0.2)
            x = systems.index(r["system"]) + offset
            v, lo, hi = (float(r[k]) for k in ("speedup_vs_trl", "speedup_vs_trl_min", "speedup_vs_trl_max"))
            ax.bar(x, v, width=0.38, color="#999999" if r["system"] == "trl-grpo" else colors[r["shared_prompt"]],
                   yerr=[[max(v - lo, 0)], [max(hi - v, 0)]], capsize=2, ecolor="black")
            ax.text(x, v, f"{v:.1f}x", ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if str(v)[0] in "25" else ""))
        ax.tick_params(axis="y", which="both", labelsize=7)
        ax.set_xticks(range(len(systems)), systems, rotation=20, fontsize=8)
        ax.set_ylabel("trained tokens/s vs trl-grpo")
        scale = f"P~{float(mine[0]['mean_prompt_tokens']):.0f}, B*G={mine[0]['samples_per_iteration']}"
        ax.set_title(f"{setting} ({scale})", fontsize=9, loc="left")
    axes[0, 0].legend(handles=[Patch(color=colors["False"], label="per-response packing"),
                               Patch(color=colors["True"], label="shared-prompt packing")],
                      fontsize=7, loc="upper left")
    if batch:
        ax = axes[0, -1]
        for system, style in zip(dict.fromkeys(r["system"] for r in batch), ("o--", "s-", "^:")):
            mine = [r for r in batch if r["system"] == system]
            x = [int(r["samples_per_iteration"]) for r in mine]
            y = [float(r["tokens_per_s"]) for r in mine]
            err = [[yy - float(r["tokens_per_s_min"]) for yy, r in zip(y, mine)],
                   [float(r["tokens_per_s_max"]) - yy for yy, r in zip(y, mine)]]
            ax.errorbar(x, y, yerr=err, fmt=style, capsize=2, label=system)
        ax.axvline(int(batch[0]["engine_slots"]), color="gray", lw=1, ls=":", label="engine slots")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set(xlabel="samples per iteration (B*G)", ylabel="trained tokens/s")
        ax.set_title(f"effect of B ({batch[0]['setting']}, shared prompt)", fontsize=9, loc="left")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out_path)


def plot_scaling(measured_csv: str | Path, simulated_csv: str | Path, out_path: str | Path):
    """results/scaling_measured.csv + scaling_simulated.csv: (1) CPU points, measured iteration
    time (median, min-max) beside the calibrated simulator's; (2) SIMULATED trained tokens/s
    against devices, best split per mode, per device type, with linear scaling from the
    smallest total; (3) SIMULATED tokens/s against the inference share of the devices."""
    plt = _pyplot()
    meas, sim = read_csv(measured_csv), read_csv(simulated_csv)
    colors = {"sync-colocated": "#4C72B0", "sync-separated": "#999999", "periodic-async": "#C44E52"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    points = {r["system"]: r for r in sim if r["section"] == "cpu-measured-point"}
    x = list(range(len(meas)))
    m = [float(r["iteration_s"]) for r in meas]
    err = [[v - float(r["iteration_s_min"]) for v, r in zip(m, meas)],
           [float(r["iteration_s_max"]) - v for v, r in zip(m, meas)]]
    ax.bar([i - 0.2 for i in x], m, 0.4, yerr=err, capsize=3, color="#55A868", label="measured (median, min-max)")
    s = [float(points[r["system"]]["iteration_s"]) if r["system"] in points else 0.0 for r in meas]
    ax.bar([i + 0.2 for i in x], s, 0.4, color="#DDDDDD", edgecolor="black", hatch="//", label="simulated (calibrated)")
    for i, r in enumerate(meas):
        if r["system"] in points:
            ax.text(i + 0.2, s[i], f"{float(points[r['system']]['rel_error']):+.0%}", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(x, [r["system"] for r in meas], rotation=20, fontsize=7)
    ax.set(ylabel="seconds per iteration")
    ax.set_title(f"CPU ({meas[0]['cpu_cores']} cores): measured vs simulated", fontsize=9, loc="left")
    ax.legend(fontsize=7)
    pred = [r for r in sim if r["section"] == "prediction"]
    styles = ["-", "--", ":"]
    ax = axes[1]
    for k, dev in enumerate(dict.fromkeys(r["device_type"] for r in pred)):
        for mode, color in colors.items():
            best = sorted((int(r["devices"]), float(r["tokens_per_s"])) for r in pred
                          if r["device_type"] == dev and r["mode"] == mode and r["best"] == "True")
            if best:
                ax.plot(*zip(*best), styles[k % 3], marker="o", ms=3, color=color, label=f"{mode}, {dev} (simulated)")
        pa = sorted((int(r["devices"]), float(r["tokens_per_s"])) for r in pred
                    if r["device_type"] == dev and r["mode"] == "periodic-async" and r["best"] == "True")
        if pa:
            ax.plot([pa[0][0], pa[-1][0]], [pa[0][1], pa[0][1] * pa[-1][0] / pa[0][0]], styles[k % 3], lw=0.8,
                    color="black", alpha=0.5, label=f"linear from {pa[0][0]} ({dev})")
    params = float(pred[0]["model_params"]) if pred else 0
    ax.set(xlabel="devices", ylabel="trained tokens/s (simulated)")
    ax.set_title(f"SIMULATED: {params / 1e9:.0f}B model, best split per mode", fontsize=9, loc="left")
    ax.legend(fontsize=6)
    ax = axes[2]
    dev = pred[0]["device_type"] if pred else ""
    top = max((int(r["devices"]) for r in pred), default=0)
    for total, style in ((top, "-"), (top * 3 // 4, "--")):
        for mode in ("sync-separated", "periodic-async"):
            sweep = sorted((int(r["inference_devices"]) / total, float(r["tokens_per_s"])) for r in pred
                           if r["device_type"] == dev and r["mode"] == mode and int(r["devices"]) == total)
            if sweep:
                ax.plot(*zip(*sweep), style, marker=".", color=colors[mode],
                        label=f"{mode}, {total} devices (simulated)")
        colo = [float(r["tokens_per_s"]) for r in pred if r["device_type"] == dev and r["mode"] == "sync-colocated"
                and int(r["devices"]) == total]
        if colo:
            ax.axhline(colo[0], ls=style, color=colors["sync-colocated"], lw=1,
                       label=f"sync-colocated, {total} devices (simulated)")
    ax.set(xlabel="inference share of the devices", ylabel="trained tokens/s (simulated)")
    ax.set_title(f"SIMULATED: the split ({dev})", fontsize=9, loc="left")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, out_path)


def plot_fig1(results: str | Path, figures: str | Path, modes: Sequence[str] = ("sync-separated", "periodic-async")):
    """<figures>/fig1_timeline.png, the paper's Figure 1 from <results>/fig1_timeline.csv and the
    traces in <results>/fig1/ (experiments/fig1_timeline.py): one panel per mode, titled with
    the order in which the trainer took its first iteration's requests (numbered 1..B)."""
    results = Path(results)
    first: dict[str, dict] = {}
    for r in read_csv(results / "fig1_timeline.csv"):
        first.setdefault(r["mode"], r)
    panels = [(f"{m}: {len(first[m]['trained_order'].split())} requests, trained in order "
               f"{first[m]['trained_order']}", results / "fig1" / f"{m}.trace.jsonl") for m in modes]
    return plot_timeline(panels, Path(figures) / "fig1_timeline.png", bar_label=request_number)


def plot_shared_prompt(csv_path: str | Path, out_path: str | Path):
    """results/shared_prompt.csv (experiments/shared_prompt_ablation.py): speedup of shared-prompt
    packing against its token bound (G*P + sum R) / (P + sum R) per grid point, and the share of
    the bound kept (efficiency) per back-end. The paper reports about 8x on long prompts."""
    plt = _pyplot()
    rows = read_csv(csv_path)
    points = sorted({(int(r["P"]), int(r["G"]), int(r["R"])) for r in rows})
    backends = sorted({r["backend"] for r in rows})
    by = {(int(r["P"]), int(r["G"]), int(r["R"]), r["backend"]): r for r in rows}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw=dict(width_ratios=[1, 2]))
    bound = [float(by[p + (backends[0],)]["token_bound"]) for p in points]
    ax1.plot([0, max(bound) * 1.05], [0, max(bound) * 1.05], "k:", lw=1, label="token bound")
    for b in backends:
        ax1.scatter(bound, [float(by[p + (b,)]["speedup"]) for p in points], label=b, s=25)
    ax1.set(xlabel="token bound (G·P + ΣR) / (P + ΣR)", ylabel="speedup over per-response (fwd+bwd)",
            title="shared-prompt speedup")
    ax1.legend()
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        ax2.bar([x + i * width for x in range(len(points))], [float(by[p + (b,)]["efficiency"]) for p in points],
                width, label=b)
    ax2.axhline(1.0, color="k", ls=":", lw=1)
    ax2.set_xticks([x + 0.4 - width / 2 for x in range(len(points))],
                   [f"P={p}\nG={g}\nR={r}" for p, g, r in points], fontsize=7)
    ax2.set(ylabel="efficiency = speedup / token bound", title="share of the token bound kept")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out_path)


def plot_multiturn(csv_path: str | Path, curve_csv: str | Path, out_path: str | Path):
    """results/multiturn.csv and multiturn_curve.csv: each mode's speedup over sync-separated as the
    environment's latency spreads (left; min-max of the paired rounds, the bound dashed, the
    single-turn speedup dotted), and per iteration the training reward (middle) and the share of
    episodes that called the tool (right), one line per mode."""
    plt = _pyplot()

    rows, curve = read_csv(csv_path), read_csv(curve_csv)
    styles = {"sync-separated": ("-", "#4C72B0"), "periodic-async": ("--", "#C44E52"),
              "sync-colocated": ("-.", "#999999"), "async-offpolicy": (":", "#55A868")}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for mode in [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "sync-separated"]:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: float(r["p99_s"]))
        x, y = [float(r["p99_s"]) for r in mine], [float(r["speedup_vs_sync_separated"]) for r in mine]
        err = [[max(v - float(r["speedup_min"]), 0) for v, r in zip(y, mine)],
               [max(float(r["speedup_max"]) - v, 0) for v, r in zip(y, mine)]]
        ls, color = styles.get(mode, ("-", None))
        axes[0].errorbar(x, y, yerr=err, fmt=ls + "o", color=color, ms=4, capsize=3, lw=1.2, label=mode)
    sync = sorted((r for r in rows if r["mode"] == "sync-separated"), key=lambda r: float(r["p99_s"]))
    axes[0].plot([float(r["p99_s"]) for r in sync], [float(r["bound"]) for r in sync], "k--_", ms=14, lw=0.8,
                 label="bound (T_gen+T_train)/max")
    single = [float(r["single_turn_speedup"]) for r in rows if r.get("single_turn_speedup") not in (None, "")]
    if single:
        axes[0].axhline(single[0], ls=":", color="black", lw=0.8, label=f"single-turn periodic-async {single[0]:.2f}x")
    axes[0].axhline(1.0, color="#cccccc", lw=0.6)
    axes[0].set(xscale="log", xlabel="environment latency p99, s", ylabel="tokens/s vs sync-separated")
    for mode in dict.fromkeys(r["mode"] for r in curve):
        ls, color = styles.get(mode, ("-", None))
        mine = [r for r in curve if r["mode"] == mode]
        its = [int(r["iteration"]) for r in mine]
        axes[1].plot(its, [float(r["reward_mean"]) for r in mine], ls, color=color, lw=1.2, label=mode)
        axes[2].plot(its, [float(r["tool_use_rate"]) for r in mine], ls, color=color, lw=1.2, label=mode)
    axes[1].set(xlabel="iteration", ylabel="training reward (mean of B x G episodes)")
    axes[2].set(xlabel="iteration", ylabel="episodes that called the tool", ylim=(-0.02, 1.02))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out_path)
