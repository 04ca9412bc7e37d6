"""Episodes on the built-in engine (src/periodic_async/episode/runner.py, continuer.py, pack.py, record.py):
token in, token out (every model turn is what the engine samples from exactly the episode's ids),
the loss mask and its gradient, the per-token log-probs of packed episodes against an independent
per-episode computation, tool calls from a tiny model taught the plain-text format (good, unknown,
with bad arguments, raising, hanging, answering a non-string), and the limits."""

import asyncio
import copy
import dataclasses
import functools
import time

import pytest
import torch

from periodic_async.config import ModelConfig
from periodic_async.engine import Request, SamplingParams
from periodic_async.engine.local import LocalEngine
from periodic_async.episode import (Environments, EpisodeError, EpisodeLimits, EpisodeRunner, GroupSpec, ProtocolError,
                                    FeedContinuer, WaveContinuer, episode_group, loss_mask_N, turn_seed)
from periodic_async.episode.envs import CalculatorEnv, Latency
from periodic_async.episode.formats import PlainTextFormat, encode_conversation, format_call
from periodic_async.episode.record import ENV, MODEL, Episode, Turn
from periodic_async.model import build_model
from periodic_async.shared_prompt import pack, token_logprobs
from helpers import teach

QUESTION = [{"role": "user", "content": "What is 3+4?"}]
ROW = {"question": "3+4", "answer": "7"}
FEEDBACK_LIMITS = EpisodeLimits(max_turns=3, max_tokens=120, max_turn_tokens=12)
FEEDBACK_PARAMS = SamplingParams(max_tokens=12, temperature=1.0, stop=["e"])  # 'e' ends many turns early


class Recording:
    """A continuer that remembers the requests it passed on (to the real engine's continuer)."""

    def __init__(self, inner):
        self.inner, self.requests = inner, []

    async def __call__(self, request):
        self.requests.append(request)
        return await self.inner(request)


def _specs(n_groups=2, g=3):
    return [GroupSpec(i, [{"role": "user", "content": f"What is {i}+3?"}], {"question": f"{i}+3", "answer": str(i + 3)},
                      g, 100 + i, f"g{i}") for i in range(n_groups)]


@pytest.fixture(scope="module")
def fp64(tokenizer):
    """A float64 qwen2-micro, its engine, and the episodes of a verifier environment (3 attempts,
    latency scaled down) run through both continuers."""
    policy = build_model(ModelConfig(name_or_path="qwen2-micro", device="cpu", dtype="float64", seed=1), tokenizer)
    engine = LocalEngine(copy.deepcopy(policy), tokenizer, max_num_seqs=6)
    envs = Environments(CalculatorEnv.factory(latency=Latency(scale=0.005), attempts=3))
    runs = {}
    for name, cls in (("wave", WaveContinuer), ("feed", FeedContinuer)):
        with cls(engine) as cont:
            rec = Recording(cont)
            runner = EpisodeRunner(tokenizer, rec, envs, FEEDBACK_PARAMS, FEEDBACK_LIMITS, tool_format="plain")
            runs[name] = (runner.run(_specs()), rec.requests)
    return policy, engine, runs


