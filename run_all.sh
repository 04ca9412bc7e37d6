#!/usr/bin/env bash
# The CPU-scale reproduction, end to end: warm start, then one experiment per paper claim,
# then the README tables from the results they wrote.
#   bash run_all.sh            full run (about 15 minutes on a quiet 2-core machine)
#   QUICK=1 bash run_all.sh    smoke run of the same path (a few minutes)
# RESULTS_DIR (default results) redirects every CSV (and the figures, to $RESULTS_DIR/figures).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
export RESULTS_DIR="${RESULTS_DIR:-results}"
# Figures go beside redirected results, so a smoke run never overwrites the committed ones.
if [ "$RESULTS_DIR" = results ]; then export FIGURES_DIR=figures; else export FIGURES_DIR="$RESULTS_DIR/figures"; fi
step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

step "tokenizer"
python -m periodic_async.tokenizer artifacts/tokenizer
step "warm start (supervised) and held-out accuracy"
bash experiments/warm_start.sh
for exp in engine_throughput shared_prompt_ablation trimodel_cost async_speedup shared_async reward_curves; do
  if [ -f "experiments/$exp.sh" ]; then
    step "experiment: $exp"
    bash "experiments/$exp.sh"
  fi
done
if [ "$RESULTS_DIR" = results ]; then
  step "README tables from results/"
  python scripts/update_readme.py
fi
echo "done: results in $RESULTS_DIR/, figures in $FIGURES_DIR/"
