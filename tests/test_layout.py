"""The package's layout: the paper's parts at the top, plumbing in subpackages, no import cycle.

Every `import periodic_async...` is counted, including those inside functions (a cycle hidden
behind a function-level import is still a cycle), and so is every string import of a package
module (`importlib.import_module("periodic_async.x")`, a 'periodic_async.x:function' spec run
by a worker process, code in a string): the graph of modules must be acyclic.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import periodic_async

PACKAGE = Path(periodic_async.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def module_imports(source: str, modules: set[str], name: str = "") -> set[str]:
    """The package modules `source` imports, by statement or by string. `from pkg import name`
    counts as importing `pkg.name` when that is a module, else `pkg`. A string in code counts when
    it is a module's name, a 'module:function' spec, or code importing a module ('from m import
    f'). Not counted: documentation (a string standing as a statement) and a class-level field
    default (a setting's value, which the user may replace: what resolves it is counted there)."""
    tree = ast.parse(source)
    skip = {id(s.value) for s in ast.walk(tree) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)}
    skip |= {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for s in c.body
             if isinstance(s, ast.AnnAssign) and s.value is not None for n in ast.walk(s.value)}
    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets += [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                        for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            targets.append(node.value.split(":")[0] if re.fullmatch(r"[\w.]+(:\w+)?", node.value) else "")
            targets += re.findall(r"(?:^|[\s;])(?:from|import)\s+([\w.]+)", node.value)
    return {t for t in targets if t in modules and t != name}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, anywhere in its body (`module_imports`)."""
    modules = _modules()
    return {name: module_imports(path.read_text(), set(modules), name) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search, three colours).
    A package's `__init__` re-exporting its own submodules is not a cycle with them."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def edges(m: str):  # a submodule importing its own package's __init__ is not counted
        return sorted(d for d in graph[m] if not m.startswith(d + "."))

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in edges(m):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_package_has_no_import_cycle():
    """No module of periodic_async imports, directly or through others, itself."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    """Negative control: the checker reports a cycle when one is there."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_string_imports_are_edges():
    """Negative control: a module imported by a string (`import_module`, a worker's
    'module:function' spec or warm-up, code run by `python -c`) is an edge; documentation and a
    setting's default value are not."""
    modules = {"p.a", "p.b", "p.c", "p.d", "p.e", "p.f"}
    source = '''"""Names p.f:g in its docstring."""
import importlib
importlib.import_module("p.a")
worker = TimedWorker(warmup=[("p.b:g", [1])])
code = f"import sys; sys.path[:] = {path!r}; from p.c import main; main()"

class Config:
    spec: str = "p.d:g"
    """As a setting: p.e:g."""
'''
    assert module_imports(source, modules) == {"p.a", "p.b", "p.c"}
    # the reward worker before its warm-ups were given by its callers: a circle through a string
    worker = 'import importlib\nimportlib.import_module("p.functions").worker_reward_fn(spec)'
    graph = {"p.functions": module_imports("from p.worker import TimedWorker", {"p.functions", "p.worker"}),
             "p.worker": module_imports(worker, {"p.functions", "p.worker"})}
    assert find_cycle(graph) == ["p.functions", "p.worker", "p.functions"]


def test_paper_parts_stand_at_the_top():
    """Where a reader of the paper looks: the method's parts are top-level modules."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert {"pipeline", "modes", "producer", "consumer", "group", "grpo", "trimodel", "shared_prompt",
            "attention", "config"} <= top
    assert {"data", "reward", "engine", "parallel", "scale", "bench"} <= {p.name for p in PACKAGE.iterdir()
                                                                          if (p / "__init__.py").is_file()}


# --- tests import the library, never an experiment script -------------------------------------

TESTS = Path(__file__).resolve().parent
EXPERIMENTS = TESTS.parent / "experiments"
LOADERS = {"spec_from_file_location", "run_path", "run_module", "exec_module", "import_module", "SourceFileLoader"}


def experiment_loads(source: str, experiments: set[str]) -> list[str]:
    """What a test file's source does to reach experiments/: `import <script>` / `from <script>
    import ...` of an experiment's name, a call of a module loader (importlib, runpy), or a
    `sys.path` change. Running a script as a user does (`subprocess.run([python, path])`) is none."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in experiments]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in experiments:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in LOADERS:
                found.append(f"{name}(...)")
            elif name in ("insert", "append") and isinstance(f, ast.Attribute) and ast.unparse(f.value) == "sys.path":
                found.append(f"sys.path.{name}(...)")
    return found


def test_no_test_loads_an_experiment_script():
    """The logic experiments and tests share lives in the package (bench/analysis.py, bench/trl.py,
    ...): tests import it like any user, and run experiments only as processes of their own."""
    experiments = {p.stem for p in EXPERIMENTS.glob("*.py")}
    assert {"fig1_timeline", "equivalence", "table2_throughput"} <= experiments
    loads = {p.name: found for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name
             and (found := experiment_loads(p.read_text(), experiments))}
    assert not loads, f"tests that load experiment files: {loads}"


def test_experiment_loads_are_found():
    """Negative control: each way of loading an experiment file is reported."""
    experiments = {"fig1_timeline"}
    assert experiment_loads("from fig1_timeline import draw", experiments) == ["from fig1_timeline import ..."]
    assert experiment_loads("import fig1_timeline as f", experiments) == ["import fig1_timeline"]
    assert experiment_loads("s = importlib.util.spec_from_file_location('x', p)", experiments) == [
        "spec_from_file_location(...)"]
    assert experiment_loads("runpy.run_path('experiments/x.py')", experiments) == ["run_path(...)"]
    assert experiment_loads("sys.path.insert(0, 'experiments')", experiments) == ["sys.path.insert(...)"]
    assert experiment_loads("subprocess.run([sys.executable, 'experiments/fig1_timeline.py'])", experiments) == []


def experiment_parsers(source: str) -> list[str]:
    """The parsers an experiment's source builds itself (`argparse.ArgumentParser(...)`)
    instead of bench/cli.py's `experiment_parser`."""
    return [ast.unparse(n.func) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "ArgumentParser"]


def test_no_experiment_loads_another():
    """One script per claim: what experiments share lives in the package (bench/), so no
    experiments/*.py imports another experiment or changes `sys.path` to reach one (running one as
    a process of its own, as a user does, is allowed), and each takes the common options
    (--quick, --repeats, --results, --runs, --figures) from bench/cli.py's one parser."""
    scripts = sorted(EXPERIMENTS.glob("*.py"))
    experiments = {p.stem for p in scripts}
    assert {"lora_push", "lora_trimodel", "lora_learning", "trimodel_cost", "reward_curves"} <= experiments
    loads = {p.name: found for p in scripts if (found := experiment_loads(p.read_text(), experiments))}
    assert not loads, f"experiments that load other experiments: {loads}"
    own = {p.name: found for p in scripts if (found := experiment_parsers(p.read_text()))}
    assert not own, f"experiments that build their own parser (bench/cli.py's experiment_parser has the options): {own}"
    assert all("experiment_parser(" in p.read_text() for p in scripts)


def test_an_experiment_loading_another_is_found():
    """Negative control: the LoRA experiment as it was (one file reaching two others through
    `sys.path`) and a hand-built parser are reported."""
    before = """import argparse, sys
def trimodel_rounds():
    sys.path.insert(0, str(HERE))
    from trimodel_cost import make_micro_batch
def learning():
    sys.path.insert(0, str(HERE))
    import reward_curves
    ap = argparse.ArgumentParser(description=__doc__)
"""
    assert sorted(experiment_loads(before, {"trimodel_cost", "reward_curves", "lora"})) == [
        "from trimodel_cost import ...", "import reward_curves", "sys.path.insert(...)", "sys.path.insert(...)"]
    assert experiment_parsers(before) == ["argparse.ArgumentParser"]
    assert experiment_parsers("ap = experiment_parser(__doc__, runs='runs/x')") == []


def test_run_all_runs_every_experiment_and_quick_reaches_each():
    """`bash run_all.sh` runs every experiments/<name>.sh, and each script reads QUICK (so
    `QUICK=1 bash run_all.sh` runs every experiment's code path at its smoke size)."""
    root = PACKAGE.parents[1]
    text = (root / "run_all.sh").read_text()

    def array(name: str) -> list[str]:
        start = text.index(f"\n{name}=(") + len(name) + 3
        return text[start:text.index(")", start)].split()

    listed, first_lane = set(array("EXPERIMENTS")), set(array("FIRST_LANE"))
    assert first_lane <= listed, f"FIRST_LANE names experiments run_all.sh does not run: {first_lane - listed}"
    # the smoke run's second lane: the rest in EXPERIMENTS' order; what loads the warm start comes after it there
    second_lane = [e for e in array("EXPERIMENTS") if e not in first_lane]
    for needs_warm_start in ("fig1_timeline", "equivalence", "reward_curves"):
        assert needs_warm_start in second_lane and second_lane.index("warm_start") < second_lane.index(needs_warm_start)
    scripts = {p.stem for p in (root / "experiments").glob("*.sh")}
    assert scripts - listed == set(), f"experiments run_all.sh does not run: {sorted(scripts - listed)}"
    assert listed - scripts == set(), f"run_all.sh names missing scripts: {sorted(listed - scripts)}"
    for name in sorted(scripts):
        assert "QUICK" in (root / "experiments" / f"{name}.sh").read_text(), f"experiments/{name}.sh ignores QUICK"
        assert f"[{name}]=" in text, f"run_all.sh has no main CSV for {name}"
