#!/usr/bin/env bash
# LoRA against full fine-tuning on SmolLM2-135M-Instruct: the tri-model (weight bytes, micro-step time,
# peak memory), the push (bytes, push + check time, built-in engine and vLLM), the iteration, and
# learning (a learning-rate sweep, then the reward curve's 20 iterations); see lora.py.
#   bash experiments/lora.sh           3 rounds, then the learning runs (about 2 hours on 2 cores:
#                                      tri-model 5 min, push 6, iteration 18, sweep 37, learning 61)
#   QUICK=1 bash experiments/lora.sh   1 round, 2 versions; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=lora   # the W&B group of this experiment's runs
python -m periodic_async prepare-model smollm2-135m
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
python experiments/lora.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
