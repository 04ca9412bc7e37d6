#!/usr/bin/env bash
# Shared-prompt attention x asynchrony on long few-shot prompts (see shared_async.py).
#   bash experiments/shared_async.sh          QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=shared_async   # the W&B group of this experiment's runs
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
python experiments/shared_async.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
