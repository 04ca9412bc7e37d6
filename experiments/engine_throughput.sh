#!/usr/bin/env bash
# Engine throughput (continuous batching vs static HF generate) and weight-sync time.
#   bash experiments/engine_throughput.sh            # full: qwen2-5m, 3 interleaved rounds, ~15-20 min on 2 CPUs
#   QUICK=1 bash experiments/engine_throughput.sh    # qwen2-1m, < 2 min
# Writes $RESULTS_DIR/engine.csv and $RESULTS_DIR/weight_sync.csv (RESULTS_DIR defaults to results).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=engine_throughput   # the W&B group of this experiment's runs
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
RESULTS_DIR="${RESULTS_DIR:-results}"
args=(--results-dir "$RESULTS_DIR")
if [ "${QUICK:-0}" = "1" ]; then args+=(--quick); fi
python experiments/engine_throughput.py "${args[@]}"
