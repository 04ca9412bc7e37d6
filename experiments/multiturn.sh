#!/usr/bin/env bash
# Multi-turn episodes with a calculator tool and a verifier: periodic-async against sync-separated,
# sync-colocated and async-offpolicy, three latency spreads, after a warm start that teaches the
# plain-text call format (see multiturn.py and multiturn.yaml).
#   bash experiments/multiturn.sh    QUICK=1: a smoke run on a tiny preset (minutes); RESULTS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=multiturn   # the W&B group of this experiment's runs
quick=()
if [ "${QUICK:-0}" != 0 ]; then
  quick=(--quick)
  [ -f artifacts/tokenizer/tokenizer_config.json ] || python -m periodic_async tokenizer artifacts/tokenizer
else
  python -m periodic_async prepare-model smollm2-135m
fi
python experiments/multiturn.py --results "${RESULTS_DIR:-results}" "${quick[@]}" "$@"