def test_feedback_episodes_are_multi_turn_and_counted(fp64, tokenizer):
    """The verifier answers every reply: episodes hold model and environment turns alternately,
    the mask is 1 exactly on model tokens, the counts add up, every model turn is tagged with the
    engine's version, and both continuers give the same episodes."""
    _, engine, runs = fp64
    episodes = [ep for eps in runs["wave"][0].values() for ep in eps]
    assert max(ep.num_turns for ep in episodes) >= 2 and sum(ep.feedback_turns for ep in episodes) >= 3
    for ep in episodes:
        assert [t.source for t in ep.turns] == [MODEL, ENV] * (len(ep.turns) // 2) + [MODEL] * (len(ep.turns) % 2)
        assert ep.loss_mask == [1 if t.source == MODEL else 0 for t in ep.turns for _ in t.token_ids]
        assert ep.num_model_tokens + ep.num_env_tokens == len(ep.completion_ids) == len(ep.logprobs)
        assert ep.versions == {engine.version} and ep.failure is None and ep.env_reward == 0.0
        assert ep.num_turns <= FEEDBACK_LIMITS.max_turns and len(ep.completion_ids) <= FEEDBACK_LIMITS.max_tokens
    assert {ep.truncated for ep in episodes} <= {None, "max_turns", "token_budget", "turn_length"}
    ids = {k: [ep.token_ids for ep in eps] for k, eps in runs["wave"][0].items()}
    assert ids == {k: [ep.token_ids for ep in eps] for k, eps in runs["feed"][0].items()}


def test_token_in_token_out(fp64, tokenizer):
    """Every model turn is exactly what the engine samples when asked, on its own, to continue the
    episode's ids so far with the turn's seed (a group's first turn: one request of G samples);
    the episode's ids are the prompt and the turns concatenated, never re-tokenised: a decode and
    encode round trip changes some turns' ids (the precondition), and the ids are kept as sampled."""
    _, engine, runs = fp64
    changed = 0
    for spec, (key, eps) in zip(_specs(), runs["wave"][0].items()):
        first = next(engine.generate([Request("first", eps[0].prompt_ids, spec.n, FEEDBACK_PARAMS, spec.seed)]))
        for ep in eps:
            context, used = list(ep.prompt_ids), 0
            for t, turn in enumerate(ep.turns):
                if turn.source == MODEL:
                    n_turn = sum(x.source == MODEL for x in ep.turns[:t])
                    params = dataclasses.replace(FEEDBACK_PARAMS, max_tokens=min(12, 120 - used))
                    sample = first.samples[ep.index] if t == 0 else next(engine.generate(
                        [Request("x", context, 1, params, turn_seed(spec.seed, ep.index, n_turn))])).samples[0]
                    assert (sample.token_ids, sample.logprobs) == (turn.token_ids, turn.logprobs)
                    changed += tokenizer(turn.text, add_special_tokens=False).input_ids != turn.token_ids
                context += turn.token_ids
                used += len(turn.token_ids)
            assert context == ep.token_ids == ep.prompt_ids + ep.completion_ids
    assert changed > 0
    contexts = [r.prompt_ids for r in runs["wave"][1]]
    assert all(any(ep.token_ids[:len(c)] == c for eps in runs["wave"][0].values() for ep in eps) for c in contexts)


def test_packed_episode_logprobs_equal_a_per_episode_computation(fp64):
    """Shared-prompt packing of each group's episodes (environment tokens in the responses) gives,
    on model tokens, the log-probs of an independent forward of each whole episode alone (float64:
    1e-10), and the engine's behaviour log-probs (its sampler's log-softmax runs in float32: 1e-6)."""
    policy, _, runs = fp64
    groups = [episode_group(eps) for eps in runs["wave"][0].values()]
    packed = pack([g.segment() for g in groups])
    mask_N = loss_mask_N(groups, torch.float64).bool()
    with torch.no_grad():
        logp_N = token_logprobs(policy, packed)
        alone = []
        for eps in runs["wave"][0].values():
            for ep in eps:
                ids = torch.tensor([ep.token_ids])
                logp = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].double(), -1)
                alone += logp.gather(1, ids[0, 1:, None])[len(ep.prompt_ids) - 1:, 0][torch.tensor(ep.loss_mask).bool()]
    behaviour = torch.tensor([lp for g in groups for lps in g.behaviour_logprobs for lp in lps], dtype=torch.float64)
    assert int(mask_N.sum()) == len(alone) == sum(ep.num_model_tokens for eps in runs["wave"][0].values() for ep in eps)
    assert torch.allclose(logp_N[mask_N], torch.stack(alone), atol=1e-10, rtol=0)
    assert torch.allclose(logp_N[mask_N], behaviour[mask_N], atol=1e-6, rtol=0)
    assert (behaviour[~mask_N] == 0).all()


