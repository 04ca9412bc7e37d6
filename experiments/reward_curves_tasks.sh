#!/usr/bin/env bash
# The paper's learning claims on reasoning-gym tasks (gsm_symbolic, basic_arithmetic) with
# SmolLM2-135M-Instruct on vLLM: per task a warm start (sft) on its training entries, then RL in
# sync-separated, periodic-async and async-offpolicy, dynamic sampling off and on, held-out
# accuracy before and after (see reward_curves_tasks.py and reward_curves_tasks.yaml).
#   bash experiments/reward_curves_tasks.sh    QUICK=1: a smoke run on a tiny preset (minutes); RESULTS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=reward_curves_tasks   # the W&B group of this experiment's runs
quick=()
if [ "${QUICK:-0}" != 0 ]; then
  quick=(--quick)
else
  python -m periodic_async prepare-model smollm2-135m
fi
python experiments/reward_curves_tasks.py --results "${RESULTS_DIR:-results}" "${quick[@]}" "$@"
