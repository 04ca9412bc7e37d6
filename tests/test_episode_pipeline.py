"""Episodes through the whole pipeline (producer.py, consumer.py, the `env` section; episode/ is
tested on its own in tests/test_episode.py): periodic-async follows sync-separated exactly on
multi-turn episodes whose environment answers after a random (but reproducible) wait; a later
turn sampled by a newer policy version is refused; the CLI trains with `env.factory`; bad input
is one line; an environment that hangs does not hold the barrier."""

import time
from pathlib import Path

import pytest
import torch

from periodic_async.engine.batcher import ContinuousBatcher
from periodic_async.engine.local import LocalEngine
from periodic_async.model import load_policy
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

from helpers import by_prompt, checkpoint_weights, max_abs_diff, read_rollouts, run_cli, tiny_run_config

HERE = Path(__file__).resolve()
CALCULATOR = "periodic_async.episode.envs:CalculatorEnv"
EPISODES = {"model.name_or_path": "qwen2-micro", "engine.backend": "local", "trainer.iterations": 2,
            "env.factory": CALCULATOR, "env.factory_kwargs": "{attempts: 3, latency: {scale: 0.03, seed: 1}}",
            "env.tool_format": "plain", "env.max_tokens": 120, "env.max_turns": 3}
"""The verifier answers every wrong reply (up to 3 attempts) after a lognormal wait (median 6 ms,
p99 90 ms), drawn from what was said: reproducible, but the groups finish in another order than
they were drawn."""


def _cfg(tmp: Path, tokenizer_dir, name: str, **extra):
    return tiny_run_config(tmp / name, tokenizer_dir, **{**EPISODES, **extra})


def test_periodic_async_equals_sync_separated_on_episodes(tokenizer_dir, tmp_path):
    """Same seed, float64, the built-in engine: identical episodes (every id, model and environment,
    and the loss mask) and rewards, and final weights <= 1e-10 apart, although periodic-async
    trained the groups in the order they finished; environment turns did happen."""
    sync, asyn = (_cfg(tmp_path, tokenizer_dir, m, **{"pipeline.mode": m}) for m in ("sync-separated",
                                                                                    "periodic-async"))
    run(sync)
    run(asyn)
    rs, ra = read_rollouts(sync.trainer.output_dir), read_rollouts(asyn.trainer.output_dir)
    assert len(rs) == len(ra) == 2 * 6
    assert by_prompt(rs) == by_prompt(ra)
    masks = {(r["iteration"], r["prompt_index"]): r["loss_mask"] for r in rs}
    assert masks == {(r["iteration"], r["prompt_index"]): r["loss_mask"] for r in ra}
    assert any(0 in m for ms in masks.values() for m in ms), "environment turns must happen"
    assert [r["position"] for r in ra] != [r["position"] for r in rs], "async must train in another order"
    metrics = read_jsonl(Path(asyn.trainer.output_dir) / "metrics.jsonl")
    assert all(m["episode/env_tokens"] > 0 and m["episode/feedback_turns"] > 0 for m in metrics)
    assert all(m["train/tokens"] == m["episode/model_tokens"] for m in metrics)  # the loss counts model tokens
    ws, wa = (checkpoint_weights(Path(c.trainer.output_dir) / "checkpoint") for c in (sync, asyn))
    assert max_abs_diff(ws, load_policy(sync.model)[0].state_dict()) > 1e-4, "training must move the weights"
    assert max_abs_diff(ws, wa) <= 1e-10


class _Drifting(ContinuousBatcher):
    """The built-in engine's batcher, but the first time a later turn of an episode arrives its
    weights change and its version goes up: a later turn sampled by a newer policy (what the
    off-policy multi-turn systems allow)."""

    drifted = False

    def submit(self, requests):
        if not self.drifted and any(not r.request_id.endswith("-t0") and "-t" in r.request_id for r in requests):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            self.version += 1
            self.drifted = True
        super().submit(requests)


def test_a_turn_sampled_by_a_newer_version_is_refused(tokenizer_dir, tmp_path):
    """Negative control: an engine whose weights (and version) change in the middle of an episode
    stops the run at the producer's on-policy check, naming the versions; nothing is trained."""
    cfg = _cfg(tmp_path, tokenizer_dir, "drift", **{"trainer.iterations": 1})
    engine = LocalEngine.from_config(cfg.engine, cfg.model)
    for w in engine.workers:
        w.__class__ = _Drifting
    with pytest.raises(RuntimeError, match=r"model turns sampled by versions \[(0, )?1\]; iteration 0 samples with "
                                           r"version 0 only"):
        run(cfg, engine=engine)
    assert all(w.drifted for w in engine.workers)
    assert not (Path(cfg.trainer.output_dir) / "rollouts.jsonl").exists()


