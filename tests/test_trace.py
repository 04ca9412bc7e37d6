"""Timeline events round-trip through trace.jsonl, and W&B offline runs carry the experiment's
group and its CSV and figure files (wandb 0.31 offline: the run is a binary .wandb log whose
records hold the group, job type and artifact manifest as plain strings)."""

import json
import time
from pathlib import Path

import pytest

from periodic_async.config import RunConfig, load_config
from periodic_async.trace import MetricsLogger, Tracer, log_experiment, read_jsonl


def test_tracer_writes_sorted_jsonl_and_chrome_trace(tmp_path):
    tracer = Tracer()
    tracer.add("micro_step", "trainer", 2.0, 2.5, group=1)
    tracer.add("generate", "worker0/slot00", 1.0, 3.0, prompt=4)
    jsonl, chrome = tracer.write(tmp_path)
    events = read_jsonl(jsonl)
    assert [e["name"] for e in events] == ["generate", "micro_step"]  # sorted by start
    assert events[0] == {"name": "generate", "track": "worker0/slot00", "start": 1.0, "dur": 2.0, "args": {"prompt": 4}}
    spans = [e for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in spans] == [(0.0, 2e6), (1e6, 0.5e6)]  # microseconds from the first



def test_tracer_streams_spans_to_disk(tmp_path):
    """With a path every span is on disk as soon as it is added and none is kept in memory (a
    long run's trace does not grow the trainer); write() exports the Chrome trace from the file,
    and spans added after it (a resumed run) are appended."""
    path = tmp_path / "run" / "trace.jsonl"
    tracer = Tracer(path=path)
    tracer.add("micro_step", "trainer", 2.0, 2.5, group=1)
    tracer.add("generate", "worker0/slot00", 1.0, 3.0, prompt=4)
    assert [e["name"] for e in read_jsonl(path)] == ["micro_step", "generate"]  # on disk, recording order
    assert tracer.events == []
    jsonl, chrome = tracer.write(tmp_path / "run")
    assert jsonl == path
    trace = json.loads(chrome.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"trainer", "worker0/slot00"}
    assert sorted((e["ts"], e["dur"]) for e in trace if e["ph"] == "X") == [(0.0, 2e6), (1e6, 0.5e6)]
    tracer.add("weight_sync", "trainer", 4.0, 4.5, version=1)
    tracer.write(tmp_path / "run")
    assert [e["name"] for e in read_jsonl(path)] == ["micro_step", "generate", "weight_sync"]
    assert len([e for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "X"]) == 3

def _wandb_log(run_dir: Path, needle: bytes) -> bytes:
    """The run's log once it holds `needle` (the wandb service may still be writing it)."""
    (log,) = run_dir.glob("*.wandb")
    deadline = time.time() + 120  # a busy machine delays the service, never this long
    while needle not in log.read_bytes() and time.time() < deadline:
        time.sleep(0.2)
    return log.read_bytes()


@pytest.fixture
def wandb_dirs(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    return tmp_path


def test_log_experiment_writes_group_csv_and_figure(wandb_dirs):
    csv_path = wandb_dirs / "equivalence.csv"
    csv_path.write_text("iteration,max_abs_weight_diff\n1,0.0\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = wandb_dirs / "equivalence.png"
    plt.figure(figsize=(1, 1))
    plt.savefig(png)
    plt.close("all")
    run_dir = log_experiment("equivalence", [csv_path, wandb_dirs / "missing.csv"], [png])
    assert run_dir.is_relative_to(wandb_dirs / "wandb_dir")
    log = _wandb_log(run_dir, b"equivalence.png")
    for needle in (b"equivalence-summary", b"summary", b"equivalence.csv", b"equivalence.png"):
        assert needle in log, needle
    assert b"missing.csv" not in log
    assert list((run_dir / "files" / "media" / "table").rglob("*.table.json")), "the CSV is logged as a table"


def test_metrics_logger_groups_by_config_then_environment(wandb_dirs, monkeypatch):
    cfg = load_config(RunConfig, None, ["logging.wandb_group=fig1_timeline", "pipeline.mode=sync-separated"])
    logger = MetricsLogger(wandb_dirs / "a", cfg, name="a")
    logger.log({"reward/mean": 0.5}, step=1)
    logger.close()
    log = _wandb_log(next((wandb_dirs / "a" / "wandb").glob("offline-run-*")), b"sync-separated")
    assert b"fig1_timeline" in log and b"sync-separated" in log
    assert read_jsonl(wandb_dirs / "a" / "metrics.jsonl")[0]["reward/mean"] == 0.5

    monkeypatch.setenv("WANDB_RUN_GROUP", "from_env_group")
    logger = MetricsLogger(wandb_dirs / "b", load_config(RunConfig, None, []), name="b")
    logger.close()
    run_b = next((wandb_dirs / "b" / "wandb").glob("offline-run-*"))
    assert b"from_env_group" in _wandb_log(run_b, b"from_env_group")
