"""Soak run (issue 11): a long periodic-async run with 2 Ray engine workers, one worker killed and
restarted midway, one stop and resume from the checkpoint; memory, descriptors and queue depth
sampled throughout.

    python experiments/soak.py [--iterations 200] [--stop-at 60] [--kill-at 130] [--every 5]
                               [--results results] [--runs runs/soak] [section.key=value ...]

Leg 1, its own process, trains iterations 0 .. stop_at-1 and ends (checkpoint-<stop_at>). Leg 2,
a new process, resumes from it (trainer.resume=auto) and trains to `iterations`; once it reaches
kill_at it SIGKILLs engine worker 1's process. With engine.restart_workers=1 (soak.yaml) the
engine starts a new worker at the current version and re-sends the dead one's requests
(engine/ray_engine.py); the run goes on. The script checks that it did: the run reaches the last
iteration, one restart is counted, and the resumed leg starts where leg 1 stopped.

A sampler thread in each leg follows metrics.jsonl as it is written and, every `every`
iterations, records the resident memory (RSS, /proc/<pid>/status) and open file descriptors
(/proc/<pid>/fd) of the trainer process and of each engine worker process, the most groups
found waiting on the producer queue in the iteration (pipeline/queue_depth_max), the engine's
restarts and the size of the streamed trace.jsonl: <results>/soak.csv, one row per process
per sample.

Summary (<results>/soak_summary.csv, printed): per process (each leg's trainer, each worker
process), the least-squares slope of RSS against iteration, in MiB per 100 iterations, fitted
from `warmup` iterations after the process's first sample (start-up allocations excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.records import read_csv, write_csv

HERE = Path(__file__).resolve().parent
COLUMNS = ["leg", "iteration", "time_s", "process", "pid", "rss_mib", "fds", "queue_depth_max", "worker_restarts",
           "trace_mib", "event", "git_commit", "cpu"]
SUMMARY = ["process", "leg", "pid", "first_iteration", "last_iteration", "samples_fitted", "rss_first_mib",
           "rss_last_mib", "rss_slope_mib_per_100_iterations"]


def rss_mib(pid: int) -> float:
    """Resident set size of a process (VmRSS), MiB; nan if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class Sampler(threading.Thread):
    """Follows <run>/metrics.jsonl; every `every` iterations adds one row per process to the CSV
    (rewritten with the rows so far, the earlier leg's included), and at `kill_at` SIGKILLs engine
    worker 1 (once)."""

    def __init__(self, leg: int, run_dir: Path, engine, csv_path: Path, every: int, kill_at: int | None,
                 t0: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.leg, self.run_dir, self.engine, self.csv_path = leg, run_dir, engine, csv_path
        self.every, self.kill_at, self.t0 = every, kill_at, t0
        self.rows = read_csv(csv_path)  # leg 2 adds to leg 1's rows (each keeps its own stamp)
        self.stop = threading.Event()
        self.killed_pid: int | None = None
        metrics = run_dir / "metrics.jsonl"  # leg 2 appends to leg 1's: follow only the new lines
        self._offset = metrics.stat().st_size if metrics.exists() else 0

    def _new_metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with path.open() as f:
            f.seek(self._offset)
            text = f.read()
        lines = text.split("\n")
        self._offset += len(text) - len(lines[-1])  # a partly written last line is read next time
        return [json.loads(line) for line in lines[:-1] if line.strip()]

    def sample(self, iteration: int, m: dict, event: str = "") -> None:
        trace = self.run_dir / "trace.jsonl"
        common = dict(leg=self.leg, iteration=iteration, time_s=round(time.time() - self.t0, 2),
                      queue_depth_max=m.get("pipeline/queue_depth_max", ""),
                      worker_restarts=m.get("engine/worker_restarts", ""),
                      trace_mib=round(trace.stat().st_size / 2**20, 3) if trace.exists() else 0.0, event=event)
        procs = [("trainer", os.getpid())] + [(f"worker{w.index}", w.pid) for w in list(self.engine.workers)]
        self.rows += [{**common, "process": name, "pid": pid, "rss_mib": round(rss_mib(pid), 2), "fds": open_fds(pid)}
                      for name, pid in procs]
        write_csv(self.csv_path, self.rows, COLUMNS)

    def run(self) -> None:
        while not self.stop.wait(0.05):  # a line is logged as the next iteration starts generating: kill then
            for m in self._new_metrics():
                iteration = m["step"]  # iterations completed
                event = ""
                if self.kill_at is not None and self.killed_pid is None and iteration >= self.kill_at:
                    self.killed_pid = self.engine.workers[1].pid
                    os.kill(self.killed_pid, signal.SIGKILL)
                    event = f"SIGKILL worker1 pid {self.killed_pid}"
                    print(f"[soak] iteration {iteration}: {event}", flush=True)
                if event or iteration % self.every == 0:
                    self.sample(iteration, m, event)


def run_leg(args, overrides: list[str]) -> None:
    """One leg in this process: build the engine, sample while training, close."""
    from periodic_async.config import RunConfig, load_config
    from periodic_async.engine import make_engine
    from periodic_async.pipeline import run

    leg = args.leg
    last = args.stop_at if leg == 1 else args.iterations
    extra = [f"trainer.iterations={last}", f"trainer.output_dir={args.runs}"]
    extra += ["trainer.resume=auto"] if leg == 2 else []
    cfg = load_config(RunConfig, HERE / "soak.yaml", overrides + extra)
    engine = make_engine(cfg.engine, cfg.model)
    sampler = Sampler(leg, Path(args.runs), engine, Path(args.csv), args.every,
                      args.kill_at if leg == 2 else None, args.t0)
    try:
        sampler.sample(args.stop_at if leg == 2 else 0, {}, "leg start")
        sampler.start()
        run(cfg, engine=engine)
        sampler.stop.set()
        sampler.join()
        sampler._new_metrics()
        sampler.sample(last, {"engine/worker_restarts": len(engine.restarts)}, "leg end")
        for r in engine.restarts:
            print(f"[soak] restart: worker {r['worker']} pid {r['old_pid']} -> {r['new_pid']} at version "
                  f"{r['version']}, {len(r['resent'])} requests re-sent", flush=True)
        (Path(args.runs) / f"soak_leg{leg}.json").write_text(json.dumps(
            {"restarts": engine.restarts, "killed_pid": sampler.killed_pid, "pids": [w.pid for w in engine.workers]}))
    finally:
        sampler.stop.set()
        engine.close()


def summarize(csv_path: Path, warmup: int) -> list[dict]:
    """One row per process of <results>/soak.csv: `bench.analysis.memory_growth`."""
    from periodic_async.bench.analysis import memory_growth

    return memory_growth(read_csv(csv_path), warmup)


def main() -> None:
    p = experiment_parser(__doc__, runs="runs/soak", quick=False)  # QUICK: soak.sh gives fewer iterations
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--stop-at", type=int, default=60, help="leg 1 ends here; leg 2 resumes from its checkpoint")
    p.add_argument("--kill-at", type=int, default=130, help="leg 2 SIGKILLs engine worker 1 here")
    p.add_argument("--every", type=int, default=5, help="sample every N iterations")
    p.add_argument("--warmup", type=int, default=10, help="iterations of each process left out of its fit")
    p.add_argument("--leg", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--csv", default="", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    args, overrides = p.parse_known_args()
    if not 0 < args.stop_at < args.kill_at < args.iterations:
        p.error("need 0 < --stop-at < --kill-at < --iterations")
    if args.leg:
        return run_leg(args, overrides)

    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    csv_path = results / "soak.csv"
    write_csv(csv_path, [], COLUMNS)  # the header: the legs add the rows
    shutil.rmtree(args.runs, ignore_errors=True)  # a fresh run: leg 1 starts from nothing
    t0 = time.time()
    for leg in (1, 2):  # two processes: a stopped run, then its resumption
        cmd = [sys.executable, __file__, "--leg", str(leg), "--csv", str(csv_path), "--t0", str(t0),
               "--iterations", str(args.iterations), "--stop-at", str(args.stop_at), "--kill-at", str(args.kill_at),
               "--every", str(args.every), "--runs", args.runs, *overrides]
        what = f"iterations 0..{args.stop_at}" if leg == 1 else f"resume to {args.iterations}"
        print(f"[soak] leg {leg}: {what}", flush=True)
        subprocess.run(cmd, check=True)
    report(args, csv_path, results / "soak_summary.csv", time.time() - t0)


def report(args, csv_path: Path, summary_path: Path, wall: float) -> None:
    """Check the run went through (every iteration logged once, one restart of the killed worker),
    then write and print the summary."""
    from periodic_async.trace import read_jsonl

    steps = [m["step"] for m in read_jsonl(Path(args.runs) / "metrics.jsonl")]
    leg2 = json.loads((Path(args.runs) / "soak_leg2.json").read_text())
    restarts = leg2["restarts"]
    if steps != list(range(1, args.iterations + 1)):
        raise SystemExit(f"soak: iterations logged {steps[:3]}..{steps[-3:]}, expected 1..{args.iterations}")
    if len(restarts) != 1 or restarts[0]["old_pid"] != leg2["killed_pid"]:
        raise SystemExit(f"soak: expected one restart of the killed worker, got {restarts}")
    r = restarts[0]
    summary, rows = summarize(csv_path, args.warmup), []
    for row in summary:
        new = row["pid"] == r["new_pid"]
        rows.append({**row, "iterations": args.iterations, "wall_s": round(wall),
                     "restarted": "yes" if new else ("killed" if row["pid"] == r["old_pid"] else ""),
                     "requests_resent": len(r["resent"]) if new else ""})
    write_csv(summary_path, rows, SUMMARY + ["iterations", "wall_s", "restarted", "requests_resent"])
    print(f"[soak] {args.iterations} iterations in {wall:.0f} s; resumed at {args.stop_at}; worker {r['worker']} "
          f"(pid {r['old_pid']}) SIGKILLed, restarted as pid {r['new_pid']} at version {r['version']}, "
          f"{len(r['resent'])} requests re-sent")
    print(f"{'process':10s} {'leg':>3s} {'pid':>7s} {'iterations':>11s} {'RSS first':>10s} {'last':>8s} "
          f"{'MiB/100 it':>10s}")
    for row in summary:
        span = f"{row['first_iteration']:>5d}-{row['last_iteration']:<5d}"
        print(f"{row['process']:10s} {row['leg']:>3d} {row['pid']:>7d} {span} {row['rss_first_mib']:>10.1f} "
              f"{row['rss_last_mib']:>8.1f} {str(row['rss_slope_mib_per_100_iterations']):>10s}")
    print(f"wrote {csv_path} and {summary_path}")

if __name__ == "__main__":
    main()
