#!/usr/bin/env bash
# LoRA against full fine-tuning on SmolLM2-135M-Instruct (beyond the paper), one script per claim:
#   lora_trimodel.py            the tri-model: weight bytes, micro-step time, peak memory (lora_trimodel.csv)
#   lora_push.py                the push: bytes, push + check time, built-in engine and vLLM (lora_push.csv)
#   async_speedup.py --settings lora   the iteration: sync-separated and periodic-async (lora_iteration.csv)
#   lora_learning.py            learning: a learning-rate sweep, then the reward curve's 20 iterations
#                               (lora_learning.csv, reward_curves_real_lora{,_summary}.csv)
#   bash experiments/lora.sh           3 rounds, then the learning runs (about 2 hours on 2 cores:
#                                      tri-model 5 min, push 6, iteration 18, sweep 37, learning 61)
#   QUICK=1 bash experiments/lora.sh   the same code paths at smoke size; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=lora   # the W&B group of this experiment's runs
python -m periodic_async prepare-model smollm2-135m
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
results=(--results "${RESULTS_DIR:-results}")
python experiments/lora_trimodel.py "${quick[@]}" "${results[@]}"
python experiments/lora_push.py "${quick[@]}" "${results[@]}"
python experiments/async_speedup.py --settings lora "${quick[@]}" "${results[@]}"
python experiments/lora_learning.py "${quick[@]}" "${results[@]}"
