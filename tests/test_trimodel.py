"""The tri-model: ratio exactly 1 with one optimizer step per iteration, old refreshed in
place at the barrier, ref frozen forever, skipped copies not allocated, memory accounted; and
its three log-probs and the policy gradient are the same with shared-prompt packing as with
per-response packing, in fp64, for Qwen2 and for SmolLM2-135M's architecture down-scaled
(`llama-micro`: grouped-query attention, RoPE, tied embeddings)."""

import random

import pytest
import torch

from periodic_async import grpo, trimodel
from periodic_async.batching import split_groups
from periodic_async.config import AlgorithmConfig, ModelConfig
from periodic_async.group import Group
from periodic_async.model import build_model, num_parameters
from periodic_async.trimodel import TriModel




def make_groups(vocab: int) -> list[Group]:
    """Three groups (G = 3) with ragged responses."""
    rng = random.Random(0)
    groups = []
    for b in range(3):
        responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 7))] for _ in range(3)]
        groups.append(Group(b, 0, 0, [rng.randrange(4, vocab) for _ in range(6)], responses,
                            [[-1.0] * len(r) for r in responses], [1.0, 0.0, 0.5],
                            grpo.group_advantages([1.0, 0.0, 0.5]).tolist()))
    return groups


@pytest.fixture(scope="module")
def micro_batches(tokenizer):
    """The three groups cut into micro-batches of at most 24 packed tokens, as fp64 inputs."""
    return [mb.build(shared=True, dtype=torch.float64)
            for mb in split_groups(make_groups(len(tokenizer)), max_tokens=24)]


def policy_model(tokenizer, preset: str = "qwen2-1m"):
    return build_model(ModelConfig(name_or_path=preset, dtype="float64", device="cpu", seed=0), tokenizer)


def cfg_of(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**{"lr": 1e-2, "max_grad_norm": 0.0, **kw})


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pb = dict(b.named_parameters())
    return all(torch.equal(p, pb[n]) for n, p in a.named_parameters())


def run_step(tri: TriModel, mbs, opt) -> dict:
    acc = grpo.LossAccumulator.from_config(tri.cfg)
    for inp in mbs:
        tri.micro_step(inp, acc)
    return tri.optimizer_step(opt, acc)


def test_ratio_is_one_with_single_step(tokenizer, micro_batches):
    """One optimizer step per iteration: the skipped old forward gives old = policy (ratio exactly 1,
    no old copy allocated); the general path's old forward gives bit-identical log-probs, and both
    paths give the same gradient."""
    packed = micro_batches[0].packed
    skip = TriModel(policy_model(tokenizer), cfg_of(skip_old_forward=True))
    assert skip.skip_old and skip.old is None
    out = skip.forward(packed)
    assert not out.old_N.requires_grad and out.policy_N.requires_grad
    assert torch.equal(torch.exp(out.policy_N - out.old_N), torch.ones_like(out.old_N))

    full = TriModel(policy_model(tokenizer), cfg_of(skip_old_forward=False))
    assert not full.skip_old and full.old is not None
    out_full = full.forward(packed)
    assert torch.equal(out_full.old_N, out_full.policy_N.detach())
    assert torch.equal(out_full.policy_N.detach(), out.policy_N.detach())

    grads = []
    for tri in (skip, full):
        acc = grpo.LossAccumulator("token-mean")
        for inp in micro_batches:
            tri.micro_step(inp, acc)
        acc.finalize_gradients(tri.policy.parameters())
        grads.append({n: p.grad for n, p in tri.policy.named_parameters()})
        assert acc.metrics()["clip_frac"] == 0.0
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_skip_old_forward_needs_single_step(tokenizer):
    """With several optimizer steps per iteration old != policy after the first: the flag is ignored."""
    tri = TriModel(policy_model(tokenizer), cfg_of(skip_old_forward=True, optimizer_steps_per_iteration=2))
    assert not tri.skip_old and tri.old is not None


