#!/usr/bin/env bash
# The CPU-scale reproduction, end to end: warm start, then one experiment per paper claim,
# then the tables (docs/results.md, the README's claims) from the results they wrote.
#   bash run_all.sh            full run (the experiments add up to about four hours on a 2-core CPU;
#                              each one's time: docs/reproduce.md)
#   QUICK=1 bash run_all.sh    smoke run of the same path; implies FORCE=1 (measured: 643 s on 2 cores
#                              at 596120e, .venv installed)
#   FORCE=1 bash run_all.sh    rerun experiments whose results are already there
# An experiment is skipped when its main CSV exists in RESULTS_DIR (default results), which
# redirects every CSV (and the figures, to $RESULTS_DIR/figures).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
# A smoke run never overwrites the committed results: QUICK=1 writes to results/tmp/quick by default.
if [ "${QUICK:-0}" != 0 ]; then export RESULTS_DIR="${RESULTS_DIR:-results/tmp/quick}"; fi
export RESULTS_DIR="${RESULTS_DIR:-results}"
# Figures go beside redirected results, so a smoke run never overwrites the committed ones.
if [ "$RESULTS_DIR" = results ]; then export FIGURES_DIR=figures; else export FIGURES_DIR="$RESULTS_DIR/figures"; fi
FORCE="${FORCE:-0}"; [ "${QUICK:-0}" != 0 ] && FORCE=1
t_all=$SECONDS
step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

# experiment -> the CSV that says it has run (in RESULTS_DIR)
declare -A MAIN_CSV=(
  [warm_start]=sft.csv [table2_throughput]=table2_throughput.csv [engine_throughput]=engine.csv
  [shared_prompt_ablation]=shared_prompt.csv [trimodel_cost]=trimodel_cost.csv [async_speedup]=async_speedup.csv
  [shared_async]=shared_async.csv [reward_curves]=reward_curves_summary.csv [fig1_timeline]=fig1_timeline.csv
  [equivalence]=equivalence.csv [scaling]=scaling_measured.csv [soak]=soak_summary.csv
  [reward_curves_real]=reward_curves_real_summary.csv
)
experiment() {  # run experiments/$1.sh unless its main CSV is there (and the warm start's model)
  local exp=$1 csv="$RESULTS_DIR/${MAIN_CSV[$1]}" t0=$SECONDS
  if [ ! -f "experiments/$exp.sh" ]; then echo "missing experiments/$exp.sh"; return 0; fi
  local have=0; [ -f "$csv" ] && have=1
  if [ "$exp" = warm_start ] && [ ! -f artifacts/sft-qwen2-1m/config.json ]; then have=0; fi
  if [ "$FORCE" = 0 ] && [ "$have" = 1 ]; then echo "skip $exp: $csv exists (FORCE=1 to rerun)"; return 0; fi
  step "experiment: $exp"
  bash "experiments/$exp.sh"
  echo "--- $exp: $((SECONDS - t0)) s"
}

step "tokenizer"
python -m periodic_async tokenizer artifacts/tokenizer
for exp in warm_start table2_throughput engine_throughput shared_prompt_ablation trimodel_cost async_speedup \
           shared_async reward_curves fig1_timeline equivalence scaling soak reward_curves_real; do
  experiment "$exp"
done
if [ "$RESULTS_DIR" = results ]; then
  step "tables from results/ (docs/results.md, README.md)"
  python scripts/update_readme.py
fi
echo "done in $((SECONDS - t_all)) s: results in $RESULTS_DIR/, figures in $FIGURES_DIR/"
