"""GRPO core: hand-derived loss values, zero advantages for equal rewards, and the
streaming invariant (any micro-batch split and order gives the whole-batch gradient)."""

import math
import random

import pytest
import torch

from periodic_async import grpo
from periodic_async.batching import GroupSlice, MicroBatch, split_groups
from periodic_async.config import AlgorithmConfig, ModelConfig
from periodic_async.group import Group
from periodic_async.model import build_model
from periodic_async.shared_prompt import pack, token_logprobs
from periodic_async.trimodel import TriModel

MAX_TOKENS = 8  # engine.max_tokens of the toy iteration (the 'constant' normaliser)


# ---------------------------------------------------------------- advantages

def test_advantages_hand_values():
    """r = [1, 0, 0, 0]: mean 1/4, unbiased std 1/2 -> [1.5, -0.5, -0.5, -0.5]; mean-only [3/4, -1/4, ...]."""
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grpo.group_advantages(r, "std", eps=0.0),
                               torch.tensor([[1.5, -0.5, -0.5, -0.5]], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(grpo.group_advantages(r, "mean"),
                               torch.tensor([[0.75, -0.25, -0.25, -0.25]], dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["std", "mean"])
def test_equal_rewards_give_exactly_zero_advantages(mode):
    """0.1 * 3 / 3 != 0.1 in floating point, yet equal rewards (and G = 1) give exact zeros, no NaN."""
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [0.7, 0.7, 0.7]])
    adv = grpo.group_advantages(r, mode)
    assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(adv[2], torch.zeros(3))
    assert (adv[1] != 0).all()
    assert torch.equal(grpo.group_advantages([0.3], mode), torch.zeros(1))
    assert not torch.isnan(adv).any()


# ---------------------------------------------------------------- per-token loss, by hand

def test_clipped_surrogate_hand_values():
    """ratio 1.5 (A=+1): clipped to 1.2 -> loss -1.2; ratio 1.5 (A=-1): min(-1.5, -1.2) -> 1.5, not clipped;
    ratio 0.5 (A=-1): clipped to 0.8 -> 0.8; ratio 0.5 (A=+1): 0.5 -> -0.5, not clipped; ratio 1: -A."""
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0], dtype=torch.float64)).requires_grad_()
    old = torch.zeros(5, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0], dtype=torch.float64)
    loss, kl, clipped = grpo.per_token_loss(logp, old, adv, eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, 1.5, 0.8, -0.5, -2.0], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    assert clipped.tolist() == [True, False, True, False, False]
    assert torch.equal(kl, torch.zeros(5, dtype=torch.float64))
    loss.sum().backward()
    # d(-ratio*A)/dlogp = -ratio*A where not clipped; 0 where the clip is active
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.5, 0.0, -0.5, -2.0], dtype=torch.float64),
                               rtol=0, atol=1e-15)


def test_asymmetric_clip_range():
    """eps_low=0.2, eps_high=0.28 (DAPO): ratio 1.25 with A=+1 is inside, 1.3 is clipped to 1.28."""
    logp = torch.log(torch.tensor([1.25, 1.3, 0.79], dtype=torch.float64))
    loss, _, clipped = grpo.per_token_loss(logp, torch.zeros(3, dtype=torch.float64),
                                           torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.25, -1.28, 0.8], dtype=torch.float64), rtol=0, atol=1e-15)
    assert clipped.tolist() == [False, True, True]


