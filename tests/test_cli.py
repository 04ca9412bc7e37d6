"""The command line: a mistake in the user's input is one line on stderr and a non-zero exit,
never a traceback (unless asked for with --debug or PERIODIC_ASYNC_DEBUG=1)."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_line, run_cli, script_env

SRC = Path(__file__).resolve().parents[1] / "src"


def test_bad_data_path_is_one_line_and_debug_shows_the_traceback(tmp_path, tokenizer_dir, capsys, monkeypatch):
    """A real `python -m periodic_async` process: exit 1, nothing on stdout, one line on stderr.
    With --debug or PERIODIC_ASYNC_DEBUG=1 the error leaves main() instead (Python prints its
    traceback); those two run in this process (a process start proves nothing more there)."""
    missing = tmp_path / "missing.jsonl"
    args = ["train", f"data.source={missing}", f"model.tokenizer={tokenizer_dir}",
            f"trainer.output_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled", "logging.progress=false"]
    env = {**script_env(), "PYTHONWARNINGS": "ignore"}
    env.pop("PERIODIC_ASYNC_DEBUG", None)
    plain = subprocess.run([sys.executable, "-m", "periodic_async", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
    lines = [ln for ln in plain.stderr.splitlines() if ln.strip()]
    assert plain.returncode == 1 and plain.stdout == ""
    assert lines == [f"train: error: data.source {str(missing)!r} does not exist (--debug for the traceback)"], \
        plain.stderr
    for extra, debug_env in ((["--debug"], None), ([], "1")):
        with pytest.raises(FileNotFoundError, match="missing.jsonl"):
            run_cli(args + extra, tmp_path, capsys, monkeypatch, debug_env=debug_env)


def test_bad_config_value_exits_2_inone_line(tmp_path, capsys, monkeypatch):
    p = run_cli(["train", "--config", str(tmp_path / "nope.yaml")], tmp_path, capsys, monkeypatch)
    line = one_line(p)
    assert p.returncode == 2
    assert line.startswith("train: config error: config file") and "does not exist" in line


def test_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  iterations: 3\n   output_dir: runs/x\n")  # line 3: one space too many
    p = run_cli(["train", "--config", str(bad)], tmp_path, capsys, monkeypatch)
    line = one_line(p)
    assert p.returncode == 2 and line.startswith(f"train: config error: config file {bad}:3: YAML syntax error"), line


def test_undecodable_data_names_the_file_and_line(tmp_path, tokenizer_dir, capsys, monkeypatch):
    data = tmp_path / "problems.jsonl"
    data.write_bytes(b'{"question": "1+1?", "answer": "2"}\n{"question": "caf\xe9 2+2?", "answer": "4"}\n')  # latin-1
    p = run_cli(["train", f"data.source={data}", f"model.tokenizer={tokenizer_dir}",
              f"trainer.output_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled"], tmp_path, capsys, monkeypatch)
    line = one_line(p)
    assert p.returncode == 1 and f"{data}:2: not UTF-8 text" in line, line


def test_missing_model_path_names_the_field(tmp_path, tokenizer_dir, capsys, monkeypatch):
    p = run_cli(["train", "model.name_or_path=artifacts/no-such-model", f"model.tokenizer={tokenizer_dir}",
              f"trainer.output_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled"], tmp_path, capsys, monkeypatch)
    line = one_line(p)
    assert p.returncode == 2 and "model.name_or_path='artifacts/no-such-model' is neither a preset" in line, line
    assert str(tmp_path / "artifacts" / "no-such-model") in line  # where it looked


def test_a_group_of_one_is_refused_before_training(tmp_path, capsys, monkeypatch):
    p = run_cli(["train", "algorithm.group_size=1", f"trainer.output_dir={tmp_path / 'run'}"],
             tmp_path, capsys, monkeypatch)
    line = one_line(p)
    assert p.returncode == 2 and "algorithm.group_size=1" in line and "every advantage is 0" in line, line
    assert not (tmp_path / "run").exists()  # refused while reading the config: nothing was started


def test_tokenizer_command_builds_a_tokenizer(tmp_path, capsys, monkeypatch):
    p = run_cli(["tokenizer", str(tmp_path / "tok")], tmp_path, capsys, monkeypatch)
    assert p.returncode == 0, p.stderr
    from periodic_async.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tmp_path / "tok")
    assert f"saved tokenizer with {len(tok)} tokens" in p.stdout
    assert tok.decode(tok.encode("12 + 30 = 42")) == "12 + 30 = 42"


def test_help_lists_every_subcommand(tmp_path, capsys, monkeypatch):
    """`python -m periodic_async --help` names every subcommand the CLI dispatches: those handed to
    their own parsers (`argv[:1] == ["plan"]`, ...) and the ones of the main parser's choices, read
    from the source so that a new subcommand must appear too."""
    import re

    source = (SRC / "periodic_async" / "__main__.py").read_text()
    own = re.findall(r'argv\[:1\] == \["([\w-]+)"\]', source)
    choices = re.search(r'add_argument\("command", choices=\[(.*?)\]', source, flags=re.S).group(1)
    commands = own + re.findall(r'"([\w-]+)"', choices)
    assert {"train", "sft", "eval", "plan", "prepare-model", "tokenizer"} <= set(commands), commands
    p = run_cli(["--help"], tmp_path, capsys, monkeypatch)
    assert p.returncode == 0
    for command in commands:
        assert re.search(rf"^\s+{re.escape(command)}\s", p.stdout, flags=re.M), (command, p.stdout)
