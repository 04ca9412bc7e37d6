#!/usr/bin/env bash
# Scale-out: measured engine-worker and trainer-rank (1 vs 2 torchrun ranks) scaling at CPU scale,
# the calibrated simulator's error on those points, and its SIMULATED predictions for 16-64
# accelerators (best inference/training split per mode). See experiments/scaling.py.
#   bash experiments/scaling.sh        QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=scaling
quick=(--trainer-ranks); [ "${QUICK:-0}" != 0 ] && quick=(--quick)   # 1 vs 2 torchrun trainer ranks too
python experiments/scaling.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