def test_k3_kl_term_hand_value():
    """logp = 0, ref = log 2: k3 = 2 - log 2 - 1; d k3 / d logp = 1 - exp(ref - logp) = -1. With A = 0
    the loss is beta * k3 and its gradient beta * (-1); k3 of identical log-probs is 0."""
    beta = 0.1
    logp = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(2.0), 0.0], dtype=torch.float64)
    loss, kl, _ = grpo.per_token_loss(logp, logp.detach(), torch.zeros(2, dtype=torch.float64), 0.2, 0.2,
                                      ref_logp_N=ref, beta=beta)
    torch.testing.assert_close(kl, torch.tensor([1.0 - math.log(2.0), 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(loss.detach(), beta * kl, rtol=0, atol=1e-15)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-beta, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="ref_logp_N"):
        grpo.per_token_loss(logp, logp.detach(), torch.zeros(2), 0.2, 0.2, beta=0.1)


def test_weights_normalisers_and_metrics_by_hand():
    """Two micro-batches: samples of lengths [1, 3] then [2]; per-token loss = its own index value.
    seq-mean = mean over sequences of per-sequence means; token-mean over all 6 tokens; constant /C."""
    cfg = AlgorithmConfig(eps_low=0.2, eps_high=0.2, beta=0.0)
    mbs = [  # (sample_N, lengths_S, advantages_N) with ratio 1 -> loss_n = -A_n
        (torch.tensor([0, 1, 1, 1]), torch.tensor([1, 3]), torch.tensor([-1.0, -2.0, -3.0, -4.0])),
        (torch.tensor([0, 0]), torch.tensor([2]), torch.tensor([-5.0, -6.0])),
    ]
    expect = {"token-mean": (1 + 2 + 3 + 4 + 5 + 6) / 6, "seq-mean": (1 + (2 + 3 + 4) / 3 + (5 + 6) / 2) / 3,
              "constant": 21 / 100}
    for norm, value in expect.items():
        acc = grpo.LossAccumulator(norm, constant=100 if norm == "constant" else None)
        param = torch.zeros((), dtype=torch.float64, requires_grad=True)  # logp = param + 0: dloss/dparam
        for sample_N, lengths_S, adv_N in mbs:
            logp = param + torch.zeros(len(sample_N), dtype=torch.float64)
            w = grpo.token_weights(sample_N, lengths_S, norm, dtype=torch.float64)
            loss_sum, sums = grpo.micro_batch_loss(logp, logp.detach(), None, adv_N, w, cfg,
                                                   entropy_N=torch.ones(len(sample_N)))
            loss_sum.backward()
            acc.add(sums, num_tokens=len(sample_N), num_sequences=len(lengths_S))
        acc.finalize_gradients([param, param])  # a parameter listed twice (tied) is divided once
        m = acc.metrics()
        assert m["loss"] == pytest.approx(value, abs=1e-12)
        assert param.grad.item() == pytest.approx(value, abs=1e-12)  # d(-ratio*A)/dlogp = -A = loss at ratio 1
        assert m["entropy"] == 1.0 and m["kl"] == 0.0 and m["clip_frac"] == 0.0
        assert (m["tokens"], m["sequences"], m["micro_batches"]) == (6, 3, 2)
    with pytest.raises(ValueError, match="constant"):
        grpo.LossAccumulator("constant")


# ---------------------------------------------------------------- streaming invariant on a real model



def make_groups(rng: random.Random, vocab: int, num: int = 4, G: int = 4) -> list[Group]:
    groups = []
    for b in range(num):
        responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, MAX_TOKENS))] for _ in range(G)]
        rewards = [1.0] * G if b == 1 else [float(rng.randint(0, 2)) for _ in range(G)]  # group 1: all equal
        if b != 1 and len(set(rewards)) == 1:
            rewards[0] += 1.0
        groups.append(Group(
            prompt_index=b, iteration=0, version=0,
            prompt_ids=[rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))],
            response_ids=responses, behaviour_logprobs=[[-1.0] * len(r) for r in responses],
            rewards=rewards, advantages=grpo.group_advantages(rewards).tolist(),
        ))
    return groups


def setup_iteration(tokenizer, loss_norm: str):
    """A fp64 tiny preset whose policy has drifted from old (ratio != 1, clip active) and ref (KL > 0)."""
    cfg = AlgorithmConfig(group_size=4, prompts_per_iteration=4, eps_low=0.02, eps_high=0.02, beta=0.05,
                          loss_norm=loss_norm, skip_old_forward=False, optimizer_steps_per_iteration=2)
    policy = build_model(ModelConfig(name_or_path="qwen2-1m", dtype="float64", device="cpu", seed=0), tokenizer)
    tri = TriModel(policy, cfg)  # float64 presets compute their norms in fp64 (model.py)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    groups = make_groups(random.Random(0), len(tokenizer))
    return cfg, tri, groups


