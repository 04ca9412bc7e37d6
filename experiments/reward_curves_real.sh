#!/usr/bin/env bash
# Reward/accuracy curves of RL on SmolLM2-135M-Instruct: sync-separated, periodic-async,
# async-offpolicy (see reward_curves.py and reward_curves_real.yaml). Prepares the model once.
#   bash experiments/reward_curves_real.sh     QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=reward_curves_real   # the W&B group of this experiment's runs
python -m periodic_async prepare-model smollm2-135m
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick engine.max_tokens=16 data.num_train=200 data.num_eval=4
                                          algorithm.prompts_per_iteration=2 algorithm.group_size=2 trainer.iterations=2
                                          trainer.eval_every=2)
python experiments/reward_curves.py --config experiments/reward_curves_real.yaml --tag real "${quick[@]}" \
  --results "${RESULTS_DIR:-results}" "$@"
