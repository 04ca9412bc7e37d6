"""The experiment scripts run end to end in QUICK mode and write the artifacts the README and
notebooks read (slow: about a minute each; `bash run_tests.sh -m slow`)."""

import csv
import importlib.util
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_exp_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


@pytest.mark.slow
def test_async_speedup_quick(tmp_path, tokenizer_dir):
    _script("async_speedup").main(["--quick", "--results", str(tmp_path), "--runs", str(tmp_path / "runs"),
                                   "--figures", str(tmp_path), "model.name_or_path=qwen2-1m",
                                   f"model.tokenizer={tokenizer_dir}", "logging.wandb_mode=disabled"])
    rows = {r["mode"]: r for r in _rows(tmp_path / "async_speedup.csv")}
    assert set(rows) == {"sync-separated", "periodic-async", "sync-colocated"}
    assert float(rows["sync-separated"]["speedup_vs_sync_separated"]) == 1.0
    assert 1.0 <= float(rows["periodic-async"]["bound"]) <= 2.0
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "timeline" / "periodic-async.trace.jsonl").is_file()


@pytest.mark.slow
def test_shared_async_quick(tmp_path, tokenizer_dir):
    _script("shared_async").main(["--quick", "--results", str(tmp_path), "--runs", str(tmp_path / "runs"),
                                  "model.name_or_path=qwen2-1m", f"model.tokenizer={tokenizer_dir}",
                                  "logging.wandb_mode=disabled"])
    rows = _rows(tmp_path / "shared_async.csv")
    assert [r["mode"] for r in rows] == ["sync-separated", "periodic-async"] * 2 + ["product"]
    shared_sync = next(r for r in rows if r["shared_prompt"] == "True" and r["mode"] == "sync-separated")
    assert float(shared_sync["speedup"]) > 1.0  # 4-shot prompts: packing the prompt once must pay
