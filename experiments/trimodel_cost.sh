#!/usr/bin/env bash
# Tri-model cost (the paper's unified tri-model): micro-step time of policy/old/ref vs policy only, and weight
# memory; writes $RESULTS_DIR/trimodel_cost.csv (default results/).
#   bash experiments/trimodel_cost.sh          # qwen2-5m, fp32, about a minute
#   QUICK=1 bash experiments/trimodel_cost.sh  # qwen2-1m, under half a minute
# With LoRA against full fine-tuning on SmolLM2-135M-Instruct (weights, micro-step, peak memory):
#   python experiments/lora_trimodel.py  (results/lora_trimodel.csv; part of bash experiments/lora.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=trimodel_cost   # the W&B group of this experiment's runs
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
RESULTS_DIR="${RESULTS_DIR:-results}"
ARGS=()
if [[ "${QUICK:-0}" == "1" ]]; then ARGS+=(--quick); fi
python experiments/trimodel_cost.py --results "$RESULTS_DIR" "${ARGS[@]}" "$@"