def test_environment_tokens_get_zero_gradient(fp64):
    """The masked GRPO-style loss, sum(mask * A * logp), sends zero gradient into the logits that
    predict environment tokens and a non-zero one into those of model tokens; environment tokens
    are still in the context (their input embeddings get a gradient through later model tokens).
    Negative control: without the mask the environment positions get a gradient."""
    policy, _, runs = fp64
    groups = [episode_group(eps) for eps in runs["wave"][0].values()]
    packed = pack([g.segment() for g in groups])
    mask_N = loss_mask_N(groups, torch.float64)
    adv_N = torch.linspace(-1, 1, len(mask_N), dtype=torch.float64)
    # where environment tokens are fed as input: the position that predicts the next label of their sample
    s_N, pred_N = packed.sample_N, packed.pred_pos_N
    env_inputs = torch.tensor([int(pred_N[n + 1]) for n in range(len(mask_N) - 1)
                               if mask_N[n] == 0 and s_N[n + 1] == s_N[n]])
    grads = {}
    for name, m_N in (("masked", mask_N), ("control", torch.ones_like(mask_N))):
        seen = {}
        def keep(name):
            return lambda mod, inputs, out: seen.update({name: out}) or out.retain_grad()
        h1 = policy.get_output_embeddings().register_forward_hook(keep("logits"))
        h2 = policy.get_input_embeddings().register_forward_hook(keep("emb"))
        try:
            logp_N = token_logprobs(policy, packed, backend="dense")
            (-(m_N * adv_N * logp_N).sum()).backward()
        finally:
            h1.remove(), h2.remove()
            policy.zero_grad(set_to_none=True)
        grads[name] = (seen["logits"].grad.abs().sum(-1), seen["emb"].grad[0].abs().sum(-1))
    logits_g, emb_g = grads["masked"]
    assert (logits_g[mask_N == 0] == 0).all() and (logits_g[mask_N == 1] > 0).all()
    assert (emb_g[env_inputs] > 0).any()  # environment tokens as context
    assert (grads["control"][0][mask_N == 0] > 0).all()


def _groups_of(runs, masked: bool = True):
    """The trainer's `Group`s of the episodes (advantages of both signs; behaviour log-probs 0.0 on
    environment tokens); masked=False drops the loss mask (the negative control)."""
    from periodic_async.group import Group

    out = []
    for b, eps in enumerate(runs["wave"][0].values()):
        g = episode_group(eps)
        adv = [(-1.0) ** k * (k + 1) / 3 for k in range(len(eps))]
        out.append(Group(b, 0, 0, g.prompt_ids, g.response_ids, g.behaviour_logprobs, [0.0] * len(eps), adv,
                         loss_mask=g.loss_mask if masked else None))
    return out


@pytest.mark.parametrize("loss_norm", ["token-mean", "seq-mean"])
def test_environment_tokens_get_no_gradient_through_the_trimodel(fp64, loss_norm):
    """Through the trainer's own path (batching.MicroBatch.build, TriModel.micro_step, the GRPO
    accumulator): the logits that predict environment tokens get exactly zero gradient, those of
    model tokens a non-zero one; the loss sum is the independent -sum over model tokens of
    A_i * w_i (ratio 1: one optimizer step), with w_i = 1 or 1 / (model tokens of episode i); the
    accumulator counts model tokens only, and the behaviour gap is taken over them (~1e-6).
    Negative control: the same groups without their mask send gradient into environment positions."""
    from periodic_async import grpo
    from periodic_async.batching import split_groups
    from periodic_async.config import AlgorithmConfig
    from periodic_async.trimodel import TriModel

    policy, _, runs = fp64
    cfg = AlgorithmConfig(loss_norm=loss_norm, beta=0.0, micro_batch_tokens=0, micro_batch_groups=2)
    grads = {}
    for masked in (True, False):
        groups = _groups_of(runs, masked)
        (mb,) = split_groups(groups, 0, 2)
        inputs = mb.build(dtype=torch.float64)
        tri = TriModel(policy, cfg, logprob_kwargs={"backend": "dense"})
        acc = grpo.LossAccumulator.from_config(cfg)
        seen = {}
        hook = policy.get_output_embeddings().register_forward_hook(
            lambda mod, i, out: seen.update(logits=out) or out.retain_grad())
        try:
            sums = tri.micro_step(inputs, acc)
        finally:
            hook.remove()
        grads[masked] = seen["logits"].grad.abs().sum(-1)
        policy.zero_grad(set_to_none=True)
        if masked:
            mask_N = inputs.loss_mask_N  # laid out as episode/pack.py lays it out for `pack`
            assert mask_N.tolist() == loss_mask_N([episode_group(e) for e in runs["wave"][0].values()]).tolist()
            model_tokens = [sum(m) for g in groups for m in g.loss_mask]
            weights = [1.0 if loss_norm == "token-mean" else 1.0 / max(n, 1) for n in model_tokens]
            want = -sum(a * n * w for a, n, w in zip([a for g in groups for a in g.advantages], model_tokens, weights))
            assert float(sums["loss"]) == pytest.approx(want, abs=1e-12)
            assert acc.num_tokens == sum(model_tokens) < len(mask_N) and acc.num_sequences == 6
            assert float(sums["behaviour_gap"]) / sum(model_tokens) < 1e-5
    assert (grads[True][mask_N == 0] == 0).all() and (grads[True][mask_N == 1] > 0).all()
    assert (grads[False][mask_N == 0] > 0).all()


