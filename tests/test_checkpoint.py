"""Checkpoints mean what they say: a run stopped (or failed, or killed) at iteration k and resumed
from its checkpoint gives the uninterrupted run's tokens, weights (fp64) and logs, row by row; a
resume against other reference weights is refused; a checkpoint loads without
pickle; only the last k are kept; a partial one is never resumed; a non-finite gradient leaves
the last good checkpoint; after a failure on trainer ranks ddp's rank 0 saves alone and fsdp
writes nothing; a failure while starting releases the engine; and SIGTERM stops the CLI
cleanly, with a checkpoint and no process left behind. (Checkpoints written and resumed by
trainer ranks: tests/test_distributed.py.)"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from periodic_async import checkpoint
from periodic_async.config import RunConfig
from periodic_async.consumer import Consumer
from periodic_async.engine import make_engine
from periodic_async.engine.local import LocalEngine
from periodic_async.model import load_policy
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

from helpers import (DIVERSITY_REWARD, by_prompt, checkpoint_weights, diversity_reward, max_abs_diff, read_rollouts,
                     stop_shared_ray, tiny_run_config)

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


def absurd_reward(prompts, completions, **kwargs):
    """Finite rewards so large that iteration 1's advantages, loss and gradient are not (6 groups
    per iteration: calls 7-12 are iteration 1's)."""
    calls = int(os.environ.get("_PA_ABSURD_CALLS", "0")) + 1
    os.environ["_PA_ABSURD_CALLS"] = str(calls)
    if 6 < calls <= 12:
        return [1.7e308, 1.7e308] + [0.0] * (len(completions) - 2)
    return diversity_reward(prompts, completions)


def _cfg(out: Path, tokenizer_dir, **extra) -> RunConfig:
    """The tiny run (conftest) on the in-process engine, a checkpoint after every iteration, the last 2 kept."""
    return tiny_run_config(out, tokenizer_dir, **{
        "engine.backend": "local", "trainer.save_every": 1, "trainer.keep_last": 2, **extra})


def _by_prompt(cfg: RunConfig) -> dict:
    return by_prompt(read_rollouts(cfg.trainer.output_dir))


@pytest.fixture(scope="module")
def engine(tokenizer_dir, tmp_path_factory):
    """The in-process engine: lock-step workers, no Ray (fast, and deterministic)."""
    cfg = _cfg(tmp_path_factory.mktemp("e"), tokenizer_dir)
    with make_engine(cfg.engine, cfg.model, backend="local") as eng:
        yield eng


@pytest.fixture(scope="module")
def full(engine, tokenizer_dir, tmp_path_factory) -> RunConfig:
    """The uninterrupted run: 3 iterations, a checkpoint after each, the last 2 kept, every
    version evaluated on 4 held-out prompts (the last one at the end)."""
    cfg = _cfg(tmp_path_factory.mktemp("full"), tokenizer_dir, **EVAL)
    run(cfg, engine=engine)
    return cfg


EVAL = {"data.num_eval": 4, "trainer.eval_every": 1, "trainer.eval_at_end": True}


class _BarrierFailsAt(LocalEngine):
    """A real in-process engine whose weight sync fails once, at one version (fault injection)."""

    fail_at = 2

    def update_weights(self, state_dict, version):
        if version == self.fail_at:
            self.fail_at = -1
            raise ConnectionError(f"weight sync to version {version} failed")
        return super().update_weights(state_dict, version)


def _logs(out: Path) -> dict[str, list]:
    """What the logs say, row by row in file order (duplicates and gaps show): per rollouts row
    (iteration, position, prompt, tokens, rewards, version) sorted within its iteration (the
    completion order may differ), the metrics rows' steps and eval versions, eval.jsonl's rows."""
    rollouts = read_jsonl(out / "rollouts.jsonl")
    iterations = [r["iteration"] for r in rollouts]
    groups = sorted((r["iteration"], r["position"], r["prompt_index"], r["response_ids"], r["rewards"], r["version"])
                    for r in rollouts)
    metrics = [(m["step"], m.get("eval/version")) for m in read_jsonl(out / "metrics.jsonl")]
    evals = [(r["step"], r["correct"]) for r in read_jsonl(out / "eval.jsonl")]
    return {"iterations": iterations, "groups": groups, "metrics": metrics, "evals": evals}


