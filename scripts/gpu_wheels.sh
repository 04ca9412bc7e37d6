#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU machine that has Python 3.12, torch and
# transformers but no network: the project's dependencies the check imports besides those two
# (tests/test_gpu_check.py checks this list against what the check's steps really import).
# Ray, vLLM, W&B, TRL and datasets are not among them: the check runs without them.
#
#   bash scripts/gpu_wheels.sh [DIR]      download them into DIR (default build/gpu-wheels,
#                                         ignored by git) and print their total size
#   bash scripts/gpu_wheels.sh --list     the pinned requirements, one a line; nothing downloaded
#   bash scripts/gpu_wheels.sh --modules  "distribution import-name" pairs (gpu_check.sh installs
#                                         only the wheels whose module the machine lacks)
#
# Then, on the GPU machine (DIR carried beside the repository):
#   WHEELS=DIR PYTHON=python3 bash scripts/gpu_check.sh OUT
# Versions: those of the project's .venv (transformers 5.19 wants tokenizers >=0.23.1,<0.24).
# GPU_WHEELS_PYTHON (default 3.12) and GPU_WHEELS_PLATFORMS choose the target interpreter/platforms.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  "pyyaml==6.0.4 yaml"
  "numpy==2.3.5 numpy"
  "tokenizers==0.23.3 tokenizers"
  "tqdm==4.70.1 tqdm"
)

case "${1:-}" in
  --list)    for p in "${PACKAGES[@]}"; do echo "${p%% *}"; done; exit 0 ;;
  --modules) for p in "${PACKAGES[@]}"; do spec=${p%% *}; echo "${spec%%==*} ${p##* }"; done; exit 0 ;;
  -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
esac

DIR="${1:-build/gpu-wheels}"
mkdir -p "$DIR"
PY_VERSION="${GPU_WHEELS_PYTHON:-3.12}"
read -r -a PLATFORMS <<< "${GPU_WHEELS_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
for p in "${PACKAGES[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
      "${platform_args[@]}" -d "$DIR" "${p%% *}" 2>&1 | { grep -v "is ignored: it is neither" || true; }
done
shopt -s nullglob
wheels=("$DIR"/*.whl)
if [ ${#wheels[@]} -lt ${#PACKAGES[@]} ]; then
  echo "gpu_wheels: expected ${#PACKAGES[@]} wheels in $DIR, found ${#wheels[@]}" >&2
  exit 1
fi
ls -1 "$DIR"
bytes=$(du -cb "${wheels[@]}" | tail -n 1 | cut -f1)
echo "gpu_wheels: ${#wheels[@]} wheels, $bytes bytes ($(( (bytes + 524288) / 1048576 )) MiB) in $DIR"
