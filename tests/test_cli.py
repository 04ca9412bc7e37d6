"""The command line: a mistake in the user's input is one line on stderr and a non-zero exit,
never a traceback (unless asked for with --debug or PERIODIC_ASYNC_DEBUG=1)."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def test_bad_data_path_is_one_line_and_debug_shows_the_traceback(tmp_path, tokenizer_dir):
    missing = tmp_path / "missing.jsonl"
    base = [sys.executable, "-m", "periodic_async", "train", f"data.source={missing}",
            f"model.tokenizer={tokenizer_dir}", f"trainer.output_dir={tmp_path / 'run'}",
            "logging.wandb_mode=disabled", "logging.progress=false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "ignore"}
    env.pop("PERIODIC_ASYNC_DEBUG", None)
    runs = {"plain": subprocess.Popen(base, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True),
            "debug": subprocess.Popen(base + ["--debug"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True),
            "env": subprocess.Popen(base, cwd=tmp_path, env={**env, "PERIODIC_ASYNC_DEBUG": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
    out = {k: (p.communicate(timeout=600), p.returncode) for k, p in runs.items()}
    (stdout, stderr), rc = out["plain"]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert rc == 1 and stdout == ""
    assert lines == [f"train: error: data.source {str(missing)!r} does not exist (--debug for the traceback)"], stderr
    for k in ("debug", "env"):
        (_, stderr), rc = out[k]
        assert rc != 0
        assert "Traceback (most recent call last)" in stderr and "FileNotFoundError" in stderr, stderr


def test_bad_config_value_exits_2_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "periodic_async", "train", "--config", str(tmp_path / "nope.yaml")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(SRC), "PYTHONWARNINGS": "ignore"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("train: config error: config file") and "does not exist" in lines[0]
