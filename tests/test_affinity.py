"""Cores per process (parallel/affinity.py): the 'auto' rule, the one-line refusal of a core that
is not there, and a real run whose engine worker, trainer and producer thread each run on the
cores the plan gives them (read back from the OS: /proc/<pid>/status and sched_getaffinity of
the thread the reward runs in), reported in run_info.json."""

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from helpers import tiny_run_config
from periodic_async.config import ConfigError, RunConfig, load_config, parse_cores
from periodic_async.parallel import affinity

CORES = affinity.available_cores()
needs_two = pytest.mark.skipif(not affinity.SUPPORTED or len(CORES) < 2, reason="needs CPU affinity and 2 cores")


def _cfg(**overrides):
    settings = {"pipeline.mode": "periodic-async", "engine.backend": "ray", "engine.num_workers": 1,
                "engine.threads_per_worker": 1, "trainer.threads": 1, "model.device": "cpu"}
    settings.update(overrides)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in settings.items()])


def test_parse_cores_forms_and_errors():
    assert parse_cores("auto", "x") is None and parse_cores("off", "x") is None
    assert parse_cores("1", "x") == [1] and parse_cores("0-3", "x") == [0, 1, 2, 3]
    assert parse_cores("2,0", "x") == [0, 2] and parse_cores("[0, 2]", "x") == [0, 2]
    for bad in ("a", "3-1", "-1", "1,,2"):
        with pytest.raises(ConfigError, match=r"^trainer.cpu_affinity=.*expected auto, off or cores"):
            parse_cores(bad, "trainer.cpu_affinity")
    with pytest.raises(ConfigError, match="engine.cpu_affinity='x'"):
        _cfg(**{"engine.cpu_affinity": "x"})


@needs_two
def test_auto_separates_engine_trainer_and_producer_where_cores_allow():
    p = affinity.plan(_cfg())
    assert p.engines == [[CORES[0]]] and p.trainer == [CORES[1]]
    assert p.producer == [c for c in CORES if c != CORES[1]]  # the producer is off the trainer's core
    # sync-colocated: the workers are pinned one per core, the trainer takes turns on all of them
    colocated = affinity.plan(_cfg(**{"pipeline.mode": "sync-colocated", "engine.num_workers": 2}))
    assert colocated.engines == [[CORES[0]], [CORES[1]]] and colocated.trainer is None
    # a cluster (workers elsewhere), an in-process engine, 'off', too few cores: left to the OS
    assert affinity.plan(_cfg(**{"engine.ray_address": "10.0.0.1:6379"})) == affinity.Plan()
    # a Ray instance of this machine joined at its loopback address (the smoke run's): as a local start
    assert affinity.plan(_cfg(**{"engine.ray_address": "127.0.0.1:6379"})) == p
    assert affinity.plan(_cfg(**{"engine.backend": "local"})) == affinity.Plan()
    assert affinity.plan(_cfg(**{"engine.cpu_affinity": "off"})).trainer is None
    assert affinity.plan(_cfg(**{"engine.num_workers": len(CORES) + 1})) == affinity.Plan()
    assert affinity.plan(_cfg(**{"engine.num_workers": len(CORES)})).trainer is None  # no core left for it
    # explicit cores win; a core that is not there is one line naming the setting and the cores there are
    assert affinity.plan(_cfg(**{"trainer.cpu_affinity": str(CORES[0]), "engine.cpu_affinity": str(CORES[1])})) \
        == affinity.Plan([CORES[0]], [c for c in CORES if c != CORES[0]], [[CORES[1]]])
    missing = max(CORES) + 1000
    for key in ("trainer.cpu_affinity", "engine.cpu_affinity"):
        with pytest.raises(ConfigError, match=rf"^{key}='{missing}': core {missing} does not exist .*available: "):
            affinity.plan(_cfg(**{key: missing}))
    with pytest.raises(ConfigError, match=r"1 core\(s\) for 2 thread\(s\)"):
        affinity.plan(_cfg(**{"trainer.cpu_affinity": str(CORES[0]), "trainer.threads": 2}))


