#!/usr/bin/env bash
# Soak (issue 11, see soak.py): 200 periodic-async iterations on 2 Ray engine workers (soak.yaml),
# stopped at iteration 60 and resumed from the checkpoint in a new process, engine worker 1
# SIGKILLed at iteration 130 and restarted (engine.restart_workers). Samples trainer and worker RSS,
# open file descriptors and queue depth into $RESULTS_DIR/soak.csv; RSS growth per 100 iterations
# in $RESULTS_DIR/soak_summary.csv. A few minutes on 2 CPU cores.
#   bash experiments/soak.sh          QUICK=1: 7 iterations (stop 2, kill 4); RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=soak
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--iterations 7 --stop-at 2 --kill-at 4 --every 1 --warmup 1)
python experiments/soak.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
