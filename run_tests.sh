#!/usr/bin/env bash
# Create/use .venv, install the package with test extras, run pytest (extra args go to pytest).
#   bash run_tests.sh                 # default suite (excludes `slow`), two test processes (PYTEST_WORKERS=2)
#   bash run_tests.sh -m slow         # the slow tests only
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
# With no arguments: the default suite in two processes (pytest-xdist, whole modules each; the
# longest modules first: tests/conftest.py), measured faster on 2 cores than one process
# (docs/reproduce.md). With arguments: one process, unless they say otherwise (-n 2).
if [ $# = 0 ]; then set -- -n "${PYTEST_WORKERS:-2}" --dist loadfile; fi
exec python -m pytest "$@"
