"""Engine-worker faults and elastic engines (issues 11, 12), with real Ray actors and real SIGKILLs.

- A worker process killed mid-iteration stops the run within seconds with an EngineError
  naming the worker and the requests it held (Ray reports the death on the worker's stream,
  not after `engine.timeout_s` of silence), and the last checkpoint holds the weights of the
  last completed iteration.
- With `engine.restart_workers` the dead worker is replaced at the current version and its
  unfinished requests are re-sent: the run samples exactly the tokens of an uninterrupted run
  and reaches its weights (fp64, one torch thread per worker).
- `engine.num_workers_schedule` adds a worker after iteration 1 and removes two after
  iteration 2: same tokens and weights again, and the added worker served requests.

The uninterrupted references run on the in-process engine (same dispatch, same per-sample
seeds; tests/test_pipeline.py::test_colocated_mode_samples_the_same_tokens shows the two
back-ends sample the same tokens), so no extra Ray workers start for them. The kill happens in
the producer thread, from the reward function, when the first group of iteration 1 arrives:
the other requests of the iteration are then still generating.

The three Ray tests take 30-60 s each on 2 cores (a Ray session and 2-3 worker starts); they
are in the default suite because they are the fault guarantees a long run relies on.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from periodic_async.config import RunConfig
from periodic_async.engine import EngineError, make_engine
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

from helpers import by_prompt, checkpoint_weights, max_abs_diff, read_rollouts, tiny_run_config

HERE = Path(__file__).resolve()
B = 8  # prompts per iteration: the reward's call B + 1 scores the first group of iteration 1


def killing_reward(prompts, completions, **kwargs):
    """Distinct characters / 10; at call `at` it SIGKILLs process `pid` (an engine worker) and
    notes the time. The state is a JSON file named by `_PA_KILL_STATE`: a user reward function
    may run in a worker process (reward.timeout_s > 0), which cannot set the test's variables."""
    path = os.environ.get("_PA_KILL_STATE")
    if path:
        state = json.loads(Path(path).read_text())
        state["calls"] += 1
        if state["calls"] == state["at"]:
            os.kill(state["pid"], signal.SIGKILL)
            state["killed_at"] = time.time()
        Path(path).write_text(json.dumps(state))
    return [len(set(c)) / 10.0 for c in completions]


def _cfg(out: Path, tokenizer_dir, **extra) -> RunConfig:
    """The tiny run (conftest), 4 iterations of B=8 prompts, a checkpoint after each; 12 samples of
    40 tokens per worker in 2 slots: generation outlasts the first group."""
    return tiny_run_config(out, tokenizer_dir, **{
        "reward.functions": f"{HERE}:killing_reward", "engine.max_num_seqs": 2, "engine.max_tokens": 40,
        "engine.stop": "", "algorithm.prompts_per_iteration": B, "trainer.iterations": 4, "trainer.save_every": 1,
        **extra})


def _by_prompt(out: Path) -> dict:
    return by_prompt(read_rollouts(out))


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint_weights(out / "checkpoint")


def _workers_of(out: Path, iteration: int) -> set[int]:
    """Workers whose slots generated iteration `iteration`'s samples (from the streamed trace)."""
    return {int(e["track"].split("/")[0].removeprefix("worker")) for e in read_jsonl(out / "trace.jsonl")
            if e["name"] == "generate" and e["args"]["request"].startswith(f"it{iteration}-")}


@pytest.fixture(scope="module")
def reference(tokenizer_dir, tmp_path_factory):
    """The uninterrupted run (in-process engine): its output directory."""
    cfg = _cfg(tmp_path_factory.mktemp("reference"), tokenizer_dir)
    with make_engine(cfg.engine, cfg.model, backend="local") as local:
        run(cfg, engine=local)
    return Path(cfg.trainer.output_dir)


@pytest.fixture
def kill_worker(monkeypatch, tmp_path):
    """kill_worker(pid): SIGKILL `pid` when the first group of iteration 1 is scored; returns
    the state file ('killed_at' appears once it happened)."""
    path = tmp_path / "kill_state.json"

    def arm(pid: int) -> Path:
        path.write_text(json.dumps({"calls": 0, "at": B + 1, "pid": pid}))
        monkeypatch.setenv("_PA_KILL_STATE", str(path))
        return path

    return arm


