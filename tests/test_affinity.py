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

from conftest import tiny_run_config
from periodic_async.config import ConfigError, RunConfig, load_config, parse_cores
from periodic_async.parallel import affinity

CORES = affinity.available_cores()
needs_two = pytest.mark.skipif(not affinity.SUPPORTED or len(CORES) < 2, reason="needs CPU affinity and 2 cores")


def affinity_reward(prompts, completions, **kwargs):
    """Records the cores of the thread that scores (the producer's, reward.timeout_s=0) once."""
    path = Path(os.environ["PA_TEST_AFFINITY_FILE"])
    if not path.exists():
        path.write_text(json.dumps(sorted(os.sched_getaffinity(0))))
    return [0.0] * len(completions)


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
def test_pinned_moves_every_thread_and_restores_them():
    """Python's threads (one started before, one after) run on the trainer's core inside the
    block, a thread a library named (as Ray names its I/O threads) on the producer's; widen()
    gives all of them both; on exit each is back where it was."""
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
            pinned.widen()
            assert sorted(os.sched_getaffinity(side.native_id)) == sorted({CORES[0], CORES[1]})
            pinned.narrow()
            assert sorted(os.sched_getaffinity(0)) == [CORES[1]]
        assert allowed(threading.get_native_id()) == allowed(side.native_id) == allowed(io.native_id) == before
    finally:
        stop.set()
        side.join(), io.join()


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


@needs_two
def test_run_pins_engine_worker_trainer_and_producer(ray_session, tmp_path, tokenizer_dir, monkeypatch):
    """A periodic-async run, one engine worker: the worker process is on the first core (its
    /proc status), the trainer's thread on the second during the run and back after it, the reward
    (in the producer's thread) off the trainer's core; run_info.json says so."""
    record = tmp_path / "producer_cores.json"
    monkeypatch.setenv("PA_TEST_AFFINITY_FILE", str(record))
    before = sorted(os.sched_getaffinity(0))
    cfg = tiny_run_config(tmp_path / "run", tokenizer_dir, **{
        "engine.num_workers": 1, "trainer.iterations": 1, "model.dtype": "float32",
        "reward.functions": f"{Path(__file__).resolve()}:affinity_reward"})
    from periodic_async.pipeline import build_engine, run

    with build_engine(cfg) as engine:
        run(cfg, engine=engine)
        status = Path(f"/proc/{engine.pids[0]}/status").read_text()
        worker = next(ln.split(":")[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())["cpu_affinity"]
    assert info["engines"] == [[CORES[0]]] and info["engines_actual"] == [[CORES[0]]]
    assert info["trainer"] == info["trainer_actual"] == [CORES[1]]
    assert worker == str(CORES[0])
    assert CORES[1] not in json.loads(record.read_text())  # the producer's thread never shared the trainer's core
    assert sorted(os.sched_getaffinity(0)) == before  # the run gave its cores back