@needs_two
def test_explicit_engine_cores_cover_every_worker_or_are_refused():
    """An explicit engine.cpu_affinity gives every worker the run may start (num_workers_schedule's
    largest count too) its own slice; a list too short for them is one line, never a worker
    pinned beside another left to the OS."""
    two = affinity.plan(_cfg(**{"engine.cpu_affinity": f"{CORES[0]},{CORES[1]}", "engine.num_workers": 2}))
    assert two.engines == [[CORES[0]], [CORES[1]]]
    for short in ({"engine.num_workers": 2}, {"engine.num_workers_schedule": "{1: 2}"},
                  {"engine.threads_per_worker": 2}):
        with pytest.raises(ConfigError, match=rf"^engine.cpu_affinity='{CORES[0]}': 1 core\(s\) for 2 engine worker "
                                              r"thread\(s\) \(\d worker\(s\) x engine.threads_per_worker=\d"):
            affinity.plan(_cfg(**{"engine.cpu_affinity": CORES[0], **short}))


@needs_two
def test_pinned_moves_every_thread_and_restores_them():
    """Python's threads (one started before, one after) run on the trainer's core inside the
    block, a thread a library named (as Ray names its I/O threads) on the producer's; widen()
    gives the trainer's threads both cores and leaves the library's thread on the producer's,
    narrow() undoes it; on exit each is back where it was."""
    def allowed(tid):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        return next(line.split(":")[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))

    before = allowed(threading.get_native_id())
    stop = threading.Event()
    side, io = threading.Thread(target=stop.wait), threading.Thread(target=stop.wait)
    side.start(), io.start()
    Path(f"/proc/self/task/{io.native_id}/comm").write_text("worker.io")
    try:
        with affinity.Pinned(affinity.Plan([CORES[1]], [CORES[0]], [[CORES[0]]])) as pinned:
            assert allowed(threading.get_native_id()) == allowed(side.native_id) == str(CORES[1])
            assert allowed(io.native_id) == str(CORES[0])
            late = threading.Thread(target=lambda: None)
            late.start(), late.join()
            assert sorted(os.sched_getaffinity(0)) == [CORES[1]]
            pinned.widen()  # the trainer's threads take the producer's cores too; the library's stays
            assert allowed(io.native_id) == str(CORES[0])
            assert sorted(os.sched_getaffinity(side.native_id)) == sorted(os.sched_getaffinity(0)) == sorted(CORES[:2])
            assert pinned.held == sorted(CORES[:2])
            pinned.narrow()
            assert sorted(os.sched_getaffinity(0)) == sorted(os.sched_getaffinity(side.native_id)) == [CORES[1]]
            assert allowed(io.native_id) == str(CORES[0])
        assert allowed(threading.get_native_id()) == allowed(side.native_id) == allowed(io.native_id) == before
    finally:
        stop.set()
        side.join(), io.join()


@needs_two
def test_threads_started_on_cores_never_run_on_the_callers():
    """A thread started inside `starting_on(cores)` (the producer's, by the pinned trainer) is on
    those cores from its first instruction; the caller is back on its own after the block."""
    seen = []
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [CORES[1]])  # the trainer's thread
    try:
        with affinity.starting_on([CORES[0]]):
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
        t.join()
        assert seen == [{CORES[0]}] and os.sched_getaffinity(0) == {CORES[1]}
    finally:
        os.sched_setaffinity(0, before)


def test_cli_refuses_a_core_that_does_not_exist_in_one_line(tmp_path, capsys):
    from periodic_async.__main__ import main

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["train", f"trainer.output_dir={tmp_path}", "model.name_or_path=qwen2-micro",
                  f"trainer.cpu_affinity={max(CORES) + 1000}"])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_.value.code == 2
    assert len(lines) == 1 and lines[0].startswith(f"train: config error: trainer.cpu_affinity='{max(CORES) + 1000}'")