def _cli(args, tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    """(exit code, stderr without the run's log lines) of `python -m periodic_async ARGS` in this process."""
    p = run_cli(args, tmp_path, capsys, monkeypatch)
    return p.returncode, "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("[periodic_async"))


def _train_args(tmp_path, tokenizer_dir, **env) -> list[str]:
    settings = {"model.name_or_path": "qwen2-micro", "model.tokenizer": str(tokenizer_dir), "data.num_train": 16,
                "data.num_eval": 2, "engine.backend": "local", "engine.max_tokens": 12, "engine.stop": "e",
                "algorithm.group_size": 2, "algorithm.prompts_per_iteration": 2, "algorithm.micro_batch_tokens": 0,
                "trainer.iterations": 1, "trainer.eval_every": 1, "trainer.output_dir": str(tmp_path / "run"),
                "trainer.threads_after_generation": 0, "logging.wandb_mode": "disabled", "logging.progress": False,
                "env.max_tokens": 100, "env.tool_format": "plain", **env}
    return ["train", *(f"{k}={v}" for k, v in settings.items())]


def test_cli_trains_with_env_factory(tokenizer_dir, tmp_path, capsys, monkeypatch):
    """`python -m periodic_async train env.factory=... env.tools=[...]`: one iteration of episodes
    (tools shown, the verifier answering), their counters in metrics.jsonl, held-out episodes
    evaluated with the same environment."""
    code, err = _cli(_train_args(tmp_path, tokenizer_dir, **{
        "env.factory": CALCULATOR, "env.factory_kwargs": "{attempts: 2}", "env.tools": f"[{HERE}:multiply]"}),
        tmp_path, capsys, monkeypatch)
    assert code == 0, err
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert m["episode/episodes"] == 4 and m["episode/env_tokens"] > 0 and m["episode/feedback_turns"] > 0
    assert m["train/tokens"] == m["episode/model_tokens"] < m["tokens/response"]
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")  # before training, and at the end
    assert [e["step"] for e in evals] == [0, 1] and all(e["n"] == 2 for e in evals)
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert CALCULATOR in config and "multiply" in config


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def undocumented(a: int) -> str:
    return str(a)


def numeric(a: int) -> int:
    """Doubles.

    Args:
        a: A number.
    """
    return 2 * a


class NoReset:
    def calculator(self, expression: str) -> str:
        """Evaluate.

        Args:
            expression: The expression.
        """
        return expression


class Hanging:
    """Its reset never returns (within the test)."""

    def reset(self, **row):
        time.sleep(30)


@pytest.mark.parametrize("env, words", [
    pytest.param(*case, id=f"case{i}") for i, case in enumerate([
    ({"env.factory": f"{HERE}:NoReset"}, "environment_factory: NoReset has no reset() method"),
    ({"env.tools": f"[{HERE}:undocumented]"}, "tool undocumented: "),
    ({"env.tools": f"[{HERE}:numeric]"}, "tool numeric: returns int (its annotation); a tool answers the model with "
                                         "text: return a str"),
    ({"env.factory": f"{{calc: {CALCULATOR}}}"}, "training example 0: environment_factory is a dict (calc) and the "
                                                 "row has no 'environment' column"),
    ({"env.tools": f"[{HERE}:multiply]", "env.tool_format": "template"}, "the chat template cannot render tools"),
    ({"env.factory": f"{HERE}:nothing"}, f"env.factory '{HERE}:nothing': "),
])])  # ids without this machine's paths
def test_bad_input_is_one_line(tokenizer_dir, tmp_path, capsys, monkeypatch, env, words):
    """An environment without reset, a tool without a docstring, a tool annotated to return a
    non-string, a dict factory whose rows have no `environment` column, a chat template that cannot
    render tools with the template format chosen, a factory that does not exist: one line on
    stderr, exit 1, before any training. (A tool that returns a non-string at run time stops the
    run with one line too: tests/test_episode.py::test_tool_failures_end_the_episode_or_stop_the_run.)"""
    code, err = _cli(_train_args(tmp_path, tokenizer_dir, **env), tmp_path, capsys, monkeypatch)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_hanging_environment_does_not_hold_the_barrier(tokenizer_dir, tmp_path, capsys, monkeypatch):
    """An environment whose reset() hangs: each episode fails after env.call_timeout_s, counted
    (and trained on nothing: masked, reward NaN), and the run ends in seconds, not after the hang.
    With env.on_failure=raise the same hang stops the run with one line."""
    t = time.perf_counter()
    code, err = _cli(_train_args(tmp_path, tokenizer_dir, **{
        "env.factory": f"{HERE}:Hanging", "env.call_timeout_s": 0.5, "trainer.eval_every": 0}),
        tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert time.perf_counter() - t < 25
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert m["episode/failed"] == m["episode/episodes"] == 4 and m["train/tokens"] == 0
    rows = read_rollouts(tmp_path / "run")
    assert all(r["finish_reasons"] == ["failed", "failed"] and r["advantages"] == [0.0, 0.0] for r in rows)
    code, err = _cli(_train_args(tmp_path, tokenizer_dir, **{
        "env.factory": f"{HERE}:Hanging", "env.call_timeout_s": 0.5, "env.on_failure": "raise"}),
        tmp_path, capsys, monkeypatch)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and "Hanging.reset timed out after 0.5 s" in lines[0], err


def test_the_drifting_hook_changes_later_turns(tokenizer_dir, tmp_path):
    """The control's hook is real: with it, a later turn is sampled by new weights (version 1)
    and the episodes differ from the same episodes without it."""
    import asyncio

    from periodic_async.engine import SamplingParams
    from periodic_async.episode import EpisodeLimits, EpisodeRunner, GroupSpec, FeedContinuer
    from periodic_async.episode.envs import CalculatorEnv
    from periodic_async.episode.protocol import Environments

    cfg = _cfg(tmp_path, tokenizer_dir, "hook")
    spec = GroupSpec(0, [{"role": "user", "content": "What is 2+3?"}], {"answer": "5"}, 3, 7, "g")
    episodes = {}
    for drift in (False, True):
        engine = LocalEngine.from_config(cfg.engine, cfg.model)
        if drift:
            engine.workers[0].__class__ = _Drifting
        with FeedContinuer(engine) as cont:
            runner = EpisodeRunner(engine.workers[0].tokenizer, cont, Environments(CalculatorEnv.factory(attempts=3)),
                                   SamplingParams(max_tokens=12, stop=["e"]), EpisodeLimits(3, 120, 12),
                                   tool_format="plain")
            episodes[drift] = asyncio.run(runner.run_group(spec))
    clean, drifted = episodes[False], episodes[True]
    assert set().union(*(ep.versions for ep in clean)) == {0}
    assert set().union(*(ep.versions for ep in drifted)) == {0, 1}
    assert [ep.turns[0].token_ids for ep in clean] == [ep.turns[0].token_ids for ep in drifted]
    assert [ep.token_ids for ep in clean] != [ep.token_ids for ep in drifted]


def test_dynamic_sampling_on_episodes_replaces_filtered_groups_at_once(tokenizer_dir, tmp_path):
    """Episodes with dynamic sampling: every trained group is informative, each iteration trains
    B, the positions drawn are 0..N-1, and sync-separated and periodic-async keep and filter the
    same groups and reach the same weights (fp64, <= 1e-10). A filtered group's replacement starts
    while the first B groups still run (not in a round after them). Negative control: groups were
    filtered, so replacements happened."""
    half = f"{HERE.parent / 'test_dynamic_sampling.py'}:half_informative"
    runs = {m: _cfg(tmp_path, tokenizer_dir, m, **{"pipeline.mode": m, "algorithm.dynamic_sampling": True,
                                                     "reward.functions": half})
            for m in ("sync-separated", "periodic-async")}
    for cfg in runs.values():
        run(cfg)
    rows = {m: read_rollouts(c.trainer.output_dir) for m, c in runs.items()}
    key = lambda rs: {(r["iteration"], r["position"], r["filtered"]): by_prompt([r]) for r in rs}  # noqa: E731
    assert key(rows["sync-separated"]) == key(rows["periodic-async"])
    B = runs["periodic-async"].algorithm.prompts_per_iteration
    for t in range(2):
        mine = [r for r in rows["periodic-async"] if r["iteration"] == t]
        trained = [r for r in mine if not r["filtered"]]
        assert len(trained) == B and all(len(set(r["rewards"])) > 1 for r in trained)
        assert sorted(r["position"] for r in mine) == list(range(len(mine))) and len(mine) > B
    ws, wa = (checkpoint_weights(Path(c.trainer.output_dir) / "checkpoint") for c in runs.values())
    assert max_abs_diff(ws, wa) <= 1e-10
