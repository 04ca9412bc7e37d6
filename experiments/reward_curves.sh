#!/usr/bin/env bash
# Reward/accuracy curves, sync-separated vs periodic-async (see reward_curves.py).
#   bash experiments/reward_curves.sh          QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=reward_curves   # the W&B group of this experiment's runs
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick model.name_or_path=artifacts/sft-quick)
python experiments/reward_curves.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
