#!/usr/bin/env bash
# Reward/accuracy curves of RL on SmolLM2-135M-Instruct: sync-separated, periodic-async,
# async-offpolicy (see reward_curves.py and reward_curves_real.yaml). Prepares the model once.
#   bash experiments/reward_curves_real.sh     QUICK=1 for a smoke run; RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=reward_curves_real   # the W&B group of this experiment's runs
python -m periodic_async prepare-model smollm2-135m
results=(--results "${RESULTS_DIR:-results}")
if [ "${QUICK:-0}" != 0 ]; then
  # The smoke run: the curves' code on this model in one process (two modes: the comparison with
  # sync-separated included; the third mode's code runs in reward_curves.sh's smoke run), and the
  # prediction calibrated on those two runs (the full run's wall-clock part below runs the same
  # code on another config: one process and one vLLM start less).
  python experiments/reward_curves.py --config experiments/reward_curves_real.yaml --tag real \
    --modes sync-separated,periodic-async --quick engine.max_tokens=8 data.num_train=200 data.num_eval=2 \
    algorithm.prompts_per_iteration=2 algorithm.group_size=2 trainer.iterations=2 trainer.eval_every=2 \
    "${results[@]}" "$@"
  python experiments/real_model_prediction.py --runs runs/reward_curves/reward_curves_real "${results[@]}"
  exit
fi
python experiments/reward_curves.py --config experiments/reward_curves_real.yaml --tag real "${results[@]}" "$@"
# Reward against wall-clock time, in the deployment where asynchrony pays (async_speedup_real.yaml:
# one vLLM worker on one core, the trainer on the other, each for the whole iteration): the two
# on-policy modes from one seed sample the same tokens, so they draw one curve (B=8 prompts of up
# to 96 tokens: answers that fit, so that accuracy can rise); the time axis
# shows which reaches each point sooner (figures/reward_curves_real_time_wallclock.png). About 30 minutes.
python experiments/reward_curves.py --config experiments/async_speedup_real.yaml --tag real_time \
  --modes sync-separated,periodic-async trainer.iterations=10 trainer.eval_every=5 trainer.eval_at_end=true \
  data.num_eval=100 algorithm.lr=2.0e-5 algorithm.prompts_per_iteration=8 engine.max_tokens=96 \
  "${results[@]}" "$@"
# The same phase costs in the simulator: what 1, 2, 4 and 8 engine workers beside the same trainer
# would give (simulated: a prediction, labelled so in the CSV).
python experiments/real_model_prediction.py --runs runs/reward_curves/reward_curves_real_time "${results[@]}"
