# Sourced by run_tests.sh and run_all.sh: create/activate .venv and install the package.
# CPU machines get torch==2.13.0 (CPU build). GPU/NPU users: install your torch build into
# .venv first (e.g. `pip install torch --index-url .../cu124`, or torch + torch_npu); an
# existing torch is kept.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true RAY_USAGE_STATS_ENABLED=0
export RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
source .venv/bin/activate
stamp=.venv/.periodic_async_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing into .venv (log: .venv/install.log) ..."
  {
    python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[dev]"
  } > .venv/install.log 2>&1 || { tail -n 40 .venv/install.log; echo "install failed: see .venv/install.log"; return 1; }
  touch "$stamp"
fi
