#!/usr/bin/env bash
# Engine throughput (our continuous batching, vLLM, static HF generate) and weight-push time.
#   bash experiments/engine_throughput.sh            # full: qwen2-5m and SmolLM2-135M, 3 interleaved rounds
#   QUICK=1 bash experiments/engine_throughput.sh    # qwen2-1m on 2 workers, 1 round (pushes measured on it)
# Writes $RESULTS_DIR/engine.csv, vllm_push.csv and weight_sync.csv (RESULTS_DIR defaults to results).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=engine_throughput   # the W&B group of this experiment's runs
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
RESULTS_DIR="${RESULTS_DIR:-results}"
[ "${QUICK:-0}" = 1 ] || python -m periodic_async prepare-model smollm2-135m   # the real model (once; idempotent)
args=(--results "$RESULTS_DIR")
if [ "${QUICK:-0}" = "1" ]; then args+=(--quick); fi
python experiments/engine_throughput.py "${args[@]}"
