#!/usr/bin/env bash
# Create/use .venv, install the package with test extras, run pytest (extra args go to pytest).
#   bash run_tests.sh                 # default suite (excludes `slow`)
#   bash run_tests.sh -m slow         # the slow tests only
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
exec python -m pytest "$@"