@pytest.mark.parametrize("stop", ["stopped", "failed_barrier", "killed"])
def test_resume_matches_uninterrupted(stop, engine, full, tokenizer_dir, tmp_path):
    """Stopped after 2 iterations (trainer.iterations=2, version 2 evaluated at its end), killed
    by a failed barrier to version 2 after iteration 1's optimizer step, or killed hard after
    iteration 2's books but before its checkpoint: checkpoint-2 holds theta_2 (the label matches
    the weights: the uninterrupted run's checkpoint-2), and resume=auto continues with the
    uninterrupted run's tokens and weights (fp64). The logs are the uninterrupted run's, row by
    row: each iteration once, in order (the rows past the checkpoint are dropped on resume, a
    failed barrier keeps the books of the iteration it stepped), each version evaluated once."""
    if stop == "killed":  # the uninterrupted run's directory without its last checkpoint
        shutil.copytree(full.trainer.output_dir, tmp_path, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(tmp_path / "checkpoint-3")
    part = _cfg(tmp_path, tokenizer_dir, **EVAL, **({"trainer.iterations": 2} if stop == "stopped" else {}))
    if stop == "stopped":
        run(part, engine=engine)
    elif stop == "failed_barrier":
        flaky = _BarrierFailsAt.from_config(part.engine, part.model)
        with pytest.raises(ConnectionError, match="version 2"):
            run(part, engine=flaky)
    ckpt = checkpoint.latest(tmp_path)
    assert ckpt.name == "checkpoint-2"
    assert json.loads((ckpt / "checkpoint.json").read_text())["iteration"] == 2
    assert max_abs_diff(checkpoint_weights(ckpt),
                        checkpoint_weights(Path(full.trainer.output_dir) / "checkpoint-2")) <= 1e-10

    resumed = _cfg(tmp_path, tokenizer_dir, **EVAL, **{"trainer.resume": "auto"})
    run(resumed, engine=engine)
    got, want = _logs(tmp_path), _logs(Path(full.trainer.output_dir))
    assert got["iterations"] == [0] * 6 + [1] * 6 + [2] * 6
    assert got["groups"] == want["groups"]
    assert got["metrics"] == want["metrics"] == [(1, 0), (2, 1), (3, 2), (3, 3)]
    assert got["evals"] == want["evals"] and [v for v, _ in got["evals"]] == [0, 1, 2, 3]
    final = Path(resumed.trainer.output_dir) / checkpoint.LATEST
    assert final.resolve().name == "checkpoint-3"
    w0 = load_policy(full.model)[0].state_dict()
    assert max_abs_diff(checkpoint_weights(final), {k: w0[k] for k in checkpoint_weights(final)}) > 1e-3, \
        "training must move the weights"
    assert max_abs_diff(checkpoint_weights(final),
                        checkpoint_weights(Path(full.trainer.output_dir) / "checkpoint-3")) <= 1e-10


def test_checkpoint_loads_without_pickle(full):
    """Every file of a checkpoint loads without unpickling code: weights from safetensors, the
    rest with torch.load(weights_only=True) or as JSON; and it restores a consumer."""
    ckpt = Path(full.trainer.output_dir) / "checkpoint-3"
    files = sorted(p.name for p in ckpt.iterdir())
    assert "model.safetensors" in files and checkpoint.MARKER in files
    assert not [f for f in files if f.endswith((".bin", ".pkl", ".pickle", ".pth"))], files
    for p in ckpt.iterdir():
        if p.suffix == ".pt":
            torch.load(p, weights_only=True)
        elif p.suffix == ".json":
            json.loads(p.read_text())
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert {"optimizer", "scheduler"} <= state.keys() and state["scheduler"]["last_epoch"] == 3
    rng = torch.load(ckpt / "rng_state.pt", weights_only=True)
    assert {"torch", "python", "numpy"} <= rng.keys()
    info = json.loads((ckpt / "checkpoint.json").read_text())
    assert info["iteration"] == info["version"] == info["data_position"]["iteration"] == 3
    assert info["reference"] == {"name_or_path": "qwen2-1m", "seed": 3}
    assert info["reference_weights"] == checkpoint.reference_hash(load_policy(full.model)[0])

    policy, _ = load_policy(full.model)
    consumer = Consumer(policy, full)
    assert checkpoint.load(ckpt, policy, consumer, full) == 3 and consumer.version == 3
    assert max_abs_diff({k: v for k, v in policy.state_dict().items() if k in checkpoint_weights(ckpt)},
                        checkpoint_weights(ckpt)) == 0


def test_resume_keeps_the_original_reference(full):
    """The tri-model's ref after a resume is the original run's (the initial weights), not the
    resumed policy; a config whose model would give another ref is refused."""
    ckpt = Path(full.trainer.output_dir) / "checkpoint-3"
    initial = load_policy(full.model)[0].state_dict()
    policy, _ = load_policy(full.model)
    consumer = Consumer(policy, full)
    checkpoint.load(ckpt, policy, consumer, full)
    ref = consumer.tri.ref.state_dict()
    assert max_abs_diff(ref, initial) == 0
    assert max_abs_diff(ref, policy.state_dict()) > 1e-3
    wrong = _cfg(Path(full.trainer.output_dir), full.model.tokenizer, **{"model.name_or_path": str(ckpt)})
    policy, _ = load_policy(wrong.model)
    with pytest.raises(ValueError, match="reference"):
        checkpoint.load(ckpt, policy, Consumer(policy, wrong), wrong)


def test_truncate_logs_keeps_what_the_checkpoint_holds(tmp_path):
    """`truncate_logs(out, 2)` (a resume from checkpoint-2) keeps the rollouts of iterations 0-1,
    the metrics of steps 1-2 less an evaluation of version 2 (logged at the end of a stopped
    run), eval.jsonl's versions 0-1, drops the unfinished line a hard kill left, and leaves the
    trace whole."""
    from periodic_async.records import truncate_logs

    def write(name, rows, tail=""):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)

    write("rollouts.jsonl", [{"iteration": t, "position": p} for t in range(3) for p in range(2)], '{"iterati')
    write("metrics.jsonl", [{"step": 1, "eval/version": 0}, {"step": 2, "eval/version": 1},
                            {"step": 2, "eval/version": 2}, {"step": 3, "eval/version": 2}, {"step": 4}])
    write("eval.jsonl", [{"step": v} for v in range(4)])
    write("trace.jsonl", [{"name": "generate"}] * 3)
    truncate_logs(tmp_path, 2)
    assert [(r["iteration"], r["position"]) for r in read_jsonl(tmp_path / "rollouts.jsonl")] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "eval/version": 0}, {"step": 2, "eval/version": 1}]
    assert read_jsonl(tmp_path / "eval.jsonl") == [{"step": 0}, {"step": 1}]
    assert len(read_jsonl(tmp_path / "trace.jsonl")) == 3 and not list(tmp_path.glob("*.tmp"))