def test_group_with_different_prompts_and_a_failure(tokenizer):
    """Episodes whose prompts differ (reset said different things) share their common prefix; the
    rest of each prompt is in its response with mask 0; a failed episode keeps its slot, all masked,
    with one token even when it has no turn."""
    a = Episode([5, 6, 7, 8], [Turn(MODEL, [9, 10], [-0.5, -0.25]), Turn(ENV, [11]), Turn(MODEL, [12], [-1.0])])
    b = Episode([5, 6, 3], [Turn(MODEL, [4], [-2.0])])
    failed = Episode([5, 6, 7, 8], failure="CalculatorEnv.reset raised KeyError: 'answer'")
    g = episode_group([a, b, failed])
    assert g.prompt_ids == [5, 6] and g.response_ids == [[7, 8, 9, 10, 11, 12], [3, 4], [7, 8]]
    assert g.loss_mask == [[0, 0, 1, 1, 0, 1], [0, 1], [0, 0]] and g.num_loss_tokens == [3, 1, 0]
    assert g.behaviour_logprobs[0] == [0.0, 0.0, -0.5, -0.25, 0.0, -1.0]
    assert pack([g.segment()]).labels_N.tolist() == [t for r in g.response_ids for t in r]
    g = episode_group([a, failed])  # equal prompts: the shared prefix stops one token short of the failed one
    assert g.prompt_ids == [5, 6, 7] and g.response_ids == [[8, 9, 10, 11, 12], [8]]
    assert g.loss_mask == [[0, 1, 1, 0, 1], [0]]


# --- tools: a tiny model taught the plain-text call format ------------------------------------

def calculator(x: str) -> str:
    """Evaluate.

    Args:
        x: The expression.
    """
    return x


def add(a: int, b: int) -> str:
    """Add.

    Args:
        a: a
        b: b
    """
    return str(a + b)


def _variant(name, body):
    """A CalculatorEnv whose calculator does `body` (same schema, so the same prompt)."""
    @functools.wraps(CalculatorEnv.calculator)  # name, docstring, hints
    def calculator(self, expression: str) -> str:
        return body(self, expression)
    return type(name, (CalculatorEnv,), {"calculator": calculator})


Hanging = _variant("Hanging", lambda self, e: time.sleep(30) or "late")
Raising = _variant("Raising", lambda self, e: (_ for _ in ()).throw(RuntimeError("boom")))
Numeric = _variant("Numeric", lambda self, e: 7)


@pytest.fixture(scope="module")
def caller(tokenizer_dir):
    """qwen2-micro (float32) taught, in 60 Adam steps on four sequences, to answer QUESTION with
    <tool_call>calculator(expression='3+4')</tool_call> whatever the tools shown, and after the
    answer 7 to write <answer>7</answer>; its engine."""
    from periodic_async.model import load_policy

    policy, tok = load_policy(ModelConfig(name_or_path="qwen2-micro", tokenizer=str(tokenizer_dir), device="cpu"))
    fmt = PlainTextFormat(tok)
    eos = [tok.eos_token_id]
    call = tok(format_call("calculator", {"expression": "3+4"}), add_special_tokens=False).input_ids + eos
    prompts = [fmt.prompt_ids(QUESTION, e.schemas()) for e in
               (Environments(CalculatorEnv), Environments(tools=[add]), Environments(tools=[calculator]))]
    answer = tok("<answer>7</answer>", add_special_tokens=False).input_ids + eos
    tool_turn = fmt.env_ids(fmt.answer_messages([("calculator", "7")]))
    batch = [(p, call) for p in prompts] + [(prompts[0] + call + tool_turn, answer)]
    teach(policy, batch, tok.pad_token_id, steps=60)
    return LocalEngine(policy.eval(), tok, max_num_seqs=4), tok


