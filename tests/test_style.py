"""Style guard: `ruff check` over src, experiments, tests, scripts and examples with the rules of
pyproject.toml's [tool.ruff] (lines at most 120 characters; no unused imports, redefined names or
unused local variables), so that CI checks it through the default test run."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    pytest.importorskip("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "experiments", "tests", "scripts", "examples"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check failed:\n{r.stdout}{r.stderr}"
