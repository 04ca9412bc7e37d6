#!/usr/bin/env bash
# The paper's Table 2 at CPU scale: end-to-end trained tokens/s of TRL's GRPOTrainer and of our
# three modes, with and without shared prompts (see table2_throughput.py and .yaml).
#   bash experiments/table2_throughput.sh          ~50 min on 2 cores (12 for the two tiny-model settings)
#   QUICK=1 bash experiments/table2_throughput.sh  ~1 min smoke run of the long-prompt setting (every system);
#        QUICK=1 ... --settings real-model is the SmolLM2 smoke run (~4 min); RESULTS_DIR (default results)
#   bash experiments/table2_throughput.sh --settings real-model   one setting (SmolLM2-135M-Instruct, ~40 min)
# Installs TRL (the optional extra `.[bench]`) into .venv when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=table2_throughput   # the W&B group of this experiment's runs
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('trl') is None)" || python -m pip install -q -e ".[bench]"
if [ "${QUICK:-0}" = 0 ] || [[ " $* " == *real-model* ]]; then   # the real-model setting's model (once)
  python -m periodic_async prepare-model smollm2-135m
fi
quick=(); [ "${QUICK:-0}" != 0 ] && quick=(--quick --settings long-prompt)
if [ ! -f artifacts/sft-qwen2-1m/config.json ] && [ "${QUICK:-0}" = 0 ]; then
  echo "[table2] no warm start in artifacts/sft-qwen2-1m: run 'bash experiments/warm_start.sh' first for the committed numbers"
fi
python experiments/table2_throughput.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
