#!/usr/bin/env bash
# Shared-prompt attention ablation (the paper's shared-prompt attention): fwd+bwd speedup of [prompt | r_1 | ... | r_G]
# over per-response rows, per attention back-end, against the token bound.
#   bash experiments/shared_prompt_ablation.sh          # P in {512,1024}, G in {8,16}, R in {32,64,128}
#   QUICK=1 bash experiments/shared_prompt_ablation.sh  # tiny grid, < 1 min
# Writes $RESULTS_DIR/shared_prompt.csv (RESULTS_DIR defaults to results) and figures/shared_prompt.png;
# extra arguments go to experiments/shared_prompt_ablation.py (e.g. --threads 2 --repeats 7).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=shared_prompt_ablation   # the W&B group of this experiment's runs
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
RESULTS_DIR="${RESULTS_DIR:-results}"
ARGS=(--results "$RESULTS_DIR")
if [[ "${QUICK:-0}" == "1" ]]; then ARGS+=(--quick); fi
python experiments/shared_prompt_ablation.py "${ARGS[@]}" "$@"
