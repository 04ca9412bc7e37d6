"""The Python inside the shell scripts a user runs (run_all.sh, run_tests.sh, .ci/run,
scripts/*.sh, experiments/*.sh) is under test like the package: a module or function that moves
breaks the suite, not the next user's run (as `from periodic_async.config import git_commit` once
broke run_all.sh while every test passed).

What counts as embedded Python: `python -c "..."` (also python3, "$PY"), a heredoc fed to Python
(`python - ARGS <<'PY' ... PY`), `python -m MODULE` and `python path/to/script.py`. Each snippet
is compiled; every name it imports from periodic_async must resolve (the module, and each name
imported from it or read off it as `module.name`); other modules are checked where installed (the
scripts probe optional ones such as vLLM). Snippets that import only the standard library and
periodic_async and take nothing from the shell are run as well (in the repository root); the others
would install, start engines or write results, and are only resolved. `-m` modules must exist and
script paths must be files."""

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["run_all.sh", "run_tests.sh", ".ci/run", "scripts/*.sh", "experiments/*.sh"]

PY = r'(?:(?<![\w-])python3?(?![\w.])|"\$\{?PY\}?"|\$\{?PY\}?(?!\w))'
"""How the scripts call Python: python, python3, or "$PY" (scripts/gpu_check.sh)."""
DASH_C = re.compile(PY + r"""\s+-c\s+(?:"((?:[^"\\]|\\.)*)"|'([^']*)')""", re.S)
HEREDOC = re.compile(PY + r"""\s(?:[^\n<]|<(?!<))*<<-?\s*(["']?)(\w+)\1""")
DASH_M = re.compile(PY + r"\s+-m\s+([\w.]+)")
SCRIPT = re.compile(PY + r"\s+((?:[\w.-]+/)*[\w.-]+\.py)\b")
SHELL_VAR = re.compile(r"\$\{?(\w+)\}?")


@dataclass
class Snippet:
    where: str  # file:line
    kind: str  # "-c", "heredoc", "-m", "script"
    code: str  # the Python (-c, heredoc; a shell variable $X as __X__), the module (-m) or the path (script)
    from_shell: bool  # takes shell variables (expanded before Python sees it)


def find_snippets(path: Path, root: Path = ROOT) -> list[Snippet]:
    """Every piece of Python that the shell script `path` runs, with where it is."""
    text = path.read_text()
    name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

    def line(pos: int) -> str:
        return f"{name}:{text.count(chr(10), 0, pos) + 1}"

    out = []
    for m in DASH_C.finditer(text):
        if m.group(1) is not None:  # double quotes: the shell's escapes and its variables
            code = re.sub(r'\\([\\"$`])', r"\1", m.group(1))
            out.append(Snippet(line(m.start()), "-c", SHELL_VAR.sub(r"__\1__", code), bool(SHELL_VAR.search(code))))
        else:
            out.append(Snippet(line(m.start()), "-c", m.group(2), False))
    for m in HEREDOC.finditer(text):
        quoted, end = m.group(1), m.group(2)
        body_start = text.index("\n", m.end()) + 1
        lines = []
        for body_line in text[body_start:].splitlines():
            if body_line.strip() == end:
                break
            lines.append(body_line)
        else:
            raise AssertionError(f"{line(m.start())}: heredoc <<{end} is never closed")
        code, expands = "\n".join(lines) + "\n", not quoted and bool(SHELL_VAR.search("\n".join(lines)))
        out.append(Snippet(line(m.start()), "heredoc", SHELL_VAR.sub(r"__\1__", code) if expands else code, expands))
    out += [Snippet(line(m.start()), "-m", m.group(1), False) for m in DASH_M.finditer(text)]
    out += [Snippet(line(m.start()), "script", m.group(1), False) for m in SCRIPT.finditer(text)]
    return out


CHECKER = r'''
import ast, importlib, importlib.util, json, os, subprocess, sys

def spec(name):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent that is a module, not a package
        return None

def installed(name):
    return spec(name.split(".")[0]) is not None

def resolve(module, names=(), strict=False):
    """A problem (text) or None: `module` imports and has `names` (attributes or submodules)."""
    if not strict and not installed(module):
        return None  # an optional dependency the script probes for
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        return f"cannot import {module}: {type(e).__name__}: {e}"
    for n in names:
        if n != "*" and not hasattr(mod, n) and spec(f"{module}.{n}") is None:
            return f"{module} has no {n}"
    return None

def ours(name):
    return name.split(".")[0] == "periodic_async"

def check(s):
    kind, code = s["kind"], s["code"]
    if kind == "-m":
        found = installed(code) and spec(code) is not None
        return None if found or not (ours(code) or installed(code)) else f"no module {code}"
    if kind == "script":
        return None if os.path.isfile(code) else f"no script {code}"
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return f"SyntaxError: {e}"
    aliases, problems, modules = {}, [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules.add(a.name)
                if ours(a.name):
                    problems.append(resolve(a.name, strict=True))
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
                elif installed(a.name) and spec(a.name) is None:
                    problems.append(f"no module {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
            problems.append(resolve(node.module, [a.name for a in node.names], strict=ours(node.module)))
            if ours(node.module):
                for a in node.names:
                    if spec(f"{node.module}.{a.name}") is not None:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):  # module.name read off a periodic_async module
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            problems.append(resolve(aliases[node.value.id], [node.attr], strict=True))
    problems = [p for p in problems if p]
    if problems:
        return "; ".join(problems)
    pure = all(m.split(".")[0] in sys.stdlib_module_names or ours(m) for m in modules)
    if kind == "-c" and pure and not s["from_shell"]:  # side-effect free: run it
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if "Traceback" in r.stderr:
            return "raised: " + r.stderr.strip().splitlines()[-1]
        s["ran"] = True
    return None

snippets = json.load(sys.stdin)
for s in snippets:
    s["problem"] = check(s)  # sets s["ran"] when it ran
print(json.dumps(snippets))
'''


