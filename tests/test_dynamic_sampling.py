"""Dynamic sampling (DAPO; algorithm.dynamic_sampling): every trained group is informative (its
rewards differ), an iteration trains B of them unless its draws reach their cap, every group of
an iteration (filtered ones included) is sampled by one policy version, the sync and periodic-async
modes train the same groups to the same weights, and the loss is normalised over the kept groups
exactly (against a full-batch computation). Each claim with a negative control."""

import random
from pathlib import Path

import pytest
import torch

from periodic_async.config import RunConfig
from periodic_async.consumer import Consumer
from periodic_async.engine import make_engine
from periodic_async.group import Group
from periodic_async.grpo import group_advantages
from periodic_async.model import build_model, load_policy
from periodic_async.pipeline import run
from periodic_async.shared_prompt import pack, token_logprobs
from periodic_async.trace import read_jsonl

from helpers import by_prompt, checkpoint_weights, max_abs_diff, read_rollouts, tiny_run_config

HALF_INFORMATIVE = f"{Path(__file__).resolve()}:half_informative"
CONSTANT = f"{Path(__file__).resolve()}:constant"
B = 6


def half_informative(prompts, completions, id, **kwargs):
    """0 for every sample of a prompt with an even id (an uninformative group); else the distinct
    characters of the completion (a group whose rewards usually differ)."""
    return [0.0 if int(i.split("-")[1]) % 2 == 0 else len(set(c)) / 10.0 for c, i in zip(completions, id)]


def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def engine(tokenizer_dir, tmp_path_factory):
    cfg = tiny_run_config(tmp_path_factory.mktemp("e"), tokenizer_dir, **{"engine.backend": "local"})
    with make_engine(cfg.engine, cfg.model, backend="local") as eng:
        yield eng


def _cfg(tmp: Path, tokenizer_dir, mode: str = "periodic-async", **extra) -> RunConfig:
    settings = {"pipeline.mode": mode, "engine.backend": "local", "trainer.iterations": 2,
                "reward.functions": HALF_INFORMATIVE, "algorithm.dynamic_sampling": True}
    return tiny_run_config(tmp / mode, tokenizer_dir, **{**settings, **extra})


def _metrics(cfg: RunConfig) -> list[dict]:
    return read_jsonl(Path(cfg.trainer.output_dir) / "metrics.jsonl")


def _informative(row: dict) -> bool:
    return len(set(row["rewards"])) > 1


def test_trained_groups_are_informative_and_counted(engine, tokenizer_dir, tmp_path):
    """Every trained group's rewards differ, every filtered one's are equal; each iteration trains
    B groups (its cap is not reached) and its metrics count what rollouts.jsonl holds. Negative
    control: without dynamic sampling the same run trains uninformative groups."""
    cfg = _cfg(tmp_path, tokenizer_dir)
    run(cfg, engine=engine)
    rows, metrics = read_rollouts(cfg.trainer.output_dir), _metrics(cfg)
    for t, m in enumerate(metrics):
        mine = [r for r in rows if r["iteration"] == t]
        trained, filtered = [r for r in mine if not r["filtered"]], [r for r in mine if r["filtered"]]
        assert all(_informative(r) for r in trained) and not any(_informative(r) for r in filtered)
        assert filtered, "some groups must be filtered, or the test proves nothing"
        assert len(trained) == B and m["dynamic/cap_reached"] == 0
        assert (m["dynamic/kept"], m["dynamic/filtered"], m["dynamic/drawn"]) == (len(trained), len(filtered),
                                                                                  len(mine))
        assert sorted(r["position"] for r in mine) == list(range(len(mine))), "positions 0..N-1, each once"
        assert all(r["arrival"] is None for r in filtered)
    off = _cfg(tmp_path / "off", tokenizer_dir, **{"algorithm.dynamic_sampling": False})
    run(off, engine=engine)
    rows_off = read_rollouts(off.trainer.output_dir)
    assert len(rows_off) == 2 * B and not any(r["filtered"] for r in rows_off)
    assert any(not _informative(r) for r in rows_off), "negative control: uninformative groups are trained"


def test_cap_trains_the_informative_groups_there_are(engine, tokenizer_dir, tmp_path):
    """With max_draws_per_iteration = B there are no extra draws: an iteration trains fewer than B
    groups, all informative, and says that its cap was reached; a task with no informative group
    takes no step (the weights stay). Negative control: a larger cap fills all B."""
    capped = _cfg(tmp_path / "cap", tokenizer_dir, **{"algorithm.max_draws_per_iteration": B})
    run(capped, engine=engine)
    rows = read_rollouts(capped.trainer.output_dir)
    for t, m in enumerate(_metrics(capped)):
        trained = [r for r in rows if r["iteration"] == t and not r["filtered"]]
        assert m["dynamic/drawn"] == B and m["dynamic/cap_reached"] == 1
        assert 0 < len(trained) == m["dynamic/kept"] < B and all(_informative(r) for r in trained)
        assert m["train/optimizer_steps"] == 1
    assert all(m["dynamic/cap_reached"] == 0 for m in _metrics(_run_default(engine, tokenizer_dir, tmp_path)))

    flat = _cfg(tmp_path / "flat", tokenizer_dir, **{"reward.functions": CONSTANT, "trainer.iterations": 1,
                                                     "algorithm.max_draws_per_iteration": 2 * B})
    run(flat, engine=engine)
    (m,) = _metrics(flat)
    assert (m["dynamic/kept"], m["dynamic/drawn"], m["train/optimizer_steps"]) == (0, 2 * B, 0)
    w0 = load_policy(flat.model)[0].state_dict()
    assert max_abs_diff(checkpoint_weights(Path(flat.trainer.output_dir) / "checkpoint"), w0) == 0.0