def test_resume_refuses_other_reference_weights(engine, tokenizer_dir, tmp_path):
    """The reference is checked by its weights, not its path: a run from a model directory saves
    checkpoint-1; the directory's weights are then changed in place (as GRPOTrainer rewrites
    <output_dir>/initial_model from another in-memory model); the resume is refused with one
    line naming both weight hashes, before anything is trained. (The same weights resume:
    test_resume_matches_uninterrupted.)"""
    model_dir = tmp_path / "model"
    base = _cfg(tmp_path / "run", tokenizer_dir)
    policy, tokenizer = load_policy(base.model)
    policy.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = _cfg(tmp_path / "run", tokenizer_dir, **{"model.name_or_path": str(model_dir), "trainer.iterations": 1})
    run(cfg, engine=engine)
    recorded = json.loads((tmp_path / "run" / "checkpoint-1" / "checkpoint.json").read_text())["reference_weights"]
    with torch.no_grad():
        next(policy.parameters()).add_(0.01)
    policy.save_pretrained(model_dir)
    resumed = _cfg(tmp_path / "run", tokenizer_dir, **{"model.name_or_path": str(model_dir), "trainer.iterations": 2,
                                                       "trainer.resume": "auto"})
    with pytest.raises(ValueError) as refused:
        run(resumed, engine=engine)
    message = str(refused.value)
    assert "\n" not in message and recorded in message and str(model_dir) in message, message
    now = checkpoint.reference_hash(load_policy(resumed.model)[0])
    assert now != recorded and now in message
    assert list(checkpoint.complete_checkpoints(tmp_path / "run")) == [1], "nothing may be trained"