def _tool_episode(caller, envs, **limits) -> Episode:
    engine, tok = caller
    with FeedContinuer(engine) as cont:
        runner = EpisodeRunner(tok, cont, envs, SamplingParams(max_tokens=60, temperature=0.0),
                               EpisodeLimits(**{"max_turns": 4, "max_tokens": 300, "max_turn_tokens": 60, **limits}),
                               tool_format="plain")
        return asyncio.run(runner.run_group(GroupSpec(0, QUESTION, ROW, 1, 0, "t")))[0]


def test_tool_call_episode(caller):
    """The taught model calls the calculator, reads its answer, answers; the verifier finds it
    right: two model turns around one tool turn, reward 1, the call counted."""
    ep = _tool_episode(caller, Environments(CalculatorEnv.factory(latency=Latency(scale=0.01))))
    assert [t.finish_reason for t in ep.turns] == ["stop", "tool", "stop"]
    assert ep.turns[1].text == "<tool_response>\n7\n</tool_response>"
    assert ep.turns[2].text == "<answer>7</answer>" and ep.env_reward == 1.0
    assert (ep.tool_calls, ep.bad_calls, ep.tool_errors, ep.failure, ep.truncated) == (1, 0, 0, None, None)
    assert ep.messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                             "arguments": {"expression": "3+4"}}}]


def test_bad_calls_are_answered_with_the_error_and_counted(caller):
    """A call to a tool that does not exist, or with arguments the tool does not take, is answered
    with the error text as the tool's answer (TRL's behaviour) and counted; the episode goes on."""
    for envs, words in [(Environments(tools=[add]), "error: unknown tool 'calculator'; the tools are add"),
                        (Environments(tools=[calculator]), "error: tool calculator: missing a required argument: 'x'")]:
        ep = _tool_episode(caller, envs)
        assert (ep.tool_calls, ep.bad_calls, ep.failure) == (1, 1, None)
        assert ep.turns[1].source == ENV and words in ep.turns[1].text and ep.num_turns == 2


def test_tool_failures_end_the_episode_or_stop_the_run(caller):
    """A hanging tool ends its episode as a failure within the call timeout (the test does not
    hang), or raises with on_failure='raise'; a tool that raises is answered with the error
    (tool_errors) or, with tool_exceptions='fail', fails the episode; a non-string answer stops the run."""
    t = time.perf_counter()
    ep = _tool_episode(caller, Environments(Hanging), call_timeout_s=0.3)
    assert time.perf_counter() - t < 10 and ep.failure == "tool calculator timed out after 0.3 s"
    assert ep.env_reward is None and ep.num_turns == 1
    with pytest.raises(EpisodeError, match="episode 0: tool calculator timed out"):
        _tool_episode(caller, Environments(Hanging), call_timeout_s=0.3, on_failure="raise")
    ep = _tool_episode(caller, Environments(Raising))
    assert ep.tool_errors == 1 and ep.failure is None and "error: RuntimeError: boom" in ep.turns[1].text
    ep = _tool_episode(caller, Environments(Raising), tool_exceptions="fail")
    assert ep.failure == "tool calculator raised RuntimeError: boom"
    with pytest.raises(EpisodeError, match="tool calculator returned a int"):
        _tool_episode(caller, Environments(Numeric))


def test_limits_truncate(caller):
    """max_turns=1: the call is not run and the episode is truncated 'max_turns'; a token budget
    with no room after the tool's answer drops it ('token_budget'); a turn cut by max_turn_tokens
    is 'turn_length'."""
    envs = Environments(CalculatorEnv)
    ep = _tool_episode(caller, envs, max_turns=1)
    assert (ep.truncated, ep.tool_calls, ep.num_turns) == ("max_turns", 0, 1)
    first = len(ep.completion_ids)
    ep = _tool_episode(caller, envs, max_tokens=first + 5)
    assert (ep.truncated, ep.tool_calls, len(ep.turns)) == ("token_budget", 1, 1)
    ep = _tool_episode(caller, envs, max_turn_tokens=5)
    assert (ep.truncated, ep.num_model_tokens) == ("turn_length", 5)