WORKER_FUNCTIONS = """
import json, os
from pathlib import Path

def _record(kind):  # this process's cores, once per worker process
    path = Path({out!r}) / f"{{kind}}-{{os.getpid()}}.json"
    if not path.exists():
        status = Path("/proc/self/status").read_text().splitlines()
        listed = next(ln.split(":")[1].strip() for ln in status if ln.startswith("Cpus_allowed_list"))
        path.write_text(json.dumps({{"cores": sorted(os.sched_getaffinity(0)), "listed": listed}}))

def reward(prompts, completions, **kwargs):
    _record("reward")
    return [len(set(c)) / 10.0 for c in completions]

def accuracy(prompts, completions, **kwargs):
    _record("accuracy")
    return [0.0] * len(completions)
"""


@needs_two
def test_run_pins_engine_worker_trainer_and_producer(ray_session, tmp_path, tokenizer_dir):
    """A periodic-async run, one engine worker, everything 'auto': the worker process is on the
    first core (its /proc status), the trainer's thread on the second during the run and back
    after it; the producer's thread (sampled from the OS all through the run) and the reward and
    accuracy worker processes (user functions, reward.timeout_s > 0: processes of their own, which
    record their cores) never on the trainer's core; once each iteration's generation has ended
    the trainer raised its threads (threads_after_generation='auto' under pinning);
    run_info.json says so."""
    records = tmp_path / "records"
    records.mkdir()
    functions = tmp_path / "worker_functions.py"
    functions.write_text(WORKER_FUNCTIONS.format(out=str(records)))
    before = sorted(os.sched_getaffinity(0))
    cfg = tiny_run_config(tmp_path / "run", tokenizer_dir, **{
        "engine.num_workers": 1, "trainer.iterations": 1, "model.dtype": "float32",
        "trainer.threads_after_generation": "auto", "reward.timeout_s": 60,
        "reward.functions": f"{functions}:reward", "reward.accuracy_function": f"{functions}:accuracy"})
    from periodic_async.pipeline import build_engine, run

    producer_cores, done = set(), threading.Event()

    def watch():  # the cores of every producer thread, read from the OS while the run goes on
        while not done.is_set():
            for t in threading.enumerate():
                if t.name.startswith("producer-") and t.native_id is not None:
                    try:
                        producer_cores.add(frozenset(os.sched_getaffinity(t.native_id)))
                    except (ProcessLookupError, OSError):
                        pass
            done.wait(0.001)

    watcher = threading.Thread(target=watch, name="watch-producer")
    with build_engine(cfg) as engine:
        watcher.start()
        try:
            run(cfg, engine=engine)
        finally:
            done.set()
            watcher.join()
        status = Path(f"/proc/{engine.workers[0].pid}/status").read_text()
        worker = next(ln.split(":")[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())["cpu_affinity"]
    assert info["engines"] == [[CORES[0]]] and info["engines_actual"] == [[CORES[0]]]
    assert info["trainer"] == info["trainer_actual"] == [CORES[1]]
    assert worker == str(CORES[0])
    assert producer_cores and all(CORES[1] not in cores for cores in producer_cores), producer_cores
    recorded = {p.name: json.loads(p.read_text()) for p in records.iterdir()}
    assert {name.split("-")[0] for name in recorded} == {"reward", "accuracy"}, recorded
    assert all(int(name.split("-")[1].removesuffix(".json")) != os.getpid() for name in recorded)  # processes
    on_trainer = {name: r for name, r in recorded.items()
                  if CORES[1] in r["cores"] or CORES[1] in parse_cores(r["listed"], "listed")}
    assert not on_trainer, on_trainer  # no reward or accuracy worker on the trainer's core
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and "time/threads_raised_s" in metrics[0], metrics
    assert sorted(os.sched_getaffinity(0)) == before  # the run gave its cores back