def test_keep_last_k(full):
    """3 iterations, a checkpoint after each, keep_last=2: checkpoint-2 and -3 remain, complete,
    and the `checkpoint` link names the newest."""
    out = Path(full.trainer.output_dir)
    assert list(checkpoint.complete_checkpoints(out)) == [2, 3]
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint", "checkpoint-2", "checkpoint-3"]
    assert (out / "checkpoint").is_symlink() and (out / "checkpoint").resolve() == (out / "checkpoint-3").resolve()


def test_resume_ignores_partial_checkpoint(engine, full, tokenizer_dir, tmp_path):
    """A checkpoint-3 without its `complete` marker and a leftover checkpoint-4.tmp (even one
    holding a marker) are not resumed: resume=auto takes checkpoint-2, trains iteration 2 and
    ends on the uninterrupted run's weights; the next save removes the partial ones."""
    src = Path(full.trainer.output_dir)
    shutil.copytree(src / "checkpoint-2", tmp_path / "checkpoint-2")
    shutil.copytree(src / "checkpoint-3", tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / checkpoint.MARKER).unlink()
    shutil.copytree(src / "checkpoint-3", tmp_path / "checkpoint-4.tmp")
    assert checkpoint.latest(tmp_path).name == "checkpoint-2"
    resumed = _cfg(tmp_path, tokenizer_dir, **{"trainer.resume": "auto"})
    run(resumed, engine=engine)
    assert {k[0] for k in _by_prompt(resumed)} == {2}
    assert max_abs_diff(checkpoint_weights(tmp_path / "checkpoint-3"),
                        checkpoint_weights(src / "checkpoint-3")) <= 1e-10
    assert list(checkpoint.complete_checkpoints(tmp_path)) == [2, 3]
    assert not (tmp_path / "checkpoint-4.tmp").exists()


def test_nonfinite_gradient_keeps_last_checkpoint(engine, tokenizer_dir, tmp_path, monkeypatch):
    """Finite but absurd rewards at iteration 1 give NaN advantages and a non-finite gradient:
    the run stops with an error naming the iteration and micro-batch, nothing is pushed to the
    engines (they keep version 1), and checkpoint-1 stays the newest, complete and loadable."""
    monkeypatch.setenv("_PA_ABSURD_CALLS", "0")
    cfg = _cfg(tmp_path, tokenizer_dir, **{"reward.functions": f"{HERE}:absurd_reward"})
    with pytest.raises(FloatingPointError,
                       match=r"iteration 1, optimizer step 0, micro-batch \d+ \(prompts \[[\d, ]+\]\): non-finite"):
        run(cfg, engine=engine)
    assert engine.version == 1
    ckpt = checkpoint.latest(tmp_path)
    assert ckpt.name == "checkpoint-1" and list(checkpoint.complete_checkpoints(tmp_path)) == [1]
    policy, _ = load_policy(cfg.model)
    consumer = Consumer(policy, cfg)
    assert checkpoint.load(ckpt, policy, consumer, cfg) == 1
    assert all(bool(torch.isfinite(p).all()) for p in policy.parameters())


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_after_failure_on_trainer_ranks(parallel, tokenizer_dir, tmp_path, capsys):
    """After a failure rank 0 saves on its own: under ddp it holds the whole state and writes it
    with no collective (here there is no process group at all); under fsdp the state is sharded
    and the other ranks may never join a gather, so nothing is written and it says so."""
    from periodic_async.parallel.distributed import Ranks

    cfg = _cfg(tmp_path, tokenizer_dir)
    policy, tokenizer = load_policy(cfg.model)
    consumer = Consumer(policy, cfg)
    consumer.ranks = Ranks(rank=0, world_size=2, parallel=parallel)  # rank 0 of 2, laid out as one process
    saves = checkpoint.Checkpoints(cfg, policy, tokenizer, consumer)
    consumer.version = 1  # one iteration completed, then the failure
    saves.after_failure()
    if parallel == "ddp":
        assert list(checkpoint.complete_checkpoints(tmp_path)) == [1]
        assert json.loads((tmp_path / "checkpoint-1" / "checkpoint.json").read_text())["trainer_ranks"] == 2
    else:
        assert checkpoint.latest(tmp_path) is None
        assert "no checkpoint after a failure" in capsys.readouterr().out