def test_worker_killed_mid_iteration(ray_session, tokenizer_dir, tmp_path, kill_worker):
    """Default (no restarts): SIGKILL of worker 1 while iteration 1 generates stops the run within
    seconds (timeout_s is 600: the death is reported, not waited out) with an EngineError naming
    worker 1 and requests of iteration 1; the checkpoint holds theta_1 exactly."""
    cfg = _cfg(tmp_path / "killed", tokenizer_dir)
    reference = _cfg(tmp_path / "reference", tokenizer_dir, **{"trainer.iterations": 1})
    with make_engine(reference.engine, reference.model, backend="local") as local:
        run(reference, engine=local)
    engine = make_engine(cfg.engine, cfg.model)
    try:
        assert cfg.engine.timeout_s == 600 and cfg.engine.restart_workers == 0
        state = kill_worker(engine.workers[1].pid)
        with pytest.raises(EngineError, match=r"worker 1 failed .*it1-.*died") as err:
            run(cfg, engine=engine)
        stopped_after = time.time() - json.loads(state.read_text())["killed_at"]
    finally:
        engine.close()
    assert err.value.worker == 1 and err.value.request_ids
    assert all(r.startswith("it1-") for r in err.value.request_ids)
    assert stopped_after < 120, f"the run stopped {stopped_after:.1f} s after the kill (timeout_s is 600)"
    assert {k[0] for k in _by_prompt(tmp_path / "killed")} == {0}  # iteration 1 never completed
    assert max_abs_diff(_weights(tmp_path / "killed"), _weights(tmp_path / "reference")) <= 1e-10


@pytest.mark.slow  # half a minute; `bash experiments/soak.sh` (QUICK too) restarts a SIGKILLed worker
def test_worker_restarted_run_continues(ray_session, reference, tokenizer_dir, tmp_path, kill_worker):
    """engine.restart_workers=1: worker 1 is SIGKILLed in iteration 1, replaced by a new process
    loaded with version 1, and its unfinished requests are re-sent; the run completes with the
    uninterrupted run's tokens, rewards, versions and (<= 1e-10) final weights. The restart is
    counted in the metrics."""
    cfg = _cfg(tmp_path / "restarted", tokenizer_dir, **{"engine.restart_workers": 1})
    engine = make_engine(cfg.engine, cfg.model)
    try:
        old_pid = engine.workers[1].pid
        state = kill_worker(old_pid)
        run(cfg, engine=engine)
        restarts, pids = engine.restarts, [w.pid for w in engine.workers]
    finally:
        engine.close()
    assert "killed_at" in json.loads(state.read_text()), "the kill must have happened"
    assert len(restarts) == 1
    (r,) = restarts
    assert (r["worker"], r["old_pid"], r["version"]) == (1, old_pid, 1)
    assert r["new_pid"] == pids[1] != old_pid
    assert r["resent"] and all(rid.startswith("it1-") for rid in r["resent"])
    assert 1 in _workers_of(tmp_path / "restarted", 2)  # the new worker served the next iteration
    assert _by_prompt(tmp_path / "restarted") == _by_prompt(reference)
    assert max_abs_diff(_weights(tmp_path / "restarted"), _weights(reference)) <= 1e-10
    metrics = read_jsonl(tmp_path / "restarted" / "metrics.jsonl")
    if "engine/worker_restarts" in metrics[-1]:
        assert metrics[-1]["engine/worker_restarts"] == 1
        assert metrics[-1]["engine/requests_resent"] == len(r["resent"])


@pytest.mark.slow  # half a minute; the default suite resizes by schedule in test_engine (manual_resize)
def test_engine_added_between_iterations(ray_session, reference, tokenizer_dir, tmp_path):
    """engine.num_workers_schedule={2: 3, 3: 1}: a third worker joins after iteration 1 (loaded
    with version 2 before any request) and serves part of iteration 2; iteration 3 runs on
    worker 0 alone. Tokens, rewards, versions and final weights are the uninterrupted run's."""
    cfg = _cfg(tmp_path / "elastic", tokenizer_dir, **{"engine.num_workers_schedule": "{2: 3, 3: 1}"})
    engine = make_engine(cfg.engine, cfg.model)
    try:
        run(cfg, engine=engine)
        workers_at_end = len(engine.workers)
    finally:
        engine.close()
    out = tmp_path / "elastic"
    assert [_workers_of(out, t) for t in range(4)] == [{0, 1}, {0, 1}, {0, 1, 2}, {0}]
    assert workers_at_end == 1
    assert _by_prompt(out) == _by_prompt(reference)
    assert max_abs_diff(_weights(out), _weights(reference)) <= 1e-10
