"""Which CPU cores each process of a run computes on: the paper's separate deployment (method
point 1) on one machine, where the engines and the trainer would otherwise share every core.

Two processes left to the OS scheduler on a small machine disturb each other: threads migrate
between cores, the producer thread (scoring, tokenizing, receiving the engines' results) runs
beside the trainer's compute thread, and an engine's forward lands on the trainer's core. With
pinning, each engine worker computes on its own cores, the trainer's compute threads on theirs,
and the producer thread on the engines' side of the machine:

    engine worker i   engine.cpu_affinity, its slice i (threads_per_worker cores each)
    trainer           trainer.cpu_affinity: the consumer's thread and its torch threads
    producer          the cores the run holds that are not the trainer's: the producer's thread
                      and the reward, accuracy and math-verify worker processes (set for every
                      worker the run starts, and every restart: reward.set_worker_cpus)

Settings (`engine.cpu_affinity`, `trainer.cpu_affinity`): 'auto' (default), 'off', or the cores
as a list ("1", "0-3", "0,2"). 'auto' pins on a CPU run whose Ray engine workers start on this
machine (engine.backend=ray, Ray started locally or joined at a loopback address): the workers
take the first num_workers x threads_per_worker of the cores this process may use (the largest
count of `num_workers_schedule`), and in the separated modes the trainer takes the next
`trainer.threads`, when there are that many; otherwise (sync-colocated, an in-process engine,
a Ray cluster of other machines, trainer ranks under torchrun, an accelerator, too few cores)
the process is left to the OS. An explicit engine list must hold a slice for every worker the
run may start (the largest count of `num_workers_schedule` x threads_per_worker cores), else it
is refused with one line; so is a core that this process may not use (ConfigError).

'auto' assumes the cores this process may use are the run's own: two runs started side by side
on one machine with the same cores (two lanes of a smoke run sharing a Ray instance, pytest-xdist
workers) plan the same cores, so each of those cores carries a process of each run. To keep
concurrent runs apart, start each with its own cores (`taskset -c 0-3 ...`: 'auto' plans within
them) or give explicit lists; 'off' leaves them all to the OS.

While the trainer has raised its threads after generation (`trainer.threads_after_generation`,
'auto': sized by the cores the run holds, `Pinned.held`) its threads run on its cores and the
producer's, which hold the engines' (idle until the barrier); at the barrier they are back on
its own. The run's report (run_info.json: `cpu_affinity`) gives the cores each process was on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from periodic_async.config import ConfigError, RunConfig, parse_cores
from periodic_async.model import resolve_device

SUPPORTED = hasattr(os, "sched_setaffinity")


def available_cores() -> list[int]:
    """The cores this process may run on (all of them where affinity is not supported)."""
    return sorted(os.sched_getaffinity(0)) if SUPPORTED else list(range(os.cpu_count() or 1))


def _checked(value: str, where: str, need: int, what: str = "thread(s)") -> list[int]:
    cores = parse_cores(value, where)
    if not SUPPORTED:
        raise ConfigError(f"{where}={value!r}: this platform cannot pin threads to cores (use auto or off)")
    have = available_cores()
    missing = [c for c in cores if c not in have]
    if missing:
        raise ConfigError(f"{where}={value!r}: core {missing[0]} does not exist or is not available to this "
                          f"process (available: {_span(have)})")
    if len(cores) < need:
        raise ConfigError(f"{where}={value!r}: {len(cores)} core(s) for {need} {what}")
    return cores


def _span(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def max_workers(engine_cfg) -> int:
    return max([engine_cfg.num_workers, *engine_cfg.num_workers_schedule.values()])


def engine_cores(engine_cfg, on_cpu: bool = True) -> list[list[int]] | None:
    """The cores of each engine worker (index i: slice i of engine.cpu_affinity, threads_per_worker
    cores each), or None where the workers are left to the OS (see the module docstring).
    `on_cpu`: the workers compute on CPU (no GPU share). An explicit list gives every worker the
    run may start (the largest count of num_workers_schedule) a slice of its own: fewer cores
    than that is a ConfigError (never a worker pinned and another left to the OS)."""
    value, per, n = engine_cfg.cpu_affinity, engine_cfg.threads_per_worker, max_workers(engine_cfg)
    if value == "off":
        return None
    if value != "auto":
        cores = _checked(value, "engine.cpu_affinity", n * per,
                         f"engine worker thread(s) ({n} worker(s) x engine.threads_per_worker={per}; "
                         "list more cores, or 'auto' or 'off')")
    elif SUPPORTED and on_cpu and engine_cfg.backend == "ray" and engine_cfg.ray_on_this_machine \
            and len(available_cores()) >= n * per:
        cores = available_cores()[: n * per]
    else:
        return None
    return [cores[i * per:(i + 1) * per] for i in range(len(cores) // per)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The cores of a run's processes on this machine (None: left to the OS)."""

    trainer: list[int] | None = None
    producer: list[int] | None = None
    engines: list[list[int]] | None = None


