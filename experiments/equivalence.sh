#!/usr/bin/env bash
# On-policy equivalence per iteration, and its negative control (see equivalence.py).
# Writes $RESULTS_DIR/equivalence.csv and $FIGURES_DIR/equivalence.png. A few minutes.
#   bash experiments/equivalence.sh          QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=equivalence
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick model.name_or_path=artifacts/sft-quick)
python experiments/equivalence.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
