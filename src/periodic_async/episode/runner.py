"""The episode runner: G episodes of a group, and the groups of an iteration, run concurrently.

One asyncio event loop runs every episode of the iteration. An episode alternates model turns
(an engine request continuing its ids, through a `Continuer`) and environment turns (its tool
calls, or its environment's feedback on a reply): while one episode waits for a tool, the
engine generates the others' turns, and while the engine works the tools run, each call off the
loop under `EpisodeLimits.call_timeout_s` (protocol.call). A group's first turn is one request of
G samples when the G prompts are equal (one prefill; sample k seeded as the engine seeds sample k
of a single-turn request), else one request per episode; every later turn is one request of one
sample seeded by (group seed, k, turn) (`turn_seed`), so the episodes are a pure function of the
weights, the rows and the seeds whatever the timing (on the built-in engine, whose samples do
not depend on the batch).

An episode, as TRL's tool loop runs it: reset(**row) (its string joins the last user message),
the prompt with the tools rendered, then: model turn; the calls it made run in order, their
answers are the next environment turn; a reply that calls nothing is shown to the environment's
feedback() if it has one (a string: the next environment turn; None: the end), else it ends the
episode; at the end get_reward(). Limits: `max_turns` model turns (a turn that wanted more is
truncated 'max_turns'), the token budget (an environment turn that leaves no room for a model
token is dropped: 'token_budget'), `max_turn_tokens` per model turn ('turn_length' when one ends
unfinished). Failures: a timeout, or an exception from the factory, reset, feedback or
get_reward (or from a tool with tool_exceptions='fail'), ends the episode with `failure` set,
or raises an EpisodeError with on_failure='raise'. A tool answer that is not a string always
raises (a programming error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from periodic_async.engine.base import Request, RequestOutput, SamplingParams
from periodic_async.episode.continuer import Continuer
from periodic_async.episode.formats import ToolFormat, make_format
from periodic_async.episode.protocol import CallTimeout, Environments, ProtocolError, Toolbox, call
from periodic_async.episode.record import ENV, MODEL, Episode, EpisodeError, EpisodeLimits, Turn


def turn_seed(seed: int, k: int, turn: int) -> int:
    """The sampling seed of turn `turn` (>= 1) of episode k of a group seeded `seed`."""
    return int(np.random.SeedSequence([seed, k, turn]).generate_state(1)[0]) % (2**31 - 1)


@dataclass
class GroupSpec:
    """One group to run: the prompt's chat messages, its dataset row, G, the seed, a unique id."""
    key: Any
    messages: list[dict]
    row: Mapping[str, Any]
    n: int
    seed: int
    request_id: str


class _Failed(Exception):
    """An episode's failure (a timeout or an environment's exception), one line."""