def whole_batch_gradient(tri: TriModel, groups, cfg) -> tuple[dict[str, torch.Tensor], float]:
    """The textbook loss of the whole iteration in one pass, normalised directly (no accumulator)."""
    policy = tri.policy
    policy.zero_grad(set_to_none=True)
    packed = pack([(g.prompt_ids, g.response_ids) for g in groups])
    logp = token_logprobs(policy, packed)
    with torch.no_grad():
        old, ref = token_logprobs(tri.old, packed), token_logprobs(tri.ref, packed)
    adv = torch.tensor([a for g in groups for a in g.advantages], dtype=torch.float64)[packed.sample_N]
    ratio = torch.exp(logp - old)
    loss_N = -torch.minimum(ratio * adv, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    d = ref - logp
    loss_N = loss_N + cfg.beta * (torch.exp(d) - d - 1)
    if cfg.loss_norm == "token-mean":
        loss = loss_N.mean()
    elif cfg.loss_norm == "seq-mean":
        loss = torch.stack([loss_N[packed.sample_N == s].mean() for s in range(packed.num_samples)]).mean()
    else:
        # B * G * max_tokens per optimizer step; setup_iteration uses 2 steps per iteration
        loss = loss_N.sum() / (cfg.prompts_per_iteration / cfg.optimizer_steps_per_iteration * cfg.group_size * MAX_TOKENS)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    return grads, loss.item()


def random_sample_split(rng: random.Random, groups) -> list[MicroBatch]:
    """Shuffle all (group, sample) pairs and cut them into random chunks: groups are cut."""
    pairs = [(g, i) for g in groups for i in range(g.size)]
    rng.shuffle(pairs)
    mbs, start = [], 0
    while start < len(pairs):
        n = rng.randint(1, 6)
        chunk, slices = pairs[start:start + n], []
        for g in {id(g): g for g, _ in chunk}.values():
            slices.append(GroupSlice(g, tuple(i for h, i in chunk if h is g)))
        mbs.append(MicroBatch(slices))
        start += n
    return mbs


def streamed_gradient(tri: TriModel, mbs: list[MicroBatch], cfg) -> tuple[dict[str, torch.Tensor], dict]:
    tri.policy.zero_grad(set_to_none=True)
    acc = grpo.LossAccumulator.from_config(cfg, max_tokens=MAX_TOKENS)
    for mb in mbs:
        tri.micro_step(mb.build(shared=True, dtype=torch.float64), acc)
    acc.finalize_gradients(tri.policy.parameters())
    grads = {n: p.grad.clone() for n, p in tri.policy.named_parameters()}
    tri.policy.zero_grad(set_to_none=True)
    return grads, acc.metrics()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("loss_norm", ["token-mean", "seq-mean", "constant"])
def test_microbatch_split_matches_full_batch(tokenizer, loss_norm):
    """The accumulated, once-normalised gradient over random micro-batch splits (cutting groups)
    and random orders equals the whole-batch gradient of the textbook loss: max |diff| <= 1e-10 (fp64)."""
    cfg, tri, groups = setup_iteration(tokenizer, loss_norm)
    ref_grads, ref_loss = whole_batch_gradient(tri, groups, cfg)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert scale > 1e-3
    rng = random.Random(42)
    cuts = 0
    for trial in range(4):
        order = groups[:]
        rng.shuffle(order)
        if trial % 2 == 0:
            mbs = random_sample_split(rng, order)
        else:
            mbs = split_groups(order, max_tokens=rng.choice([12, 20, 35]), shared=True)
        parts = [sum(s.group is g for mb in mbs for s in mb.slices) for g in groups]
        cuts += sum(n > 1 for n in parts)
        grads, metrics = streamed_gradient(tri, mbs, cfg)
        assert max_diff(grads, ref_grads) <= 1e-10
        assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-12)
        assert 0 < metrics["clip_frac"] < 1 and metrics["kl"] > 0  # the clip and KL terms are exercised
    assert cuts > 0, "no split cut a group"


def test_naive_token_mean_differs(tokenizer):
    """Negative control: dividing each micro-batch by its own token count (naive accumulation,
    averaged over micro-batches) gives a gradient far from the whole-batch one."""
    cfg, tri, groups = setup_iteration(tokenizer, "token-mean")
    ref_grads, _ = whole_batch_gradient(tri, groups, cfg)
    mbs = split_groups(groups, max_tokens=20, shared=True)
    assert len({mb.num_response_tokens for mb in mbs}) > 1  # unequal micro-batches
    tri.policy.zero_grad(set_to_none=True)
    for mb in mbs:
        inp = mb.build(shared=True, dtype=torch.float64)
        out = tri.forward(inp.packed, with_entropy=False)
        w = grpo.token_weights(inp.packed.sample_N, inp.lengths_S, "token-mean", dtype=torch.float64)
        loss_sum, _ = grpo.micro_batch_loss(out.policy_N, out.old_N, out.ref_N, inp.advantages_N, w, cfg)
        (loss_sum / inp.num_tokens / len(mbs)).backward()
    naive = {n: p.grad.clone() for n, p in tri.policy.named_parameters()}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert max_diff(naive, ref_grads) > 1e-3 * scale
    # and the accumulator on the very same split is exact
    grads, _ = streamed_gradient(tri, mbs, cfg)
    assert max_diff(grads, ref_grads) <= 1e-10
