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


def test_kl_bias_correction_hand_values():
    """kl_bias_correction: the KL term is beta * k3 * ratio, ratio = exp(logp - old) unclipped, with
    its gradient. A = 0 (no surrogate), ref = logp + log 2: k3 = 1 - log 2, d k3/d logp = -1.
    On-policy (ratio 1): the same loss, gradient beta * (-1 + k3) = -beta * log 2 instead of -beta.
    Ratio 1.5: loss 1.5 * beta * k3, gradient 1.5 * beta * (-1 + k3). Without: beta * k3 and -beta."""
    beta, k3 = 0.1, 1.0 - math.log(2.0)
    old = torch.tensor([0.0, -math.log(1.5)], dtype=torch.float64)
    corrected = ([beta * k3, 1.5 * beta * k3], [-beta * math.log(2.0), 1.5 * beta * (k3 - 1)])
    for correct, (loss_want, grad_want) in ((True, corrected), (False, ([beta * k3, beta * k3], [-beta, -beta]))):
        logp = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        loss, kl, _ = grpo.per_token_loss(logp, old, torch.zeros(2, dtype=torch.float64), 0.2, 0.2,
                                          ref_logp_N=torch.full((2,), math.log(2.0), dtype=torch.float64), beta=beta,
                                          kl_bias_correction=correct)
        torch.testing.assert_close(loss.detach(), torch.tensor(loss_want, dtype=torch.float64), rtol=0, atol=1e-15)
        torch.testing.assert_close(kl, torch.full((2,), k3, dtype=torch.float64), rtol=0, atol=1e-15)  # k3 itself
        loss.sum().backward()
        torch.testing.assert_close(logp.grad, torch.tensor(grad_want, dtype=torch.float64), rtol=0, atol=1e-15)


# Samples 0, 0, 1, 1, 2 with old - behaviour = log 4, -log 2, log 1.5, 0, NaN (NaN counts as 0, TRL's rule):
# token ratios 4, 0.5, 1.5, 1, 1; sequence ratios exp(log 2) = 2, 1.5, 1.
IS_CASES = [  # mode, C_min, C_max, rho per token, (mean, min, max, cut fraction) over the units
    ("token_truncate", 0.6, 3.0, [3.0, 0.6, 1.5, 1.0, 1.0], (7.1 / 5, 0.6, 3.0, 2 / 5)),
    ("token_mask", 0.6, 3.0, [0.0, 0.0, 1.5, 1.0, 1.0], (3.5 / 5, 0.0, 1.5, 2 / 5)),
    ("token_truncate", None, 3.0, [3.0, 0.5, 1.5, 1.0, 1.0], (7.0 / 5, 0.5, 3.0, 1 / 5)),
    ("sequence_truncate", 0.6, 1.8, [1.8, 1.8, 1.5, 1.5, 1.0], (4.3 / 3, 1.0, 1.8, 1 / 3)),
    ("sequence_mask", None, 1.8, [0.0, 0.0, 1.5, 1.5, 1.0], (2.5 / 3, 0.0, 1.5, 1 / 3)),
    ("sequence_mask", 1.2, None, [2.0, 2.0, 1.5, 1.5, 0.0], (3.5 / 3, 0.0, 2.0, 1 / 3)),
]


@pytest.mark.parametrize("mode, lo, hi, rho, stats", IS_CASES)
def test_behaviour_is_ratio_hand_values(mode, lo, hi, rho, stats):
    """TRL's four modes of the behaviour importance ratio rho = exp(old - behaviour), by hand; the
    surrogate of each token is multiplied by rho, the KL is not."""
    sample_N = torch.tensor([0, 0, 1, 1, 2])
    old = torch.full((5,), -2.0, dtype=torch.float64)
    behaviour = old - torch.tensor([math.log(4.0), -math.log(2.0), math.log(1.5), 0.0, math.nan], dtype=torch.float64)
    rho_N, sums = grpo.behaviour_is_ratio(old, behaviour, sample_N, 3, mode, lo, hi)
    torch.testing.assert_close(rho_N, torch.tensor(rho, dtype=torch.float64), rtol=0, atol=1e-14)
    units = 5 if mode.startswith("token") else 3
    mean, low, high, cut = stats
    assert float(sums["is_count"]) == units
    assert float(sums["is_ratio"]) / units == pytest.approx(mean, abs=1e-14)
    assert (float(sums["is_min"]), float(sums["is_max"])) == pytest.approx((low, high), abs=1e-14)
    assert float(sums["is_cut"]) / units == pytest.approx(cut, abs=1e-14)
    # in the loss: A = 1, ratio 1 (surrogate -1 per token), beta * k3 added after the correction
    cfg = AlgorithmConfig(beta=0.1)
    logp = old.clone().requires_grad_()
    ref = old + math.log(2.0)
    loss_sum, _ = grpo.micro_batch_loss(logp, old, ref, torch.ones(5, dtype=torch.float64),
                                        torch.ones(5, dtype=torch.float64), cfg, is_ratio_N=rho_N)
    want = -torch.tensor(rho, dtype=torch.float64).sum() + 5 * 0.1 * (1.0 - math.log(2.0))
    assert float(loss_sum) == pytest.approx(float(want), abs=1e-13)


