#!/usr/bin/env bash
# Supervised warm start of the RL base policy: tokenizer, SFT, held-out accuracy.
#   bash experiments/warm_start.sh       QUICK=1 (shorter); RESULTS_DIR (default results)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export WANDB_RUN_GROUP=warm_start
results="${RESULTS_DIR:-results}"
out=artifacts/sft-qwen2-1m
args=()
if [ "${QUICK:-0}" != 0 ]; then out=artifacts/sft-quick; args+=(sft.max_steps=10 data.num_train=1000 data.num_eval=20); fi
python -m periodic_async sft --config experiments/sft.yaml sft.output_dir="$out" "${args[@]}" "$@"
mkdir -p "$results"
# sft.csv from the run's summary, and its W&B summary run (offline unless WANDB_MODE=online)
python - "$out/sft_summary.json" "$results/sft.csv" <<'PY'
import json, sys
from pathlib import Path
from periodic_async.records import write_csv
from periodic_async.trace import log_experiment
summary = json.loads(Path(sys.argv[1]).read_text())
keys = ["model", "parameters", "steps", "examples_seen", "train_seconds", "eval_n", "accuracy_before", "accuracy_after"]
print(f"wrote {write_csv(sys.argv[2], [{k: summary[k] for k in keys}])}")  # stamped before the file is rewritten
log_experiment("warm_start", [sys.argv[2]])
PY
