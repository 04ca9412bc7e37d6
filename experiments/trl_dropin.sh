#!/usr/bin/env bash
# One script, two libraries: examples/trl_grpo.py (TRL's GRPOTrainer shape) on periodic_async and, with
# its import line switched, on TRL 1.16; time per optimizer step of each on SmolLM2-135M-Instruct
# (see trl_dropin.py). Renders into docs/trl.md (python scripts/update_readme.py).
#   bash experiments/trl_dropin.sh           ~25 min on 2 cores (3 interleaved rounds of 6 steps each)
#   QUICK=1 bash experiments/trl_dropin.sh   smoke run (1 round of 3 short steps, the tiny preset); RESULTS_DIR (default results)
# Installs TRL (the optional extra `.[bench]`) into .venv when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('trl') is None)" || python -m pip install -q -e ".[bench]"
quick=(--quick)   # the smoke run: the tiny preset (trl_dropin.py); else SmolLM2-135M-Instruct, prepared once
[ "${QUICK:-0}" != 0 ] || { quick=(); python -m periodic_async prepare-model smollm2-135m; }
python experiments/trl_dropin.py "${quick[@]}" --results "${RESULTS_DIR:-results}" "$@"
