"""The command line every experiment shares (experiments/*.py): one parser builds the common options.

    ap = experiment_parser(__doc__, runs="runs/async_speedup", repeats=(3, 1))
    ap.add_argument("--settings", ...)                 # the experiment's own options
    args = ap.parse_args(argv)                          # args.repeats: 3, 1 with --quick, or as given

The options, each where the experiment takes it:
    --quick      the smoke run: the same code paths at small sizes (`QUICK=1 bash run_all.sh`)
    --repeats    measured rounds: `repeats` = (full run, --quick); a value given on the command line wins
    --results    where the CSVs go (default: $RESULTS_DIR, else results)
    --runs       where the runs' own outputs go (metrics, traces, checkpoints)
    --figures    where the figures go (default: $FIGURES_DIR, else figures)
    overrides    trailing section.key=value, applied to every run's config
"""

from __future__ import annotations

import argparse
import os


class ExperimentParser(argparse.ArgumentParser):
    """argparse's parser that resolves --repeats after parsing: as given, else the full run's
    or the smoke run's default (both numbers shown in --help)."""

    repeats_default: tuple[int, int] | None = None

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if self.repeats_default and ns.repeats is None:
            full, quick = self.repeats_default
            ns.repeats = quick if getattr(ns, "quick", False) else full
        return ns, rest


def experiment_parser(doc: str | None, *, runs: str | None = None, repeats: tuple[int, int] | None = None,
                      quick: bool = True, figures: bool = False, overrides: bool = False) -> ExperimentParser:
    """The parser of one experiment: --results always; --quick unless `quick` is False; --repeats
    when `repeats` = (full, quick) is given; --runs when `runs` (its default) is given; --figures
    and the trailing `overrides` when asked for. `doc` (the script's docstring) is the --help text."""
    ap = ExperimentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick:
        ap.add_argument("--quick", action="store_true", help="smoke run: the same code paths at small sizes")
    if repeats:
        ap.repeats_default = repeats
        quick_note = f"; {repeats[1]} with --quick" if quick else ""
        ap.add_argument("--repeats", type=int, default=None, help=f"measured rounds (default {repeats[0]}{quick_note})")
    ap.add_argument("--results", default=os.environ.get("RESULTS_DIR", "results"),
                    help="directory of the CSVs (default: $RESULTS_DIR, else results)")
    if runs:
        ap.add_argument("--runs", default=runs, help=f"directory of the runs' outputs (default {runs})")
    if figures:
        ap.add_argument("--figures", default=os.environ.get("FIGURES_DIR", "figures"),
                        help="directory of the figures (default: $FIGURES_DIR, else figures)")
    if overrides:
        ap.add_argument("overrides", nargs="*", help="section.key=value, applied to every run")
    return ap