def test_old_refreshes_at_barrier(tokenizer, micro_batches):
    """Two optimizer steps in one iteration: old keeps theta_t (its log-probs do not move) while the
    policy moves; `refresh_old` copies the policy into the same tensors (no new allocation), after which
    old and policy agree exactly."""
    tri = TriModel(policy_model(tokenizer), cfg_of(skip_old_forward=True, optimizer_steps_per_iteration=2))
    opt = torch.optim.SGD(tri.policy.parameters(), lr=0.5)
    theta_t = params_of(tri.policy)
    old_ptrs = {n: p.data_ptr() for n, p in tri.old.named_parameters()}
    old_N_before = tri.forward(micro_batches[0].packed).old_N
    for step in range(2):  # two optimizer steps inside one iteration
        run_step(tri, micro_batches, opt)
        out = tri.forward(micro_batches[0].packed)
        assert torch.equal(out.old_N, old_N_before)
        assert not torch.equal(out.policy_N.detach(), out.old_N)
    assert all(torch.equal(p, theta_t[n]) for n, p in tri.old.named_parameters())
    assert not same_params(tri.old, tri.policy)
    tri.refresh_old()  # the barrier
    assert same_params(tri.old, tri.policy)
    assert {n: p.data_ptr() for n, p in tri.old.named_parameters()} == old_ptrs
    assert all(not p.requires_grad for p in tri.old.parameters())
    out = tri.forward(micro_batches[0].packed)
    assert torch.equal(out.old_N, out.policy_N.detach())
    assert tri.old.model.embed_tokens.weight is tri.old.lm_head.weight  # tied weights stay tied


def test_ref_never_changes(tokenizer, micro_batches):
    """beta > 0: over several iterations (steps + barriers) the reference keeps the initial weights and
    log-probs, gets no gradient, while the policy moves away (KL > 0)."""
    tri = TriModel(policy_model(tokenizer), cfg_of(beta=0.1, skip_old_forward=True))
    opt = torch.optim.AdamW(tri.policy.parameters(), lr=1e-2)
    theta_0 = params_of(tri.policy)
    ref_N_0 = tri.forward(micro_batches[0].packed).ref_N
    for iteration in range(3):
        metrics = run_step(tri, micro_batches, opt)
        assert all(p.grad is None for p in tri.ref.parameters())
        tri.refresh_old()
    assert all(torch.equal(p, theta_0[n]) for n, p in tri.ref.named_parameters())
    out = tri.forward(micro_batches[0].packed)
    assert torch.equal(out.ref_N, ref_N_0)
    assert not torch.equal(out.policy_N.detach(), out.ref_N)
    assert metrics["kl"] > 0


def test_beta_zero_has_no_reference(tokenizer, micro_batches):
    """beta == 0: no reference copy, no reference forward."""
    tri = TriModel(policy_model(tokenizer), cfg_of(beta=0.0))
    assert tri.ref is None and tri.forward(micro_batches[0].packed).ref_N is None


@pytest.mark.parametrize("beta,skip,copies", [(0.1, False, 3), (0.1, True, 2), (0.0, False, 2), (0.0, True, 1)])
def test_memory_counts_parameter_bytes(tokenizer, beta, skip, copies):
    """fp64: 8 bytes per unique parameter per allocated model; skipped models cost nothing."""
    tri = TriModel(policy_model(tokenizer), cfg_of(beta=beta, skip_old_forward=skip))
    m = tri.memory()
    one = 8 * num_parameters(tri.policy)
    assert m["policy_bytes"] == one
    assert m["old_bytes"] == (0 if skip else one) and m["ref_bytes"] == (one if beta > 0 else 0)
    assert m["total_bytes"] == copies * one


def test_logprob_kwargs_reach_token_logprobs(tokenizer, micro_batches, monkeypatch):
    """Extra kwargs (e.g. an attention back-end) go to every `token_logprobs` call; none by default."""
    seen = []
    real = trimodel.token_logprobs

    def spy(model, batch, **kw):
        seen.append(dict(kw))
        kw.pop("backend", None)
        return real(model, batch, **kw)

    monkeypatch.setattr(trimodel, "token_logprobs", spy)
    cfg = cfg_of(beta=0.1, skip_old_forward=False)
    TriModel(policy_model(tokenizer), cfg).forward(micro_batches[0].packed, with_entropy=False)
    assert seen == [{}, {}, {}]
    seen.clear()
    TriModel(policy_model(tokenizer), cfg, logprob_kwargs={"backend": "split"}).forward(micro_batches[0].packed)
    assert seen == [{"with_entropy": True, "backend": "split"}, {"backend": "split"}, {"backend": "split"}]


