"""The project's style, checked in CI through the default test run: no line over 120 characters
and no unused import, redefined name or unused variable in src/, experiments/, tests/, scripts/
and examples/ (ruff, configured in pyproject.toml [tool.ruff]; skipped only where ruff is not
installed: it is in the dev extra)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["src", "experiments", "tests", "scripts", "examples"]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *FOLDERS],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check {' '.join(FOLDERS)} (from {ROOT}):\n{r.stdout}{r.stderr}"
