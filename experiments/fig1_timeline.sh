#!/usr/bin/env bash
# The paper's Figure 1 from real runs (see fig1_timeline.py): sync-separated vs periodic-async,
# 10 requests on 5 slots. Writes $RESULTS_DIR/fig1_timeline.csv, $RESULTS_DIR/fig1/ (traces) and
# $FIGURES_DIR/fig1_timeline.png. About a minute.
#   bash experiments/fig1_timeline.sh          QUICK=1 (the same, fewer training problems); RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=fig1_timeline
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
# the smoke run's warm start (run_all.sh QUICK=1 makes it first); else the yaml's
if [ "${QUICK:-0}" != 0 ] && [ -f artifacts/sft-quick/config.json ]; then quick+=(model.name_or_path=artifacts/sft-quick); fi
python experiments/fig1_timeline.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
