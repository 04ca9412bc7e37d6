"""The pipeline's claims: periodic-async follows the synchronous trajectory exactly (fp64),
an extra optimizer step per iteration breaks that, stale groups are refused, the producer
delivers every group once with its version. (Resuming, checkpoints and signals:
tests/test_checkpoint.py.)"""

import json
from pathlib import Path

import pytest
import torch

from periodic_async.config import RunConfig
from periodic_async.consumer import Consumer, StaleGroupError
from periodic_async.engine import make_engine
from periodic_async.group import Group
from periodic_async.model import load_policy
from periodic_async.pipeline import run
from periodic_async.trace import read_jsonl

from helpers import by_prompt, checkpoint_weights, diversity_reward, max_abs_diff, read_rollouts, tiny_run_config

HERE = Path(__file__).resolve()


def _cfg(tmp: Path, tokenizer_dir, mode: str, **extra) -> RunConfig:
    return tiny_run_config(tmp / mode, tokenizer_dir, **{"pipeline.mode": mode, **extra})


def _rollouts(cfg: RunConfig) -> list[dict]:
    return read_rollouts(cfg.trainer.output_dir)


def _final_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    return checkpoint_weights(Path(cfg.trainer.output_dir) / "checkpoint")


@pytest.fixture(scope="module")
def engine(ray_session, tokenizer_dir, tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("e"), tokenizer_dir, "periodic-async")
    eng = make_engine(cfg.engine, cfg.model)
    yield eng
    eng.close()


def test_async_matches_sync(engine, tokenizer_dir, tmp_path):
    """Same seed: identical sampled tokens and rewards for 3 iterations, final weights <= 1e-10
    apart (fp64), although the async trainer consumed groups in a different order."""
    sync, asyn = (_cfg(tmp_path, tokenizer_dir, m) for m in ("sync-separated", "periodic-async"))
    run(sync, engine=engine)
    run(asyn, engine=engine)
    rs, ra = _rollouts(sync), _rollouts(asyn)
    assert len(rs) == len(ra) == 3 * 6
    assert by_prompt(rs) == by_prompt(ra)
    assert any(r["rewards"] != rs[0]["rewards"] for r in rs), "rewards must vary, or the test proves nothing"
    assert [r["position"] for r in ra] != [r["position"] for r in rs], "async must train in another order"
    ws, wa = _final_weights(sync), _final_weights(asyn)
    w0 = load_policy(sync.model)[0].state_dict()
    assert max_abs_diff(ws, w0) > 1e-3, "training must move the weights"
    assert max_abs_diff(ws, wa) <= 1e-10


def test_extra_optimizer_step_breaks_equivalence(tokenizer_dir, tmp_path):
    """Negative control: two optimizer steps per iteration, mini-batches filled in completion
    order, and the two modes leave iteration 0 with different weights."""
    extra = {"algorithm.optimizer_steps_per_iteration": 2, "trainer.iterations": 1}
    sync = _cfg(tmp_path, tokenizer_dir, "sync-separated", **extra)
    asyn = _cfg(tmp_path, tokenizer_dir, "periodic-async", **extra)
    # The in-process engine steps its workers in lock-step: a completion order that does not
    # depend on the machine's timing, so the control is the same on every run.
    with make_engine(sync.engine, sync.model, backend="local") as local:
        run(sync, engine=local)
        run(asyn, engine=local)
    first_half = lambda rows: {r["prompt_index"] for r in rows[:3]}  # noqa: E731
    assert first_half(_rollouts(sync)) != first_half(_rollouts(asyn)), "orders must differ for a fair control"
    assert max_abs_diff(_final_weights(sync), _final_weights(asyn)) > 1e-6


