#!/usr/bin/env bash
# Reward/accuracy curves from one seed: sync-separated, periodic-async, async-offpolicy
# (see reward_curves.py). Builds the RL base policy (experiments/rl_base.yaml) when missing.
#   bash experiments/reward_curves.sh          QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=reward_curves   # the W&B group of this experiment's runs
base=artifacts/sft-rl-base; sft=(); quick=()
if [ "${QUICK:-0}" != 0 ]; then
  base=artifacts/sft-rl-base-quick; sft=(sft.max_steps=10 data.num_train=1000 data.num_eval=10); quick=(--quick)
  # the smoke run's warm start (run_all.sh QUICK=1 makes it first): the same model and tokenizer after
  # as few SFT steps, so the smoke run makes no second one (the SFT's code ran in warm_start.sh)
  if [ -f artifacts/sft-quick/config.json ]; then base=artifacts/sft-quick; fi
fi
if [ ! -f "$base/config.json" ]; then
  python -m periodic_async sft --config experiments/rl_base.yaml sft.output_dir="$base" logging.progress=false "${sft[@]}"
fi
python experiments/reward_curves.py "${quick[@]}" model.name_or_path="$base" --results "${RESULTS_DIR:-results}" "$@"
