#!/usr/bin/env bash
# Asynchrony alone: periodic-async vs sync-separated vs sync-colocated (see async_speedup.py).
#   bash experiments/async_speedup.sh                          every setting (QUICK=1: a smoke run of cpu-tuned)
#   bash experiments/async_speedup.sh --settings real-model    one setting (cpu-tuned, balanced, real-model,
#                                                              lora, dynamic)
# QUICK=1 for a smoke run; RESULTS_DIR (default results).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=async_speedup   # the W&B group of this experiment's runs
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick)
results=(--results "${RESULTS_DIR:-results}")
setting() {  # setting NAME [overrides...]
  local name=$1; shift
  [ "$name" != real-model ] || python -m periodic_async prepare-model smollm2-135m
  python experiments/async_speedup.py "${quick[@]}" "${results[@]}" --settings "$name" "$@"
}
if [ "${1:-}" = --settings ]; then
  name=${2:?--settings needs a name: cpu-tuned, balanced, real-model, lora or dynamic}; shift 2
  setting "$name" "$@"
  exit
fi
setting cpu-tuned "$@"
# The balanced workload, the paper's setting of 1.92x: the same workload deployed as the paper's
# separated modes are, each phase on its own core for the whole iteration (no hand-off of the
# engine's core after generation), as on separate accelerators. Not in QUICK: the same code.
# real-model: SmolLM2-135M-Instruct on a vLLM worker, the same deployment (about 25 minutes).
# phase_contention: do the two phases slow each other as bare processes on two cores (about 4 minutes)?
# dynamic: how much dynamic sampling lengthens an iteration, periodic-async against sync-separated.
if [ "${QUICK:-0}" = 0 ]; then
  setting balanced "$@"
  setting dynamic "$@"
  python experiments/phase_contention.py "${results[@]}"
  setting real-model "$@"
fi