class SlowVerifier(CalculatorEnv):
    def feedback(self, reply):
        time.sleep(30)


def test_environment_failures_during_feedback_and_reset(fp64, tokenizer):
    """A feedback() that hangs, or a reset() that raises (a row without `answer`), fails its
    episodes (counted, with one line) and the group still completes, within the timeout."""
    _, engine, _ = fp64
    envs = Environments(SlowVerifier)
    t = time.perf_counter()
    with WaveContinuer(engine) as cont:
        runner = EpisodeRunner(tokenizer, cont, envs, FEEDBACK_PARAMS,
                               dataclasses.replace(FEEDBACK_LIMITS, call_timeout_s=0.3), tool_format="plain")
        slow = runner.run(_specs(1, 2))[0]
        broken = asyncio.run(runner.run_group(GroupSpec(0, QUESTION, {"question": "q"}, 2, 0, "b")))
    assert time.perf_counter() - t < 20
    stopped = [ep for ep in slow if ep.turns[0].finish_reason == "stop"]  # a reply the verifier is asked about
    assert stopped and all(ep.failure == "SlowVerifier.feedback timed out after 0.3 s" for ep in stopped)
    assert all(ep.failure.startswith("SlowVerifier.reset raised KeyError") and not ep.turns for ep in broken)


class SlowOnZero(CalculatorEnv):
    """A verifier that takes 1.5 s to answer question 0+3, and no time for the others."""

    def feedback(self, reply):
        if self.question == "0+3":
            time.sleep(1.5)
        return super().feedback(reply)


@pytest.mark.parametrize("continuer", [FeedContinuer, WaveContinuer])
def test_groups_returned_by_on_group_start_at_once(fp64, tokenizer, continuer):
    """run_groups starts the groups that on_group returns (dynamic sampling's replacements) in the
    same call, beside the groups still running: a replacement for the fast group finishes before
    the slow group (its environment waits 1.5 s), where a round after the first would finish
    after it. Every group's episodes are returned, in the order the groups started."""
    _, engine, _ = fp64
    first, replacement = _specs(2), _specs(3)[2]
    order = []

    def on_group(key, episodes):
        order.append(key)
        return [replacement] if key == 1 else []

    with continuer(engine) as cont:
        runner = EpisodeRunner(tokenizer, cont, Environments(SlowOnZero.factory(attempts=3)), FEEDBACK_PARAMS,
                               FEEDBACK_LIMITS, tool_format="plain")
        got = runner.run(first, on_group)
    assert list(got) == [0, 1, 2] and all(len(eps) == 3 for eps in got.values())
    assert any(ep.feedback_turns for ep in got[0]), "the slow group must wait on its environment"
    assert order == [1, 2, 0]


def test_a_recorded_episode_is_encoded_back_from_its_messages(caller):
    """`encode_conversation` (the supervised warm start's input) turns the prompt and an episode's
    messages back into the episode's own ids and loss mask, tool turn included; the same episode
    written as TRL writes it (the call in `tool_calls`, a 'tool' answer) gives the same ids."""
    _, tok = caller
    envs = Environments(CalculatorEnv.factory(latency=Latency(scale=0.01)))
    ep = _tool_episode(caller, envs)
    fmt, schemas = PlainTextFormat(tok), envs.schemas()
    prompt, ids, mask = encode_conversation(fmt, QUESTION + ep.messages, schemas)
    assert prompt == ep.prompt_ids
    assert (ids, mask) == (ep.completion_ids, ep.loss_mask)
    assert mask.count(0) == len(ep.turns[1].token_ids) > 0
    trl = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3+4"}'}}]},
        {"role": "tool", "name": "calculator", "content": "7"}, {"role": "assistant", "content": "<answer>7</answer>"}]
    assert encode_conversation(fmt, trl, schemas) == (prompt, ids, mask)
    with pytest.raises(ProtocolError, match="needs its prompt"):
        encode_conversation(fmt, QUESTION, schemas)