def test_attention_backends_agree_through_trimodel(tokenizer, micro_batches):
    """logprob_kwargs={'backend': 'split'} runs all three models on the split shared-prompt attention;
    their log-probs and the accumulated gradient equal the dense-mask path (fp64, <= 1e-12)."""
    results = {}
    for backend in ("dense", "split"):
        tri = TriModel(policy_model(tokenizer), cfg_of(beta=0.1, skip_old_forward=False),
                       logprob_kwargs={"backend": backend})
        outs = [tri.forward(inp.packed) for inp in micro_batches]
        acc = grpo.LossAccumulator("seq-mean")
        for inp in micro_batches:
            tri.micro_step(inp, acc)
        acc.finalize_gradients(tri.policy.parameters())
        results[backend] = outs, {n: p.grad for n, p in tri.policy.named_parameters()}
    (dense, g_dense), (split, g_split) = results["dense"], results["split"]
    for a, b in zip(dense, split):
        for field in ("policy_N", "old_N", "ref_N"):
            assert (getattr(a, field).detach() - getattr(b, field).detach()).abs().max() <= 1e-12
    assert max((g_dense[n] - g_split[n]).abs().max().item() for n in g_dense) <= 1e-12


def test_trainer_logprobs_match_engine_at_temperature(tokenizer):
    """At temperature 0.7 with top-p 0.9 the trainer (the consumer's tri-model, temperature
    threaded from engine.temperature) scores the sampled tokens exactly as the engine reported
    them: log_softmax(logits / T), same weights, gap < 1e-5 in fp32. Negative control: scoring
    the raw logits (T = 1), as before, gives a gap thousands of times larger."""
    import copy

    from periodic_async.config import RunConfig, load_config
    from periodic_async.consumer import Consumer
    from periodic_async.engine import Request, SamplingParams
    from periodic_async.engine.local import LocalEngine

    cfg = load_config(RunConfig, None, ["engine.temperature=0.7", "engine.top_p=0.9", "model.device=cpu",
                                        "algorithm.group_size=4", "algorithm.attention_backend=split"])
    policy = build_model(ModelConfig(name_or_path="qwen2-1m", device="cpu", seed=1), tokenizer)
    with torch.no_grad():  # sharper than the random init (std 0.02): the temperature matters
        for p in policy.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    engine = LocalEngine(copy.deepcopy(policy), tokenizer, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9)
    prompts = [tokenizer("Ava has 3 apples. How many?").input_ids, tokenizer("Ben finds 2 pens.").input_ids]
    outs = list(engine.generate([Request(f"r{i}", p, 4, params, seed=i) for i, p in enumerate(prompts)]))
    groups = [Group(i, 0, 0, prompts[int(o.request_id[1:])], [s.token_ids for s in o.samples],
                    [s.logprobs for s in o.samples], [0.0] * 4, [0.0] * 4) for i, o in enumerate(outs)]
    (mb,) = split_groups(groups, max_tokens=4096)
    inputs = mb.build(shared=True)
    assert inputs.num_tokens >= 60

    consumer = Consumer(policy, cfg)
    with torch.no_grad():
        trainer_N = consumer.tri.forward(inputs.packed, with_entropy=False).policy_N
        raw_N = TriModel(policy, cfg.algorithm, logprob_kwargs={"backend": "split"}).forward(
            inputs.packed, with_entropy=False).policy_N
    gap = (trainer_N - inputs.behaviour_logp_N).abs()
    raw_gap = (raw_N - inputs.behaviour_logp_N).abs()
    assert gap.max() < 1e-5, gap.max()
    assert raw_gap.mean() > 1e-2, raw_gap.mean()