def check(snippets: list[Snippet], cwd: Path = ROOT) -> list[dict]:
    """Each snippet with `problem` (None when it resolves) and `ran` (when it was run), checked in a
    fresh interpreter in `cwd` (what the scripts import never enters the test process)."""
    r = subprocess.run([sys.executable, "-c", CHECKER], input=json.dumps([asdict(s) for s in snippets]), cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def repo_scripts() -> list[Path]:
    return sorted({p for pattern in SCRIPTS for p in ROOT.glob(pattern)})


def test_python_in_the_shell_scripts_resolves_and_runs():
    """Every snippet of Python in the scripts compiles and resolves what it imports; the side-effect
    free ones run. The finder finds those we know of (else it would pass by finding none)."""
    snippets = [s for p in repo_scripts() for s in find_snippets(p)]
    results = check(snippets)
    problems = [f"{r['where']} ({r['kind']}): {r['problem']}" for r in results if r["problem"]]
    assert not problems, "\n".join(problems)
    found = {(r["where"].split(":")[0], r["kind"]) for r in results}
    assert {("run_all.sh", "-c"), ("experiments/warm_start.sh", "heredoc"), ("scripts/setup_env.sh", "-c"),
            ("experiments/trimodel_cost.sh", "script"), ("run_tests.sh", "-m")} <= found
    ran = {r["code"] for r in results if r.get("ran")}
    assert "from periodic_async.records import git_commit; print(git_commit())" in ran


def test_a_moved_import_is_caught(tmp_path):
    """Negative control: a script whose Python names what does not exist (a function in the wrong
    module, a missing module, a missing name read off a module, a broken heredoc, a `-m` module
    or a script that is not there, Python that raises) fails, each at its line; the same lines
    fixed pass."""
    bad = tmp_path / "bad.sh"
    bad.write_text("\n".join([
        '#!/usr/bin/env bash',
        'commit=$(python -c "from periodic_async.config import git_commit; print(git_commit())")',
        '"$PY" -c "import periodic_async.no_such_module"',
        "python -c 'import periodic_async.records as r; print(r.no_such_function())'",
        'python - "$out" <<\'PY\'',
        'import sys',
        'from periodic_async.records import no_such_writer',
        'PY',
        'python -m periodic_async.no_such_cli tokenizer x',
        'python experiments/no_such_experiment.py --quick',
        'python3 -c "import sys; sys.exit(1 / 0)"',
        'python -c "print(1"',
    ]) + "\n")
    results = check(find_snippets(bad, tmp_path), cwd=ROOT)
    failed = {r["where"]: r["problem"] for r in results if r["problem"]}
    assert sorted(failed, key=lambda w: int(w.split(":")[1])) == \
        [f"bad.sh:{n}" for n in (2, 3, 4, 5, 9, 10, 11, 12)], failed
    assert "periodic_async.config has no git_commit" in failed["bad.sh:2"]
    assert "no_such_writer" in failed["bad.sh:5"] and "ZeroDivisionError" in failed["bad.sh:11"]

    good = tmp_path / "good.sh"
    good.write_text("\n".join([
        'commit=$(python -c "from periodic_async.records import git_commit; print(git_commit())")',
        "python -c 'import periodic_async.records as r; print(r.cpu_name())'",
        'python - "$out" <<\'PY\'',
        'from periodic_async.records import write_csv',
        'PY',
        'python -m periodic_async tokenizer x',
        'python experiments/trimodel_cost.py --quick',
        '"$PY" -c "import no_such_optional_package"',  # an optional dependency the script probes for
    ]) + "\n")
    results = check(find_snippets(good, tmp_path), cwd=ROOT)
    assert [r["problem"] for r in results] == [None] * 6 and sum(bool(r.get("ran")) for r in results) == 2


@pytest.mark.parametrize("line, kind", [("x=$(python3 -c 'print(1)')", "-c"), ('"$PY" -c "import sys"', "-c"),
                                        ("python - a b <<PY", "heredoc"), ('read -r -a x <<< "$Y"', None)])
def test_the_finder_tells_python_from_other_shell(tmp_path, line, kind):
    """A here-string (`<<<`) to another command is not Python; the forms of calling Python are."""
    script = tmp_path / "s.sh"
    script.write_text(line + ("\nprint(1)\nPY\n" if "<<PY" in line else "\n"))
    assert [s.kind for s in find_snippets(script, tmp_path)] == ([kind] if kind else [])