def test_producer_delivers_each_group_once_with_its_version(engine, tokenizer_dir, tmp_path):
    """Each iteration trains its B requests once each: the rows of iteration t are t's B
    distinct positions, in one block, each holding the prompt the data gives that position,
    sampled by version t, with G responses."""
    from periodic_async.data import iteration_prompts, load_examples

    cfg = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"trainer.iterations": 2})
    run(cfg, engine=engine)
    rows = _rollouts(cfg)
    assert [r["iteration"] for r in rows] == [0] * 6 + [1] * 6
    examples = load_examples(cfg.data, "train")
    for it in range(2):
        mine = [r for r in rows if r["iteration"] == it]
        assert sorted(r["position"] for r in mine) == list(range(6))
        prompts = [i for i, _ in iteration_prompts(examples, it, 6, cfg.data.seed)]
        assert all(r["prompt_index"] == prompts[r["position"]] for r in mine)
        assert {r["version"] for r in mine} == {it}
        assert all(len(r["response_ids"]) == 3 for r in mine)


def _group(version: int) -> Group:
    return Group(prompt_index=0, iteration=0, version=version, prompt_ids=[5, 6, 7], response_ids=[[8, 1], [9]],
                 behaviour_logprobs=[[-1.0, -1.0], [-1.0]], rewards=[1.0, 0.0], advantages=[0.7, -0.7])


def test_stale_version_rejected(tokenizer_dir, tmp_path):
    cfg = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"algorithm.prompts_per_iteration": 2})
    policy, _ = load_policy(cfg.model)
    consumer = Consumer(policy, cfg)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with pytest.raises(StaleGroupError, match="sampled by version 0; iteration 1 takes version 1 only"):
        consumer.train_iteration([_group(1), _group(0)], iteration=1, version=1)
    assert max_abs_diff(before, policy.state_dict()) == 0  # nothing was stepped


def failing_reward(prompts, completions, **kwargs):
    """Fails on the second iteration's prompts (the test sets data so that it does)."""
    import os

    calls = int(os.environ.get("_PA_REWARD_CALLS", "0")) + 1
    os.environ["_PA_REWARD_CALLS"] = str(calls)
    if calls > 6:  # 6 groups per iteration: the 7th call is in iteration 1
        raise ValueError("reward service unavailable")
    return diversity_reward(prompts, completions)


def test_producer_error_stops_the_run_and_keeps_the_checkpoint(engine, tokenizer_dir, tmp_path, monkeypatch):
    """A crash in the producer thread surfaces in the trainer (no hang), and the weights of the
    last completed iteration are saved."""
    monkeypatch.setenv("_PA_REWARD_CALLS", "0")
    cfg = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"reward.functions": f"{HERE}:failing_reward"})
    with pytest.raises(ValueError, match="reward service unavailable"):
        run(cfg, engine=engine)
    info = json.loads((Path(cfg.trainer.output_dir) / "checkpoint" / "checkpoint.json").read_text())
    assert info["iteration"] == 1
    assert len(_rollouts(cfg)) == 6


def test_colocated_mode_samples_the_same_tokens(engine, tokenizer_dir, tmp_path):
    """sync-colocated (in-process engine, same dispatch) follows sync-separated."""
    sep = _cfg(tmp_path, tokenizer_dir, "sync-separated", **{"trainer.iterations": 2})
    col = _cfg(tmp_path, tokenizer_dir, "sync-colocated", **{"trainer.iterations": 2, "engine.backend": "local"})
    run(sep, engine=engine)
    run(col)
    assert by_prompt(_rollouts(sep)) == by_prompt(_rollouts(col))
    assert max_abs_diff(_final_weights(sep), _final_weights(col)) <= 1e-10


def test_trace_records_every_phase_and_draws_the_timeline(engine, tokenizer_dir, tmp_path):
    from periodic_async.bench.plots import plot_timeline

    cfg = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"trainer.iterations": 2})
    run(cfg, engine=engine)
    events = read_jsonl(Path(cfg.trainer.output_dir) / "trace.jsonl")
    names = {e["name"] for e in events}
    assert {"generate", "reward", "micro_step", "optimizer_step", "weight_sync"} <= names
    gen = [e for e in events if e["name"] == "generate"]
    assert len(gen) == 2 * 6 * 3  # one bar per sample
    assert {e["track"].split("/")[0] for e in gen} == {"worker0", "worker1"}
    metrics = read_jsonl(Path(cfg.trainer.output_dir) / "metrics.jsonl")
    assert len(metrics) == 2 and all(m["time/generate_s"] <= m["time/iteration_s"] for m in metrics)
    # the trainer scores exactly the tokens the engine sampled, under the same weights (the
    # engine samples from float32 logits, hence fp32-level agreement of an fp64 model)
    assert all(m["train/behaviour_logp_gap"] < 1e-5 for m in metrics)
    png = plot_timeline([("async", Path(cfg.trainer.output_dir) / "trace.jsonl")], tmp_path / "t.png")
    assert png.stat().st_size > 10_000


