"""One benchmark protocol for every throughput experiment (table2, async_speedup, shared_async,
engine): the compared systems run interleaved, repeated, and reported as median with min and max.

    systems = [System("sync", lambda: run(cfg_a), settings=cfg_a), System("async", ..., settings=cfg_b)]
    results = measure(systems, repeats=3, warmup_rounds=0)      # A B A B A B
    rows = [results["async"].row(["tokens_per_s"]) | {...} for ...]
    write_csv("results/x.csv", rows)                             # records.py

Rules it enforces:
- **Interleaved**: round r runs every system once, in the order given (A B C A B C ...), so a
  slow spell of a shared machine hits every system alike instead of one system's runs.
- **Repeated**: `repeats` >= 1 measured rounds (experiments use >= 3); an optional warm-up
  round runs every system first and is discarded. A system's own warm-up *inside* a run
  (the first iteration of a pipeline run, see `books.summary`) is the callable's job.
- **Median, min, max** of every numeric metric over the measured rounds (`Stats`), and
  paired ratios between two systems (round r of A over round r of B: the interleaving
  makes them the fairest comparison of a noisy machine).
- **Memory between runs**: after each run the process collects its garbage and hands freed
  heap back to the OS (`release_memory`), so that what one in-process run held is not resident
  while the next system (a TRL subprocess, say) needs the machine's memory.
- **Traceable rows**: each row carries the git commit, a 12-character hash of the system's
  resolved settings (sha256 of their sorted YAML dump) and the settings that differ between
  the compared systems (`settings` column, `key=value` separated by spaces).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import hashlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from periodic_async.lora import served_model
from periodic_async.pipeline import build_engine
from periodic_async.records import git_commit


@dataclass
class System:
    """One compared system: `run()` performs one measured run and returns its metrics
    (a flat dict; numeric values are summarised); `settings` is its resolved configuration
    (a dataclass config or a plain dict), hashed and diffed into every row."""

    name: str
    run: Callable[[], dict]
    settings: Any = None


@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("Stats of no values")
        return cls(statistics.median(values), min(values), max(values), len(values))


def settings_dict(settings: Any) -> dict:
    """A dataclass config or mapping as a plain nested dict (None -> {})."""
    if settings is None:
        return {}
    if dataclasses.is_dataclass(settings):
        return dataclasses.asdict(settings)
    return dict(settings)


def config_hash(settings: Any) -> str:
    """12 hex characters of sha256 over the sorted YAML dump: equal settings, equal hash."""
    text = yaml.safe_dump(settings_dict(settings), sort_keys=True, default_flow_style=False)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def differing_settings(settings: dict[str, Any], ignore: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per system name, the flattened settings whose value is not the same in every system
    (a key missing in one system counts as different). Keys starting with an `ignore` prefix
    (e.g. output directories) are left out."""
    flat = {name: flatten(settings_dict(s)) for name, s in settings.items()}
    keys = sorted({k for f in flat.values() for k in f if not any(k.startswith(p) for p in ignore)})
    differ = [k for k in keys if len({repr(f.get(k, "<unset>")) for f in flat.values()}) > 1]
    return {name: {k: f[k] for k in differ if k in f} for name, f in flat.items()}


