#!/usr/bin/env bash
# On-policy equivalence per iteration, and its negative control (see equivalence.py).
# Writes $RESULTS_DIR/equivalence.csv and $FIGURES_DIR/equivalence.png. A few minutes, plus about
# ten for the real-model cases (SmolLM2-135M-Instruct, float32); --cases real-model,... runs a subset.
#   bash experiments/equivalence.sh          QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=equivalence
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
[ "${QUICK:-0}" != 0 ] || python -m periodic_async prepare-model smollm2-135m   # the real-model cases' model
# the smoke run's warm start (run_all.sh QUICK=1 makes it first); else the yaml's
if [ "${QUICK:-0}" != 0 ] && [ -f artifacts/sft-quick/config.json ]; then quick+=(model.name_or_path=artifacts/sft-quick); fi
python experiments/equivalence.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
