"""Notebooks that cannot rot: every notebook executes headless (nbclient) against the committed
results/, and every committed figure is written by some notebook.

The notebooks run in a scratch copy of the repository's layout: notebooks/ copied, results/
and src/ linked (notebooks only read them), figures/ empty. A notebook that writes `figures/x.png` (relative
to the repository root) writes it there, never over the committed figure; the figures found
there afterwards are the ones the notebooks can redraw."""

import re
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Execute every notebook once in the scratch layout; returns (scratch root, {name: error}).

    One kernel runs them one after another (a kernel's start and its imports cost seconds each),
    back in notebooks/, its figures closed and its namespace wiped (`%reset -f`) before each
    notebook: a notebook that leans on a name another one defined fails as it would alone."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.manager import AsyncKernelManager  # nbclient's own kind
    from nbclient.util import run_sync

    scratch = tmp_path_factory.mktemp("repo")
    for name in ("results", "src"):
        (scratch / name).symlink_to(ROOT / name)
    (scratch / "figures").mkdir()
    shutil.copytree(ROOT / "notebooks", scratch / "notebooks")
    errors, seconds = {}, {}
    km = AsyncKernelManager(kernel_name="python3")
    run_sync(km.start_kernel)(cwd=str(scratch / "notebooks"))
    try:
        for path in sorted((scratch / "notebooks").glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            nb.cells.insert(0, nbformat.v4.new_code_cell(  # as a fresh kernel: in notebooks/, nothing defined
                f"import os, matplotlib.pyplot\nos.chdir({str(path.parent)!r})\nmatplotlib.pyplot.close('all')\n"
                "%reset -f"))
            t0 = time.time()
            try:
                nbclient.NotebookClient(nb, km=km, timeout=120).execute()
            except Exception as e:  # noqa: BLE001 - report every notebook, not only the first failure
                plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the kernel's traceback, without colours
                errors[path.name] = f"{type(e).__name__}: {plain[-1500:]}"
            seconds[path.name] = round(time.time() - t0, 1)
    finally:
        run_sync(km.shutdown_kernel)(now=True)
    print(f"notebook seconds: {seconds}")
    return scratch, errors


def test_notebooks_execute(executed):
    """Each notebook in notebooks/ runs top to bottom on the committed results/."""
    assert NOTEBOOKS, "no notebooks found"
    _, errors = executed
    assert not errors, "\n\n".join(f"{name}:\n{err}" for name, err in errors.items())


def test_every_figure_has_a_notebook_that_writes_it(executed):
    scratch, _ = executed
    committed = {str(p.relative_to(ROOT / "figures")) for p in (ROOT / "figures").rglob("*.png")}
    redrawn = {str(p.relative_to(scratch / "figures")) for p in (scratch / "figures").rglob("*.png")}
    assert committed <= redrawn, f"figures no notebook redraws: {sorted(committed - redrawn)}"


def test_notebooks_are_committed_without_outputs():
    """Outputs in a committed notebook go stale; the figures are the outputs."""
    import json

    stale = [p.name for p in NOTEBOOKS if any(c.get("outputs") for c in json.loads(p.read_text())["cells"])]
    assert not stale, f"clear the outputs of {stale}"


def test_notebooks_import_only_declared_dependencies():
    """Every top-level module a notebook imports is the package itself (never an experiment
    script), the standard library, or a declared dependency (pyproject.toml: dependencies + dev extra)."""
    import json
    import sys

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["dev"]
    names = {re.split(r"[<>=!~ \[;]", d)[0].lower().replace("-", "_") for d in declared}
    provided = names | {"ipython"} if "ipykernel" in names else names  # ipykernel brings IPython
    local = {"periodic_async"}
    for nb in NOTEBOOKS:
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        for mod in re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, flags=re.M):
            ok = mod in sys.stdlib_module_names or mod in local or mod.lower() in provided
            assert ok, f"{nb.name} imports {mod}, which pyproject.toml does not declare"