def plan(cfg: RunConfig, distributed: bool = False) -> Plan:
    """The run's cores (the module docstring's rule); ConfigError for a core that is not there."""
    on_cpu = resolve_device(cfg.model.device).type == "cpu"
    engines = engine_cores(cfg.engine, on_cpu and not cfg.engine.gpus_per_worker)
    value, threads = cfg.trainer.cpu_affinity, cfg.trainer.threads
    separated = cfg.pipeline.mode != "sync-colocated" and cfg.engine.backend == "ray"
    if value == "off":
        trainer = None
    elif value != "auto":
        trainer = _checked(value, "trainer.cpu_affinity", threads)
    elif engines and separated and not distributed and on_cpu:
        taken = {c for cs in engines for c in cs}
        free = [c for c in available_cores() if c not in taken]
        trainer = free[:threads] if len(free) >= threads else None
    else:
        trainer = None
    producer = None
    if trainer is not None:
        producer = [c for c in available_cores() if c not in trainer] or None
    return Plan(trainer, producer, engines)


def pin_thread(cores: list[int] | None) -> None:
    """Pin the calling thread (threads it starts later inherit the cores)."""
    if cores and SUPPORTED:
        os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def starting_on(cores: list[int] | None):
    """Threads the calling thread starts inside the block start on `cores` (a new thread takes
    its creator's cores), so they never run a moment on the caller's; the caller is back on its
    own cores after the block. None: nothing changes."""
    if not cores or not SUPPORTED:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def pin_process(cores: list[int] | None) -> None:
    """Pin every thread of this process (Linux: each task under /proc/self/task)."""
    if not cores or not SUPPORTED:
        return
    for tid in _tasks():
        _set(tid, cores)


def _tasks() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        return [0]


def _set(tid: int, cores: list[int]) -> None:
    try:
        os.sched_setaffinity(tid, cores)
    except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
        pass


def _comm(tid: int | str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


class Pinned:
    """The trainer's process on `plan.trainer` from `__enter__` to `__exit__` (then back to the
    cores it had). On entry, threads named like the process (Python's, and the OpenMP threads of
    torch) take the trainer's cores; threads a library named (Ray's gRPC and I/O threads, which
    receive the engines' results) take the producer's. `widen()` gives the trainer's threads
    (those on exactly the trainer's cores) the producer's cores too: the engines', idle after
    generation; `narrow()` puts the threads on exactly those widened cores (the trainer's, and
    the OpenMP threads started meanwhile) back on the trainer's. Threads on other cores (the
    producer's thread, Ray's) are never moved by either."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.before: list[int] | None = None

    @property
    def held(self) -> list[int] | None:
        """The cores of this process's side of the run: the trainer's and the producer's (the
        cores the process could use when planned), which the trainer holds once widened;
        None where the trainer is left to the OS."""
        if not self.plan.trainer:
            return None
        return sorted(set(self.plan.trainer) | set(self.plan.producer or []))

    def __enter__(self) -> "Pinned":
        if self.plan.trainer:
            self.before = available_cores()
            own = Path("/proc/self/comm").read_text().strip()
            for tid in _tasks():
                _set(tid, self.plan.trainer if _comm(tid) == own else self.plan.producer or self.plan.trainer)
        return self

    def widen(self) -> None:
        if self.plan.trainer:
            self._move(self.plan.trainer, self.held)

    def narrow(self) -> None:
        if self.plan.trainer:
            self._move(self.held, self.plan.trainer)

    @staticmethod
    def _move(old: list[int], new: list[int]) -> None:
        """Every thread of this process on exactly the cores `old` to `new`."""
        if set(old) == set(new):
            return
        for tid in _tasks():
            try:
                if os.sched_getaffinity(tid) == set(old):
                    os.sched_setaffinity(tid, new)
            except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
                pass

    def __exit__(self, *exc) -> None:
        pin_process(self.before)

    def report(self, engine=None) -> dict:
        """What run_info.json records: the cores asked for (trainer, producer, engines) and those
        each process runs on now (`*_actual`; the engine's from its workers, when it reports them)."""
        info = engine.info() if engine is not None else []
        return {"trainer": self.plan.trainer, "producer": self.plan.producer, "engines": self.plan.engines,
                "trainer_actual": available_cores(),
                "engines_actual": [w.get("cpu_affinity") for w in info if isinstance(w, dict)] or None}
