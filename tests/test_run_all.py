"""The README's main command, `run_all.sh`, run as a user runs it: its shell, the experiment
selection (ONLY), the CSV of times it writes and its exit codes; and `scripts/setup_env.sh`, which
it sources, printing the environment it exports once (docs/usage.md lists it).

Both source scripts/setup_env.sh, which installs the package into .venv when the install stamp is
missing or older than pyproject.toml or setup_env.sh (as after a fresh clone): the tests skip then,
saying so, rather than install (run_tests.sh, which CI runs, sources it first)."""

import csv
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHEAPEST = "trimodel_cost"
"""The experiment with the shortest smoke run (run_all.sh's measured times): qwen2-1m, no Ray."""


def _installed() -> None:
    stamp = ROOT / ".venv" / ".periodic_async_installed"
    newer = [p.name for p in (ROOT / "pyproject.toml", ROOT / "scripts" / "setup_env.sh")
             if not stamp.is_file() or p.stat().st_mtime > stamp.stat().st_mtime]
    if newer:
        pytest.skip(f"sourcing scripts/setup_env.sh would install into .venv ({', '.join(newer)} newer than "
                    f"{stamp.relative_to(ROOT)}): run `bash run_tests.sh` once")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PERIODIC_ASYNC_ENV", "RAY_ADDRESS", "ONLY", "LANES")}
    env.update(extra)
    return env


def _run_all(timeout: float, **env) -> subprocess.CompletedProcess:
    """`bash run_all.sh` with `env` on top of this process's; past `timeout`, stopped as a user's
    Ctrl-C stops it (its trap stops the experiments and Ray it started), then its process group."""
    proc = subprocess.Popen(["bash", "run_all.sh"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(**env), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_run_all_runs_the_chosen_experiment_and_times_it(tmp_path):
    """`QUICK=1 ONLY=trimodel_cost bash run_all.sh` exits 0, writes the experiment's CSV into
    RESULTS_DIR and one row of times: the experiment, its seconds, this commit and this CPU (the
    same `git_commit()` and `cpu_name()` every CSV records)."""
    _installed()
    from periodic_async.records import cpu_name, git_commit

    out = _run_all(300, QUICK="1", ONLY=CHEAPEST, SHARED_RAY="0", RESULTS_DIR=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / f"{CHEAPEST}.csv").is_file()
    with open(tmp_path / "run_all_times.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["experiment"] for r in rows] == [CHEAPEST]  # ONLY: no other experiment ran
    row = rows[0]
    assert int(row["seconds"]) >= 0 and row["quick"] == "1"
    assert row["git_commit"] == git_commit() and row["cpu"] == cpu_name()
    assert f"experiments timed in {tmp_path}/run_all_times.csv: 1," in out.stdout


@pytest.mark.parametrize("only, bad", [("no_such_experiment", "no_such_experiment"), (f"{CHEAPEST},typo", "typo"),
                                       (f"{CHEAPEST},", "")])
def test_run_all_refuses_an_unknown_experiment(tmp_path, only, bad):
    """An unknown name in ONLY (a typo, an empty item) stops the run before anything runs: a
    non-zero exit and one line naming it and the known names."""
    out = _run_all(60, QUICK="1", ONLY=only, SHARED_RAY="0", RESULTS_DIR=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"run_all.sh: ONLY={only}: unknown experiment '{bad}' (known: warm_start " in out.stderr
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def _exported(script: Path) -> list[str]:
    """The variables `export NAME=...` lines of `script` set."""
    names = []
    for line in script.read_text().splitlines():
        if line.strip().startswith("export "):
            names += re.findall(r"\b([A-Z][A-Z0-9_]+)=", line)
    return names


def test_setup_env_prints_its_settings_once_and_usage_lists_them():
    """Sourcing scripts/setup_env.sh prints what it exports, once: a script it starts that sources
    it again prints nothing. Each variable it exports is printed with the value it has after
    sourcing, and docs/usage.md's Environment table lists it."""
    _installed()
    out = subprocess.run(["bash", "-c", "source scripts/setup_env.sh && bash -c 'source scripts/setup_env.sh' && env"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env(WANDB_MODE="offline"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("scripts/setup_env.sh exports") == 1
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("scripts/setup_env.sh exports"))
    printed = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        printed += line.split()
    env = dict(line.split("=", 1) for line in lines if re.match(r"[A-Za-z_]\w*=", line))  # `env`'s lines
    names = [n for n in _exported(ROOT / "scripts" / "setup_env.sh") if n != "PERIODIC_ASYNC_ENV"]
    assert {"HF_HUB_OFFLINE", "WANDB_MODE", "TOKENIZERS_PARALLELISM"} <= set(names)
    usage = (ROOT / "docs" / "usage.md").read_text().split("## Environment", 1)[1].split("\n## ", 1)[0]
    for name in names:
        assert f"{name}={env[name]}" in printed, f"{name} is not printed with its value {env[name]!r}"
        assert f"`{name}`" in usage, f"docs/usage.md's Environment table lacks {name}"


def test_experiment_outputs_do_not_make_a_commit_dirty(tmp_path):
    """run_all.sh runs experiments one after another in one tree, each rewriting tracked CSVs and
    figures: those must not stamp the next experiment's rows '-dirty'; a changed source file, or a
    YAML input under results/, must."""
    from periodic_async.records import changed_code

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    for d in ("results/sub", "figures", "src"):
        (tmp_path / d).mkdir(parents=True)
    files = ["results/a.csv", "results/sub/t.jsonl", "figures/f.png", "results/costs.yaml", "src/m.py"]
    for f in files:
        (tmp_path / f).write_text("0\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    status = lambda: git("status", "--porcelain", "--untracked-files=no")  # noqa: E731
    for f in files[:3]:
        (tmp_path / f).write_text("1\n")
    assert len(status().splitlines()) == 3 and changed_code(status()) == []
    (tmp_path / "results/costs.yaml").write_text("1\n")
    (tmp_path / "src/m.py").write_text("1\n")
    assert sorted(changed_code(status())) == ["results/costs.yaml", "src/m.py"]
