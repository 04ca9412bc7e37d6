"""Timeline events and metrics: the evidence of every speed claim.

- `Tracer` records spans (name, track, start, duration, args) from any thread: per request
  (worker, slot, admitted, finished), per micro-step, optimizer step, weight sync. Given a
  path (pipeline runs) it streams them to `trace.jsonl` as they happen, so a long run holds
  none in memory, and exports a Chrome trace (`trace.chrome.json`, open in chrome://tracing
  or Perfetto). `plots.plot_timeline` draws the paper's Figure 1 from these files.
- `MetricsLogger` writes one JSON line per logged step to `metrics.jsonl` and mirrors it to
  Weights & Biases (offline by default; `logging.wandb_mode=online` to sync), one W&B run
  per pipeline run, grouped by experiment (`logging.wandb_group` or `WANDB_RUN_GROUP`).
- `log_experiment` adds the experiment's own W&B run (job_type "summary", same group) with
  its CSVs (as tables and files) and figures as one artifact.
Times are `time.time()` seconds, comparable across processes of one machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class Tracer:
    """Thread-safe span recorder. `enabled=False` makes every call a no-op.

    With `path` (what a pipeline run uses) each span is appended to that JSON-lines file as it
    is recorded, in recording order, and flushed: a run of any length holds no span in memory,
    and a run that dies leaves its timeline on disk (a resumed run appends to it). Without
    `path` the spans stay in `events` until `write`, which then writes them sorted by start.
    `write` also exports the Chrome trace, streaming from the JSON-lines file."""

    def __init__(self, enabled: bool = True, path: str | Path | None = None) -> None:
        self.enabled = enabled
        self.path = Path(path) if path is not None else None
        self.events: list[dict[str, Any]] = []
        self._file = None
        self._lock = threading.Lock()

    def add(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        if not self.enabled:
            return
        event = {"name": name, "track": track, "start": start, "dur": end - start, "args": args}
        with self._lock:
            if self.path is None:
                self.events.append(event)
                return
            if self._file is None:  # opened on the first span: a fresh run removes the old file first
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a")
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()

    @contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Time a block; the yielded dict can receive more args inside the block."""
        t0 = time.time()
        yield args
        self.add(name, track, t0, time.time(), **args)

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """<out_dir>/trace.jsonl (the streamed file, copied if it lives elsewhere) and
        <out_dir>/trace.chrome.json. Spans added later are appended to the stream again."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        jsonl = out / "trace.jsonl"
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self.path is None:
                events = sorted(self.events, key=lambda e: e["start"])
                jsonl.write_text("".join(json.dumps(e) + "\n" for e in events))
            elif not self.path.exists():
                jsonl.touch()
            elif self.path.resolve() != jsonl.resolve():
                shutil.copyfile(self.path, jsonl)
        chrome_path = out / "trace.chrome.json"
        _write_chrome(jsonl, chrome_path)
        return jsonl, chrome_path


def _write_chrome(jsonl: Path, chrome_path: Path) -> None:
    """The Chrome trace of a trace.jsonl, in two streaming passes (tracks and start, then spans):
    memory independent of the run's length."""
    t_min, tracks = None, set()
    with jsonl.open() as f:
        for line in f:
            if line.strip():
                e = json.loads(line)
                t_min = e["start"] if t_min is None else min(t_min, e["start"])
                tracks.add(e["track"])
    tids = {track: i for i, track in enumerate(sorted(tracks))}
    with chrome_path.open("w") as out, jsonl.open() as f:
        out.write('{"traceEvents": [')
        first = True
        for track, t in tids.items():
            out.write(("" if first else ", ") + json.dumps({"name": "thread_name", "ph": "M", "pid": 0, "tid": t,
                                                            "args": {"name": track}}))
            first = False
        for line in f:
            if line.strip():
                e = json.loads(line)
                out.write(("" if first else ", ") + json.dumps(
                    {"name": e["name"], "ph": "X", "pid": 0, "tid": tids[e["track"]], "ts": (e["start"] - t_min) * 1e6,
                     "dur": e["dur"] * 1e6, "args": e["args"]}))
                first = False
        out.write("]}")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (trace.jsonl, metrics.jsonl, rollouts.jsonl)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@contextmanager
def _redacted_argv():
    """W&B records the command line (`sys.argv`) with each run: show it the line with every
    secret environment value replaced (a token passed as a `key=value` override, say)."""
    from periodic_async.records import redact_secrets

    argv = sys.argv
    sys.argv = redact_secrets(list(argv))
    try:
        yield
    finally:
        sys.argv = argv


class MetricsLogger:
    """JSONL metrics (always) plus W&B (unless mode='disabled' or wandb is missing).

    The W&B group is `group`, else the config's `logging.wandb_group`, else the environment's
    WANDB_RUN_GROUP (each experiments/*.sh exports its name), else none."""

    def __init__(self, out_dir: str | Path, config: Any = None, mode: str = "offline",
                 project: str = "periodic-async", name: str | None = None, group: str | None = None) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._wandb = None
        if mode != "disabled":
            try:
                import wandb
            except ImportError:
                wandb = None
            if wandb is not None:
                os.environ.setdefault("WANDB_SILENT", "true")
                from periodic_async.records import redact_secrets  # W&B saves the config: no tokens in it

                cfg = redact_secrets(dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config)
                group = group or getattr(getattr(config, "logging", None), "wandb_group", "") or \
                    os.environ.get("WANDB_RUN_GROUP") or None
                mode_name = getattr(getattr(config, "pipeline", None), "mode", None)
                with _redacted_argv():
                    self._wandb = wandb.init(project=project, name=name, mode=mode, config=cfg, group=group,
                                             job_type=mode_name, dir=str(Path(out_dir).resolve()),
                                             reinit="finish_previous")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None



def log_experiment(name: str, csv_paths: list[str | Path], figure_paths: list[str | Path] = (),
                   mode: str | None = None, project: str = "periodic-async", config: dict | None = None):
    """One W&B run of job_type "summary" in group `name`: each CSV as a table and every CSV and
    figure as files of one artifact (type "results"). The pipeline runs of the experiment log
    their per-iteration metrics in the same group. `mode` defaults to WANDB_MODE, else offline.
    Files that do not exist are skipped. Returns the run's directory, or None when disabled or
    wandb is missing."""
    import csv

    mode = mode or os.environ.get("WANDB_MODE", "offline")
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    csvs = [Path(p) for p in csv_paths if Path(p).is_file()]
    figures = [Path(p) for p in figure_paths if Path(p).is_file()]
    from periodic_async.records import redact_secrets

    with _redacted_argv():
        run = wandb.init(project=project, name=f"{name}-summary", group=name, job_type="summary", mode=mode,
                         config=redact_secrets(config or {}), reinit="finish_previous",
                         dir=os.environ.get("WANDB_DIR"))  # W&B reads its environment once per process
    try:
        artifact = wandb.Artifact(name, type="results")
        for path in csvs:
            with path.open() as f:
                rows = list(csv.reader(f))
            if rows:
                run.log({f"table/{path.stem}": wandb.Table(columns=rows[0], data=rows[1:])})
            artifact.add_file(str(path))
        for path in figures:
            run.log({f"figure/{path.stem}": wandb.Image(str(path))})
            artifact.add_file(str(path))
        run.log_artifact(artifact)
        return Path(run.dir).parent
    finally:
        run.finish()