class EpisodeRunner:
    """Runs episodes; see the module docstring.

    tokenizer: the policy's (chat template, eos, decoding); continuer: the engine (continuer.py);
    environments: `Environments(environment_factory, tools)`; params: the engines' sampling
    parameters (max_tokens is replaced per turn); tool_format: 'template' or 'plain' (formats.py).
    """

    def __init__(self, tokenizer, continuer: Continuer, environments: Environments, params: SamplingParams,
                 limits: EpisodeLimits | None = None, tool_format: ToolFormat = "template"):
        self.tokenizer, self.continuer, self.environments = tokenizer, continuer, environments
        self.params, self.limits = params, limits or EpisodeLimits()
        self.format = make_format(tokenizer, tool_format, needs_tools=environments.has_tools)
        if tokenizer.eos_token_id is None:
            raise ProtocolError("episodes need the tokenizer's eos token (it ends every model turn)")

    # --- many groups --------------------------------------------------------------------------
    async def run_groups(self, specs: Sequence[GroupSpec],
                         on_group: Callable[[Any, list[Episode]], Sequence[GroupSpec] | None] | None = None
                         ) -> dict[Any, list[Episode]]:
        """Every group concurrently; `on_group(key, episodes)` as each group finishes (completion
        order), and the groups it returns (dynamic sampling's replacements) start at once, in the
        same call. Returns {key: episodes} in the order the groups started; one that raises
        cancels the others."""
        started: list[GroupSpec] = []
        results: dict[Any, list[Episode]] = {}
        tasks: set[asyncio.Future] = set()

        def start(more: Sequence[GroupSpec]) -> None:
            started.extend(more)
            tasks.update(asyncio.ensure_future(one(s)) for s in more)

        async def one(spec: GroupSpec) -> None:
            results[spec.key] = episodes = await self.run_group(spec)
            if on_group is not None:
                start(on_group(spec.key, episodes) or ())

        start(specs)
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                tasks.difference_update(done)
                for t in done:
                    t.result()
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        return {s.key: results[s.key] for s in started}

    def run(self, specs: Sequence[GroupSpec], on_group=None) -> dict[Any, list[Episode]]:
        """`run_groups` on a new event loop, from a thread that runs none (the producer's)."""
        return asyncio.run(self.run_groups(specs, on_group))

    # --- one group ----------------------------------------------------------------------------
    async def run_group(self, spec: GroupSpec) -> list[Episode]:
        """The G episodes of one group, in index order."""
        envs = self.environments
        name = envs.name_for(spec.row, where=f"group {spec.request_id}") if envs.factories else None
        starts = await gather([self._start(spec, name, k) for k in range(spec.n)])
        live = [s for s in starts if s[0].failure is None]
        params = self._params(self.limits.budget(len(live[0][0].prompt_ids)) if live else 1)
        first: asyncio.Future | None = None
        if live and len({tuple(ep.prompt_ids) for ep, _ in live}) == 1:  # one prefill for the group
            first = asyncio.ensure_future(self.continuer(Request(
                f"{spec.request_id}-t0", live[0][0].prompt_ids, spec.n, params, spec.seed)))
        return await gather([self._episode(spec, ep, toolbox, first) for ep, toolbox in starts])

    def _params(self, budget_left: int) -> SamplingParams:
        return dataclasses.replace(self.params, max_tokens=min(self.limits.max_turn_tokens, budget_left))

    async def _env_call(self, fn: Callable, kwargs: Mapping[str, Any], what: str) -> Any:
        """An environment call whose exception or timeout is the episode's failure."""
        try:
            return await call(fn, kwargs, self.limits.call_timeout_s, what)
        except CallTimeout as e:
            raise _Failed(str(e)) from None
        except Exception as e:
            raise _Failed(f"{what} raised {type(e).__name__}: {e}") from None

    def _fail(self, ep: Episode, e: _Failed, where: str) -> Episode:
        ep.failure = str(e)
        if self.limits.on_failure == "raise":
            raise EpisodeError(f"{where}: {ep.failure}") from None
        return ep

    async def _start(self, spec: GroupSpec, name: str | None, k: int) -> tuple[Episode, Toolbox]:
        """Episode k's environment (made and reset), toolbox and prompt ids."""
        envs, where = self.environments, f"group {spec.request_id}, episode {k}"
        messages = list(spec.messages)
        ep = Episode(prompt_ids=[], index=k, environment_name=name)
        env = None
        try:
            if envs.factories:
                env = ep.environment = await self._env_call(envs.factories[name], {}, "environment_factory")
                observation = await self._env_call(env.reset, envs.reset_kwargs(spec.row),
                                                   f"{type(env).__name__}.reset")
                if observation is not None:
                    if not isinstance(observation, str):
                        raise EpisodeError(f"{where}: {type(env).__name__}.reset returned a "
                                           f"{type(observation).__name__}; it must return a str or None")
                    last = messages[-1]
                    messages[-1] = {**last, "content": last["content"] + observation}
        except _Failed as e:
            ep.prompt_ids = self.format.prompt_ids(spec.messages, [])
            return self._fail(ep, e, where), Toolbox({})
        ep.prompt_ids = self.format.prompt_ids(messages, envs.schemas(name))
        if self.limits.budget(len(ep.prompt_ids)) < 1:
            e = _Failed(f"the prompt's {len(ep.prompt_ids)} tokens leave no room in the model's context of "
                        f"{self.limits.context}")
            return self._fail(ep, e, where), Toolbox({})
        return ep, envs.toolbox(env)

    async def _episode(self, spec: GroupSpec, ep: Episode, toolbox: Toolbox, first: asyncio.Future | None) -> Episode:
        if ep.failure is not None:
            return ep
        where = f"group {spec.request_id}, episode {ep.index}"
        try:
            await self._turns(spec, ep, toolbox, first)
            get_reward = getattr(ep.environment, "get_reward", None)
            if callable(get_reward):
                reward = await self._env_call(get_reward, {}, f"{type(ep.environment).__name__}.get_reward")
                ep.env_reward = float(reward) if reward is not None else None
        except _Failed as e:
            return self._fail(ep, e, where)
        return ep

    async def _turns(self, spec: GroupSpec, ep: Episode, toolbox: Toolbox, first: asyncio.Future | None) -> None:
        lim, k, eos = self.limits, ep.index, self.tokenizer.eos_token_id
        budget = lim.budget(len(ep.prompt_ids))
        schemas = self.environments.schemas(ep.environment_name)
        if first is not None:
            out: RequestOutput = await first
            sample = out.samples[k]
        else:
            out = await self.continuer(Request(f"{spec.request_id}-e{k}-t0", ep.prompt_ids, 1,
                                               self._params(budget), turn_seed(spec.seed, k, 0)))
            sample = out.samples[0]
        used = 0
        while True:
            context = ep.token_ids
            ids = list(sample.token_ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            ep.turns.append(Turn(MODEL, ids, list(sample.logprobs), text, sample.finish_reason, out.version))
            used += len(ids)
            if sample.finish_reason == "length":
                ep.truncated = "token_budget" if used >= budget else "turn_length"
                return
            message, calls = self.format.parse(ids, context, schemas)
            ep.messages.append(message)
            if calls:
                if ep.num_turns >= lim.max_turns:
                    ep.truncated = "max_turns"
                    return
                answers = await self._run_calls(ep, calls, toolbox)
                env_messages, kind = self.format.answer_messages(answers), "tool"
                named = next((c.name for c in calls if c.error is None), None)
            else:
                feedback = getattr(ep.environment, "feedback", None)
                if not callable(feedback):
                    return
                reply = await self._env_call(functools.partial(feedback, text), {},
                                             f"{type(ep.environment).__name__}.feedback")
                if reply is None:
                    return
                if not isinstance(reply, str):
                    raise EpisodeError(f"group {spec.request_id}, episode {k}: {type(ep.environment).__name__}"
                                       f".feedback returned a {type(reply).__name__}; it must return a str or None")
                if ep.num_turns >= lim.max_turns:
                    ep.truncated = "max_turns"
                    return
                env_messages, kind, named = self.format.feedback_messages(reply), "feedback", None
            env_ids = ([] if ids[-1] == eos else [eos]) + self.format.env_ids(env_messages, named)
            if used + len(env_ids) >= budget:
                ep.truncated = "token_budget"
                return
            ep.turns.append(Turn(ENV, env_ids, [], "".join(m["content"] for m in env_messages), kind))
            ep.feedback_turns += kind == "feedback"
            ep.messages += env_messages
            used += len(env_ids)
            turn = ep.num_turns
            out = await self.continuer(Request(f"{spec.request_id}-e{k}-t{turn}", ep.token_ids, 1,
                                               self._params(budget - used), turn_seed(spec.seed, k, turn)))
            sample = out.samples[0]

    async def _run_calls(self, ep: Episode, calls, toolbox: Toolbox) -> list[tuple[str, str]]:
        """The answers of one turn's calls, run in order: a result, or the error text of a bad call
        (or of a tool that raised, with tool_exceptions='answer')."""
        answers = []
        for c in calls:
            ep.tool_calls += 1
            fn = toolbox.tools.get(c.name)
            error = c.error
            if error is None and fn is None:
                error = f"unknown tool {c.name!r}; the tools are {', '.join(toolbox.tools) or 'none'}"
            if error is None:
                try:
                    inspect.signature(fn).bind(**c.arguments)
                except TypeError as e:
                    error = f"tool {c.name}: {e}"
            if error is not None:
                ep.bad_calls += 1
                answers.append((c.name or "invalid", f"error: {error}"))
                continue
            try:
                result = await call(fn, c.arguments, self.limits.call_timeout_s, f"tool {c.name}")
            except CallTimeout as e:
                raise _Failed(str(e)) from None
            except Exception as e:
                if self.limits.tool_exceptions == "fail":
                    raise _Failed(f"tool {c.name} raised {type(e).__name__}: {e}") from None
                ep.tool_errors += 1
                answers.append((c.name, f"error: {type(e).__name__}: {e}"))
                continue
            if not isinstance(result, str):
                raise EpisodeError(f"tool {c.name} returned a {type(result).__name__} ({str(result)[:40]!r}); "
                                   "a tool answers the model with a str")
            answers.append((c.name, result))
        return answers


async def gather(coros: list) -> list:
    """gather, cancelling the others when one raises (Python 3.10 has no TaskGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