def format_settings(settings: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def schedule(names: Sequence[str], repeats: int, warmup_rounds: int = 0) -> list[tuple[int, str]]:
    """The run order: (round, name) with rounds < 0 the discarded warm-up rounds."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one measured round")
    if len(set(names)) != len(names):
        raise ValueError(f"system names must be unique: {list(names)}")
    return [(r, n) for r in range(-warmup_rounds, repeats) for n in names]


@dataclass
class Result:
    """The measured runs of one system (warm-up rounds excluded), in round order."""

    name: str
    settings: Any
    runs: list[dict] = field(default_factory=list)
    differing: dict[str, Any] = field(default_factory=dict)
    git_commit: str = ""
    """The tree the runs measured (read when `measure` starts: a commit made while a long
    benchmark runs does not relabel it); empty: read when the row is written."""

    @property
    def repeats(self) -> int:
        return len(self.runs)

    @property
    def measured_iterations(self) -> int | str:
        """Iterations per run behind the rates: a pipeline run's summary counts them all and its
        rates leave the first (start-up) out; '' when the runs do not say."""
        n = self.runs[0].get("iterations") if self.runs else None
        return max(int(n) - 1, 1) if n else ""

    @property
    def config_hash(self) -> str:
        return config_hash(self.settings)

    def values(self, key: str) -> list[float]:
        return [float(r[key]) for r in self.runs]

    def stats(self, key: str) -> Stats:
        return Stats.of(self.values(key))

    def ratio(self, other: Result, key: str = "tokens_per_s") -> Stats:
        """Paired ratios self/other round by round (both measured in the same rounds)."""
        a, b = self.values(key), other.values(key)
        if len(a) != len(b):
            raise ValueError(f"{self.name} has {len(a)} runs, {other.name} {len(b)}: not paired")
        return Stats.of([x / y for x, y in zip(a, b)])

    def row(self, keys: Sequence[str], digits: int = 3) -> dict[str, Any]:
        """{key, key_min, key_max for each key} + repeats; `provenance()` adds the rest."""
        out: dict[str, Any] = {}
        for k in keys:
            s = self.stats(k)
            out[k], out[f"{k}_min"], out[f"{k}_max"] = (round(s.median, digits), round(s.min, digits),
                                                        round(s.max, digits))
        out["repeats"] = self.repeats
        return out

    def provenance(self) -> dict[str, Any]:
        """The columns every CSV row ends with: git commit, config hash, differing settings."""
        return {"git_commit": self.git_commit or git_commit(), "config_hash": self.config_hash,
                "settings": format_settings(self.differing)}


def measure(systems: Sequence[System], repeats: int = 3, warmup_rounds: int = 0,
            ignore_settings: Sequence[str] = ("trainer.output_dir",),
            log: Callable[[str], None] | None = print) -> dict[str, Result]:
    """Run `systems` interleaved (see the module docstring); returns {name: Result} in input order."""
    by_name = {s.name: s for s in systems}
    order = schedule([s.name for s in systems], repeats, warmup_rounds)
    diff = differing_settings({s.name: s.settings for s in systems}, ignore_settings)
    commit = git_commit()
    results = {s.name: Result(s.name, s.settings, differing=diff[s.name], git_commit=commit) for s in systems}
    for r, name in order:
        t = time.perf_counter()
        metrics = by_name[name].run()
        took = time.perf_counter() - t
        held, kept = release_memory()
        if log:
            tag = f"warm-up {r + warmup_rounds + 1}/{warmup_rounds}" if r < 0 else f"round {r + 1}/{repeats}"
            shown = {k: round(v, 3) for k, v in metrics.items() if isinstance(v, (int, float))}
            log(f"[bench] {tag} {name} ({took:.1f}s; resident {held:.0f} -> {kept:.0f} MiB): {shown}")
        if r >= 0:
            results[name].runs.append(metrics)
    return results


def _resident_mib() -> float:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20
    except (OSError, IndexError, ValueError):
        return float("nan")


def release_memory() -> tuple[float, float]:
    """Collect garbage and return freed heap to the OS (glibc `malloc_trim`; elsewhere just the
    collection). glibc keeps large freed blocks in its heap, so a process that ran one model's
    training stays gigabytes large after the model is gone. Returns resident MiB before and after."""
    before = _resident_mib()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return before, _resident_mib()


class SharedEngines:
    """One started engine per (engine, model) configuration, shared by the runs of a benchmark
    that use it: engine start-up (Ray actors importing torch) is no part of any measurement,
    and restarting it for every run would cost minutes. `pipeline.run` pushes its own initial
    weights to the engine, so a shared engine never leaks one run's weights into another."""

    def __init__(self):
        self.cache: dict[str, Any] = {}

    def get(self, cfg):
        key = repr((cfg.engine, served_model(cfg.model)))  # a merged-LoRA run shares the plain model's engine
        if key not in self.cache:
            self.cache[key] = build_engine(cfg)
        return self.cache[key]

    def close(self) -> None:
        for engine in self.cache.values():
            engine.close()
        self.cache.clear()