def _run_default(engine, tokenizer_dir, tmp_path) -> RunConfig:
    cfg = _cfg(tmp_path / "default-cap", tokenizer_dir, **{"trainer.iterations": 1})
    run(cfg, engine=engine)
    return cfg


def test_one_policy_version_per_iteration_in_every_mode(engine, tokenizer_dir, tmp_path):
    """Every group of iteration t, the extra draws and the filtered ones included, carries one
    version: t on-policy, t-1 (t >= 1; 0 at t = 0) in async-offpolicy. sync-separated and periodic-async train
    the same groups (same tokens, rewards, versions) to the same weights (fp64, <= 1e-10) although
    the async trainer took them in another order. Negative control: versions differ between
    iterations, so the check can tell them apart."""
    runs = {}
    for mode in ("sync-separated", "periodic-async", "async-offpolicy"):
        runs[mode] = cfg = _cfg(tmp_path, tokenizer_dir, mode)
        run(cfg, engine=engine)
        rows = read_rollouts(cfg.trainer.output_dir)
        for t in range(2):
            versions = {r["version"] for r in rows if r["iteration"] == t}
            assert versions == {t if mode != "async-offpolicy" else 0}, (mode, t, versions)
        if mode != "async-offpolicy":
            assert {r["version"] for r in rows} == {0, 1}
    sync, asyn = (read_rollouts(runs[m].trainer.output_dir) for m in ("sync-separated", "periodic-async"))
    key = lambda rows: {(r["iteration"], r["position"], r["filtered"]): by_prompt([r]) for r in rows}  # noqa: E731
    assert key(sync) == key(asyn) and any(r["filtered"] for r in sync)
    assert [r["position"] for r in asyn if not r["filtered"]] != [r["position"] for r in sync if not r["filtered"]]
    ws, wa = (checkpoint_weights(Path(runs[m].trainer.output_dir) / "checkpoint")
              for m in ("sync-separated", "periodic-async"))
    assert max_abs_diff(ws, load_policy(runs["sync-separated"].model)[0].state_dict()) > 1e-3
    assert max_abs_diff(ws, wa) <= 1e-10


# --- the normalisation, against a full-batch computation --------------------------------------------------

def _groups(rng: random.Random, vocab: int, rewards: list[list[float]]) -> list[Group]:
    out = []
    for b, r in enumerate(rewards):
        responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))] for _ in r]
        out.append(Group(prompt_index=b, iteration=0, version=0,
                         prompt_ids=[rng.randrange(4, vocab) for _ in range(rng.randint(3, 8))],
                         response_ids=responses, behaviour_logprobs=[[-1.0] * len(x) for x in responses],
                         rewards=r, advantages=group_advantages(r).tolist(), timings={"finished": 0.0}))
    return out


def _full_batch_gradient(policy, groups: list[Group]) -> dict[str, torch.Tensor]:
    """The token-mean GRPO loss of `groups` in one pass (first step: ratio 1, no clipping, zero KL)."""
    policy.zero_grad(set_to_none=True)
    packed = pack([(g.prompt_ids, g.response_ids) for g in groups])
    logp = token_logprobs(policy, packed)
    adv = torch.tensor([a for g in groups for a in g.advantages], dtype=torch.float64)[packed.sample_N]
    (-(adv * torch.exp(logp - logp.detach())).mean()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    return grads


def test_loss_is_normalised_over_the_kept_groups_exactly(tokenizer, tokenizer_dir, tmp_path):
    """An iteration that reached its cap trains 3 of B=4 groups, streamed in micro-batches: the
    gradient it steps with equals the full-batch gradient of those 3 groups (fp64, <= 1e-10).
    Negative control: a normaliser that also counted a filtered group's tokens (zero advantage,
    so only its count changes) gives a gradient that differs."""
    cfg = tiny_run_config(tmp_path, tokenizer_dir, **{
        "algorithm.prompts_per_iteration": 4, "algorithm.group_size": 4, "algorithm.dynamic_sampling": True,
        "algorithm.max_grad_norm": 0, "algorithm.beta": 0.0, "algorithm.micro_batch_tokens": 30})
    rng = random.Random(0)
    kept = _groups(rng, len(tokenizer), [[1.0, 0.0, 0.0, 1.0], [0.0, 2.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    (flat,) = _groups(rng, len(tokenizer), [[1.0, 1.0, 1.0, 1.0]])

    def policy():
        torch.manual_seed(0)
        return build_model(cfg.model, tokenizer)

    expected = _full_batch_gradient(policy(), kept)
    control = _full_batch_gradient(policy(), kept + [flat])
    consumer = Consumer(policy(), cfg)
    stepped = {}
    consumer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: stepped.update({n: p.grad.clone() for n, p in consumer.policy.named_parameters()}))
    m = consumer.train_iteration(iter([kept[2], kept[0], kept[1]]), 0, 0)
    assert m["optimizer_steps"] == 1 and m["micro_batches"] > 1 and consumer.version == 1
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-4
    assert max((stepped[k] - expected[k]).abs().max().item() for k in expected) <= 1e-10
    assert max((control[k] - expected[k]).abs().max().item() for k in expected) > 1e-3 * scale