def _phases(cfg: RunConfig) -> dict[int, tuple[float, float]]:
    """Per iteration: (first micro-step start, last generation end) from the run's trace."""
    events = read_jsonl(Path(cfg.trainer.output_dir) / "trace.jsonl")
    out = {}
    for it in range(cfg.trainer.iterations):
        gen_end = max(e["start"] + e["dur"] for e in events
                      if e["name"] == "generate" and e["args"]["request"].startswith(f"it{it}-"))
        first_train = min(e["start"] for e in events if e["name"] == "micro_step" and e["args"]["iteration"] == it)
        out[it] = (first_train, gen_end)
    return out


def test_async_trains_while_generating(engine, tokenizer_dir, tmp_path):
    """The trace of periodic-async shows training start before the iteration's generation
    ends (one group per micro-batch, B*G well above the engines' slots); sync-separated's
    trainer waits for the whole batch. Fails if the consumer ever waits for the batch."""
    extra = {"algorithm.prompts_per_iteration": 12, "algorithm.micro_batch_tokens": 0,
             "algorithm.micro_batch_groups": 1, "trainer.iterations": 2}
    asyn = _cfg(tmp_path, tokenizer_dir, "periodic-async", **extra)
    sync = _cfg(tmp_path, tokenizer_dir, "sync-separated", **extra)
    run(asyn, engine=engine)
    run(sync, engine=engine)
    assert all(first < gen_end for first, gen_end in _phases(asyn).values()), _phases(asyn)
    assert all(first >= gen_end for first, gen_end in _phases(sync).values()), _phases(sync)


def test_offpolicy_mode_trains_on_one_step_stale_samples(engine, tokenizer_dir, tmp_path):
    """async-offpolicy: batch t (t >= 1) is sampled by version t-1 while batch t-1 trains; its
    importance ratios (old = behaviour log-probs) show the staleness that the on-policy
    modes do not have, and it leaves the synchronous trajectory."""
    off = _cfg(tmp_path, tokenizer_dir, "async-offpolicy")
    on = _cfg(tmp_path, tokenizer_dir, "periodic-async")
    run(off, engine=engine)
    run(on, engine=engine)
    versions = {(r["iteration"], r["version"]) for r in _rollouts(off)}
    assert versions == {(0, 0), (1, 0), (2, 1)}
    dev_off = [m["train/ratio_abs_dev"] for m in read_jsonl(Path(off.trainer.output_dir) / "metrics.jsonl")]
    dev_on = [m["train/ratio_abs_dev"] for m in read_jsonl(Path(on.trainer.output_dir) / "metrics.jsonl")]
    assert dev_on == [0.0, 0.0, 0.0]  # old = policy, detached: the ratio is exactly 1 on-policy
    assert dev_off[0] < 1e-5  # batch 0: sampled by the weights it trains (fp32 engine noise only)
    assert min(dev_off[1:]) > 100 * max(dev_off[0], 1e-9), dev_off  # stale by one step
    # generation of batch t+1 overlaps the training of batch t
    events = read_jsonl(Path(off.trainer.output_dir) / "trace.jsonl")
    gen1 = [e["start"] for e in events if e["name"] == "generate" and e["args"]["request"].startswith("it1-")]
    train0_end = max(e["start"] + e["dur"] for e in events if e["name"] == "micro_step" and e["args"]["iteration"] == 0)
    assert min(gen1) < train0_end
    assert max_abs_diff(_final_weights(off), _final_weights(on)) > 1e-6


