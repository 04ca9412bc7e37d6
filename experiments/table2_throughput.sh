#!/usr/bin/env bash
# The paper's Table 2 at CPU scale: end-to-end trained tokens/s of TRL's GRPOTrainer and of our
# three modes, with and without shared prompts (see table2_throughput.py and .yaml).
#   bash experiments/table2_throughput.sh          ~50 min on 2 cores: the two tiny-model settings (12 min), then
#                                                  the real-model setting at 2 rounds in a process of its own (38 min)
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
if [ ! -f artifacts/sft-qwen2-1m/config.json ] && [ "${QUICK:-0}" = 0 ] && [[ " $* " != *" real-model "* ]]; then
  echo "[table2] no warm start in artifacts/sft-qwen2-1m: run 'bash experiments/warm_start.sh' first for the committed numbers"
fi
if [ "${QUICK:-0}" = 0 ] && [ $# = 0 ]; then
  # The whole table: the tiny-model settings, then the real-model setting in a process of its own at
  # 2 rounds. After the tiny settings, in one process at 3 rounds, its third round had TRL with vLLM
  # killed for memory on a 24 GiB machine; alone at 2 rounds it fits (the committed rows).
  python experiments/table2_throughput.py --settings long-prompt,short-prompt --results "${RESULTS_DIR:-results}"
  python experiments/table2_throughput.py --settings real-model --repeats 2 --results "${RESULTS_DIR:-results}"
else
  python experiments/table2_throughput.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
fi