def test_behaviour_is_on_policy_is_numerics_only(tokenizer):
    """The engines' importance ratio (algorithm.behaviour_is, TRL's vLLM correction) on samples of
    the built-in engine (float32, the trainer's weights): on-policy it is 1 within 1e-4 for every
    sequence, and the gradient moves by numerics only (relative 1e-4); in async-offpolicy the old
    log-probs are the behaviour's, so the ratio is exactly 1."""
    import copy

    from periodic_async.engine import Request, SamplingParams
    from periodic_async.engine.local import LocalEngine

    policy = build_model(ModelConfig(name_or_path="qwen2-1m", device="cpu", seed=1), tokenizer)
    engine = LocalEngine(copy.deepcopy(policy), tokenizer, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=1.0)
    prompts = [tokenizer("Ava has 3 apples. How many?").input_ids, tokenizer("Ben finds 2 pens.").input_ids]
    outs = list(engine.generate([Request(f"r{i}", p, 4, params, seed=i) for i, p in enumerate(prompts)]))
    groups = [Group(i, 0, 0, prompts[int(o.request_id[1:])], [s.token_ids for s in o.samples],
                    [s.logprobs for s in o.samples], [1.0, 0.0, 0.5, 0.2],
                    grpo.group_advantages([1.0, 0.0, 0.5, 0.2]).tolist()) for i, o in enumerate(outs)]
    (inputs,) = [mb.build(shared=True) for mb in split_groups(groups, max_tokens=4096)]

    def gradient(tri: TriModel) -> tuple[torch.Tensor, dict]:
        tri.policy.zero_grad(set_to_none=True)
        acc = grpo.LossAccumulator("token-mean")
        tri.micro_step(inputs, acc)
        acc.finalize_gradients(tri.policy.parameters())
        return torch.cat([p.grad.flatten() for p in tri.policy.parameters()]), acc.metrics()

    plain, _ = gradient(TriModel(policy, cfg_of()))
    corrected, m = gradient(TriModel(policy, cfg_of(behaviour_is="sequence_mask", behaviour_is_min=0.5)))
    assert abs(m["is_ratio_min"] - 1) < 1e-4 and abs(m["is_ratio_max"] - 1) < 1e-4 and m["is_ratio_cut"] == 0
    assert (corrected - plain).norm() < 1e-4 * plain.norm()
    _, off = gradient(TriModel(policy, cfg_of(behaviour_is="token_truncate"), old_from_behaviour=True))
    assert off["is_ratio_min"] == off["is_ratio_max"] == 1.0


@pytest.mark.parametrize("preset", ["qwen2-1m", "llama-micro"])
def test_shared_prompt_packing_matches_per_response_through_the_tri_model(tokenizer, preset):
    """After one optimizer step (so policy, old and ref all differ: ratio != 1, KL != 0), the policy,
    old and ref log-probs of every token and the accumulated policy gradient are the same whether the
    groups are packed with their prompt once or once per response, and however they are cut into
    micro-batches (fp64, atol 1e-10)."""
    groups = make_groups(len(tokenizer))
    tri = TriModel(policy_model(tokenizer, preset),
                   cfg_of(beta=0.1, skip_old_forward=True, optimizer_steps_per_iteration=2))
    assert tri.old is not None and tri.ref is not None
    run_step(tri, [mb.build(shared=True, dtype=torch.float64) for mb in split_groups(groups, max_tokens=24)],
             torch.optim.SGD(tri.policy.parameters(), lr=0.5))
    results = {}
    for shared, budget in ((True, 24), (False, 24), (False, 0)):  # 0: two whole groups per micro-batch
        mbs = [mb.build(shared=shared, dtype=torch.float64)
               for mb in split_groups(groups, max_tokens=budget, groups_per_micro_batch=2, shared=shared)]
        logps = {k: [] for k in ("labels", "policy", "old", "ref")}  # flat (group, sample, token) order
        acc = grpo.LossAccumulator.from_config(tri.cfg)
        for inp in mbs:
            out = tri.forward(inp.packed)
            for k, v in (("labels", inp.packed.labels_N), ("policy", out.policy_N), ("old", out.old_N),
                         ("ref", out.ref_N)):
                logps[k].extend(v.detach().tolist())
            tri.micro_step(inp, acc)
        acc.finalize_gradients(list(tri.policy.parameters()))
        grads = {n: p.grad.clone() for n, p in tri.policy.named_parameters()}
        tri.policy.zero_grad(set_to_none=True)
        results[(shared, budget)] = (logps, grads, acc.metrics(), len(mbs))
    (ref_logps, ref_grads, ref_metrics, _), *others = results.values()
    assert len({r[3] for r in results.values()}) == 3  # three different cuts into micro-batches
    assert ref_metrics["kl"] > 1e-6 and not torch.allclose(torch.tensor(ref_logps["policy"]),
                                                           torch.tensor(ref_logps["old"]), atol=1e-6)
    for logps, grads, metrics, _ in others:
        assert logps["labels"] == ref_logps["labels"]
        for k in ("policy", "old", "ref"):
            torch.testing.assert_close(torch.tensor(logps[k]), torch.tensor(ref_logps[k]), rtol=0, atol=1e-10)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=1e-10, msg=lambda m: f"{n}: {m}")
        assert abs(metrics["kl"] - ref_metrics["kl"]) < 1e-10