def test_evaluation_runs_through_the_engines(engine, tokenizer_dir, tmp_path):
    """trainer.eval_every=1: every version 0..T is evaluated greedily on all held-out prompts
    by the engines while the trainer trains; the final version by evaluate_now."""
    cfg = _cfg(tmp_path, tokenizer_dir, "periodic-async",
               **{"data.num_eval": 10, "trainer.eval_every": 1, "trainer.eval_at_end": True})
    summary = run(cfg, engine=engine)
    rows = read_jsonl(Path(cfg.trainer.output_dir) / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["n"] == 10 and 0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert summary["eval_accuracy"] == rows[-1]["accuracy"]
    metrics = read_jsonl(Path(cfg.trainer.output_dir) / "metrics.jsonl")
    assert [m.get("eval/version") for m in metrics[:3]] == [0, 1, 2]


def test_non_finite_gradient_is_not_stepped(tokenizer_dir, tmp_path):
    """A NaN advantage (e.g. from a reward bug past the checks) gives a non-finite gradient: the
    step is not taken, the weights stay as they were, the error names the iteration."""
    cfg = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"algorithm.prompts_per_iteration": 2})
    policy, _ = load_policy(cfg.model)
    consumer = Consumer(policy, cfg)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    bad = _group(0)
    bad.advantages = [float("nan"), 0.7]
    with pytest.raises(FloatingPointError,
                       match=r"iteration 0, optimizer step 0, micro-batch 0 \(prompts \[0\]\): non-finite gradient"):
        consumer.train_iteration([_group(0), bad], iteration=0, version=0)
    assert max_abs_diff(before, policy.state_dict()) == 0


def test_devices_count_trainer_ranks_and_engine_workers_in_use(tokenizer_dir, tmp_path):
    """`devices_in_use`: trainer ranks x trainer.threads plus the engine workers serving the
    version (engine.num_workers_schedule) x threads_per_worker when separated, the larger of the
    two co-located, no engine devices for the in-process engine; the summary divides the trained
    tokens by device-seconds. (A 2-rank run logs 2 devices: tests/test_distributed.py.)"""
    from periodic_async.books import devices_in_use, summary as _summary

    sizes = {"engine.threads_per_worker": 2, "trainer.threads": 3, "engine.num_workers_schedule": "{2: 3, 4: 1}"}
    separated = _cfg(tmp_path, tokenizer_dir, "periodic-async", **sizes)
    assert [devices_in_use(separated, 1, v) for v in range(5)] == [2 * 2 + 3] * 2 + [3 * 2 + 3] * 2 + [1 * 2 + 3]
    assert devices_in_use(separated, trainer_ranks=4, version=2) == 3 * 2 + 4 * 3
    colocated = _cfg(tmp_path, tokenizer_dir, "sync-colocated", **sizes)
    assert devices_in_use(colocated, 4, 0) == 4 * 3 and devices_in_use(colocated, 1, 2) == 3 * 2
    local = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"engine.backend": "local", "trainer.threads": 3})
    assert devices_in_use(local, 2, 0) == 2 * 3
    on_gpus = _cfg(tmp_path, tokenizer_dir, "periodic-async", **sizes, **{"model.device": "cuda"})
    assert devices_in_use(on_gpus, 2, 2) == 3 + 2  # one GPU per worker and per rank, whatever the threads
    halves = _cfg(tmp_path, tokenizer_dir, "periodic-async", **{"model.device": "cuda", "engine.gpus_per_worker": 0.5})
    assert devices_in_use(halves, 1, 0) == 2 * 0.5 + 1

    rows = [{"tokens/trained": 100, "time/iteration_s": t, "throughput/devices": d, "time/generate_s": 0.5,
             "time/train_s": 0.5, "time/sync_s": 0.1, "time/after_generation_s": t - 0.6, "reward/mean": 0.0,
             "accuracy": 0.0} for t, d in ((1.0, 7), (1.0, 9), (2.0, 5))]
    summary = _summary(separated, rows)  # the first iteration is left out (start-up)
    assert summary["mean_after_generation_s"] == pytest.approx(0.9) and summary["mean_first_group_s"] == 0.0
    assert summary["devices"] == pytest.approx((9 * 1.0 + 5 * 2.0) / 3.0)
    assert summary["tokens_per_s_per_device"] == pytest.approx(200 / (9 * 1.0 + 5 * 2.0))
    assert _summary(separated, rows[:2])["devices"] == 9
