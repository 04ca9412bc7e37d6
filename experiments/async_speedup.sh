#!/usr/bin/env bash
# Asynchrony alone: periodic-async vs sync-separated vs sync-colocated (see async_speedup.py).
#   bash experiments/async_speedup.sh          QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=async_speedup   # the W&B group of this experiment's runs
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
python experiments/async_speedup.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
# The balanced workload (phases of nearly equal length, one core each): the paper's setting of 1.92x.
# Not in QUICK: the same code as above on another workload.
[ "${QUICK:-0}" != 0 ] || python experiments/async_speedup.py --config experiments/async_balanced.yaml --tag balanced \
  --results "${RESULTS_DIR:-results}" "$@"