class _FailsToStart:
    """Stands for a component whose start-up fails (fault injection)."""

    def __init__(self, *args, **kwargs):
        raise OSError("failed to start")


@pytest.mark.parametrize("component", ["Producer", "MetricsLogger"])
def test_failure_while_starting_releases_the_engine(component, tokenizer_dir, tmp_path, monkeypatch):
    """The run builds and starts its engine, then the producer or the metrics logger fails to
    start: the engine is closed before the error reaches the caller."""
    import periodic_async.pipeline as pipeline

    built = []

    def build_engine(cfg):  # the real engine, kept for the assertion
        built.append(make_engine(cfg.engine, cfg.model))
        assert built[-1].workers
        return built[-1]

    monkeypatch.setattr(pipeline, "build_engine", build_engine)
    monkeypatch.setattr(pipeline, component, _FailsToStart)
    with pytest.raises(OSError, match="failed to start"):
        run(_cfg(tmp_path, tokenizer_dir))
    assert len(built) == 1 and isinstance(built[0], LocalEngine)
    assert built[0].workers == [], "the engine was not closed"


@pytest.mark.slow
def test_failure_while_starting_shuts_down_ray(tokenizer_dir, tmp_path, monkeypatch):
    """As above with Ray engines the run started: Ray is shut down too."""
    import ray

    import periodic_async.pipeline as pipeline

    monkeypatch.setattr(pipeline, "MetricsLogger", _FailsToStart)
    stop_shared_ray()  # conftest.ray_session's, if an earlier module started it
    assert not ray.is_initialized()
    with pytest.raises(OSError, match="failed to start"):
        run(_cfg(tmp_path, tokenizer_dir, **{"engine.backend": "ray", "engine.num_workers": 1}))
    assert not ray.is_initialized()


def _tree(pid: int) -> list:
    import psutil

    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


# slow with Ray (half a minute: the engine actors start and stop); the local engine is the default case
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_sigterm_leaves_no_processes(backend, tokenizer_dir, tmp_path):
    """`python -m periodic_async train` gets SIGTERM after its first iteration: it exits 143
    within 60 s, leaves a complete checkpoint of the last completed iteration, and no process
    of its tree survives (with Ray engines: Ray's gcs, raylet, agents, workers, engine actors)."""
    import psutil

    out = tmp_path / "run"
    overrides = {
        "model.tokenizer": str(tokenizer_dir), "model.name_or_path": "qwen2-micro", "data.num_train": 64,
        "data.num_eval": 0, "reward.functions": DIVERSITY_REWARD, "reward.timeout_s": 0,
        "engine.backend": backend, "engine.num_workers": 1, "engine.max_num_seqs": 6, "engine.max_tokens": 12,
        "algorithm.group_size": 2, "algorithm.prompts_per_iteration": 4, "trainer.iterations": 10000,
        "trainer.output_dir": str(out), "trainer.eval_at_end": False, "logging.wandb_mode": "disabled",
        "logging.progress": False,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    log = tmp_path / "train.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "periodic_async", "train",
                                 *[f"{k}={v}" for k, v in overrides.items()]],
                                env=env, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
    output = lambda: log.read_text()[-3000:]  # noqa: E731
    tree = []
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, output()
            assert time.time() < deadline, "no iteration finished within 300 s"
            time.sleep(0.5)
        tree = _tree(proc.pid)
        while backend == "ray" and len(tree) <= 3:  # the CLI, gcs, raylet, the engine worker, ...
            assert time.time() < deadline, [p.name() for p in tree]
            time.sleep(0.5)
            tree = _tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the CLI did not exit within 180 s of SIGTERM")
        assert proc.returncode == 128 + signal.SIGTERM, output()
        assert "stopped by SIGTERM" in output()
        done = len(read_jsonl(out / "metrics.jsonl"))
        ckpt = checkpoint.latest(out)
        assert ckpt is not None, output()
        label = json.loads((ckpt / "checkpoint.json").read_text())["iteration"]
        assert label >= 1 and label in (done, done + 1)  # SIGTERM may land after a step, before its books
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        for p in [proc, *tree]:
            try:
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