def test_behaviour_is_settings_are_validated():
    from periodic_async.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.behaviour_is="):
        AlgorithmConfig(behaviour_is="token")
    with pytest.raises(ConfigError, match="algorithm.behaviour_is_max"):
        AlgorithmConfig(behaviour_is="token_mask", behaviour_is_min=2.0, behaviour_is_max=1.0)
    with pytest.raises(ConfigError, match="truncate mode needs"):
        AlgorithmConfig(behaviour_is="sequence_truncate", behaviour_is_max=None)
    with pytest.raises(ConfigError, match="algorithm.token_mean_scope"):
        AlgorithmConfig(token_mean_scope="batch")


def test_iteration_scope_divides_each_step_by_the_iterations_tokens():
    """token_mean_scope='iteration' with k = 2 steps (TRL's dapo): each step's gradient and loss are
    divided by the iteration's tokens / 2, not by its own; at k = 1 the scope changes nothing;
    'iteration' needs the count before the step."""
    cfg = AlgorithmConfig(prompts_per_iteration=2, optimizer_steps_per_iteration=2, token_mean_scope="iteration")
    acc = grpo.LossAccumulator.from_config(cfg)
    acc.add({"loss": torch.tensor(6.0, dtype=torch.float64)}, num_tokens=3, num_sequences=1)
    with pytest.raises(ValueError, match="iteration_tokens"):
        acc.normaliser
    acc.iteration_tokens = 10  # 3 here, 7 in the other step
    assert acc.normaliser == 5.0 and acc.metrics()["loss"] == 6.0 / 5.0
    step = grpo.LossAccumulator.from_config(AlgorithmConfig(prompts_per_iteration=2, optimizer_steps_per_iteration=2))
    step.add({"loss": torch.tensor(6.0, dtype=torch.float64)}, num_tokens=3, num_sequences=1)
    assert step.normaliser == 3.0
    one = grpo.LossAccumulator.from_config(AlgorithmConfig(token_mean_scope="iteration"))
    one.add({"loss": torch.tensor(6.0, dtype=torch.float64)}, num_tokens=3, num_sequences=1)
    assert one.normaliser == 3.0


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


def setup_iteration(tokenizer, loss_norm: str, **settings):
    """A fp64 tiny preset whose policy has drifted from old (ratio != 1, clip active) and ref (KL > 0)."""
    cfg = AlgorithmConfig(group_size=4, prompts_per_iteration=4, eps_low=0.02, eps_high=0.02, beta=0.05,
                          loss_norm=loss_norm, skip_old_forward=False, optimizer_steps_per_iteration=2, **settings)
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
    if cfg.behaviour_is != "off":  # the engines' log-probs, in the same flat order (sample by sample)
        diff = old - torch.tensor([x for g in groups for b in g.behaviour_logprobs for x in b], dtype=torch.float64)
        if cfg.behaviour_is.startswith("sequence"):
            diff = torch.stack([diff[packed.sample_N == i].sum() for i in range(packed.num_samples)])[packed.sample_N]
        raw, lo, hi = torch.exp(diff), cfg.behaviour_is_min, cfg.behaviour_is_max
        rho = raw.clamp(lo, hi) if cfg.behaviour_is.endswith("truncate") else \
            torch.where((raw < lo) | (raw > hi), torch.zeros_like(raw), raw)
        loss_N = loss_N * rho
    d = ref - logp
    kl = torch.exp(d) - d - 1
    loss_N = loss_N + cfg.beta * (kl * ratio if cfg.kl_bias_correction else kl)
    if cfg.loss_norm == "token-mean":
        loss = loss_N.mean()
    elif cfg.loss_norm == "seq-mean":
        loss = torch.stack([loss_N[packed.sample_N == s].mean() for s in range(packed.num_samples)]).mean()
    else:
        # B * G * max_tokens per optimizer step; setup_iteration uses 2 steps per iteration
        loss = loss_N.sum() / (cfg.prompts_per_iteration / cfg.optimizer_steps_per_iteration
                               * cfg.group_size * MAX_TOKENS)
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


@pytest.mark.parametrize("behaviour_is", ["token_truncate", "sequence_mask"])
def test_behaviour_is_and_corrected_kl_stream_exactly(tokenizer, behaviour_is):
    """With the engines' importance ratio (TRL's vLLM correction) and the bias-corrected KL on, the
    accumulated gradient over random splits (cutting groups, never a sequence) and orders still
    equals the whole-batch gradient of the textbook loss (fp64, <= 1e-10): both act per token or
    per sequence."""
    cfg, tri, groups = setup_iteration(tokenizer, "token-mean", kl_bias_correction=True, behaviour_is=behaviour_is,
                                       behaviour_is_min=0.8, behaviour_is_max=1.25)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the engines' log-probs: old's minus noise, so some ratios fall outside [0.8, 1.25]
        for g in groups:
            packed = pack([(g.prompt_ids, g.response_ids)])
            old = token_logprobs(tri.old, packed)
            g.behaviour_logprobs = [(old[packed.sample_N == i] - 0.15 * torch.randn(len(r), generator=gen,
                                                                                   dtype=torch.float64)).tolist()
                                    for i, r in enumerate(g.response_ids)]
    ref_grads, ref_loss = whole_batch_gradient(tri, groups, cfg)
    rng = random.Random(7)
    for trial in range(3):
        order = groups[:]
        rng.shuffle(order)
        grads, metrics = streamed_gradient(tri, random_sample_split(rng, order), cfg)
        assert max_diff(grads, ref_grads) <= 1e-10
        assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-12)
        assert 0 < metrics["is_ratio_cut"] < 1 and metrics["kl"] > 0


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


# ---------------------------------------------------------------- several optimizer steps per iteration

def test_consumer_iteration_scope_waits_for_the_last_group(tokenizer):
    """token_mean_scope='iteration', k = 2 steps of 2 groups (TRL's dapo): the consumer trains the
    first step's groups as they come, holds the next ones, takes the first step only once the last
    group is in (dividing by the iteration's tokens / 2), then trains and takes the second. The
    weights equal those of the two steps driven by hand with that normaliser, bit for bit, and
    differ from token_mean_scope='step' (each step by its own tokens)."""
    import copy

    from periodic_async.config import RunConfig, load_config
    from periodic_async.consumer import Consumer

    def consumer(scope: str, policy) -> Consumer:
        settings = {"model.name_or_path": "qwen2-1m", "model.dtype": "float64", "model.device": "cpu",
                    "algorithm.group_size": 4, "algorithm.prompts_per_iteration": 4, "algorithm.lr": 1e-2,
                    "algorithm.optimizer_steps_per_iteration": 2, "algorithm.token_mean_scope": scope,
                    "algorithm.micro_batch_tokens": 0, "algorithm.beta": 0.05, "algorithm.kl_bias_correction": True,
                    "algorithm.attention_backend": "dense", "engine.max_tokens": MAX_TOKENS}
        return Consumer(policy, load_config(RunConfig, None, [f"{k}={v}" for k, v in settings.items()]))

    groups = make_groups(random.Random(3), len(tokenizer))
    tokens = [g.num_response_tokens for g in groups]
    assert tokens[0] + tokens[1] != tokens[2] + tokens[3]  # the steps' own counts differ
    start = build_model(ModelConfig(name_or_path="qwen2-1m", dtype="float64", device="cpu", seed=0), tokenizer)
    streamed = consumer("iteration", copy.deepcopy(start))
    seen = []

    def stream():
        for g in groups:
            seen.append((len(streamed._micro_losses), len(streamed.optimizer.state)))
            yield g

    metrics = streamed.train_iteration(stream(), iteration=0, version=0)
    # before each group: micro-batches done, parameters with optimizer state (0 until the first step)
    assert seen == [(0, 0), (1, 0), (2, 0), (2, 0)] and metrics["optimizer_steps"] == 2

    by_hand, losses = consumer("iteration", copy.deepcopy(start)), []
    for part in (groups[:2], groups[2:]):
        acc = grpo.LossAccumulator.from_config(by_hand.cfg.algorithm, max_tokens=MAX_TOKENS)
        for mb in split_groups(part):
            by_hand.tri.micro_step(mb.build(shared=True, dtype=torch.float64), acc)
        acc.iteration_tokens = sum(tokens)
        losses.append(by_hand.tri.optimizer_step(by_hand.optimizer, acc)["loss"])
    hand = dict(by_hand.policy.named_parameters())
    assert all(torch.equal(p, hand[n]) for n, p in streamed.policy.named_parameters())
    assert metrics["loss"] == sum(losses) / 2
    # negative control: each step by its own tokens (AdamW hides a gradient's scale, the loss shows it)
    own = consumer("step", copy.deepcopy(start)).train_iteration(iter(groups), iteration=0, version=0)
    assert abs(own["loss"] - metrics["loss"]) > 1e-3 * abs(metrics["loss"])
