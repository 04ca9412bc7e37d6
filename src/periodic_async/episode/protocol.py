"""TRL's environment protocol: tools, environments, and calling them off the engine's loop.

As TRL 1.16's GRPOTrainer defines them:
- a tool is a plain function (sync or async) with type hints on every argument and a Google-style
  docstring describing it and each argument (`transformers.utils.get_json_schema` must accept it);
- an environment is an object made by `environment_factory()`, with `reset(**row) -> str | None`
  (a string is appended to the prompt's last user message), its public methods as tools, and an
  optional `get_reward() -> float` (a reward source of weight 1);
- `environment_factory` is one callable, or a dict of them selected by each row's `environment`
  column (only that environment's tools are shown in its prompt).
Our one addition: an optional `feedback(reply: str) -> str | None`, called on each model reply
that calls no tool; a string is the environment's next turn (e.g. a verifier's "wrong, try
again"), None ends the episode. Like `reset` and `get_reward`, it is not a tool (TRL would
expose a method of that name as one). Where we are stricter than TRL: a tool answers with a
string (an annotation or a result of another type is an error), since its answer is rendered
into the model's context as text.

Every call runs off the caller's event loop: a sync callable in a daemon thread of its own, an
async one on the loop, each under a timeout (`call`). A sync call that overruns keeps its thread
until it returns (Python cannot kill a thread), but nobody waits for it: the episode goes on or
ends, and the process can exit.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from periodic_async.config import EnvConfig, UserError

NOT_TOOLS = frozenset({"reset", "get_reward", "feedback"})
"""Environment methods that are part of the protocol, not tools."""


class ProtocolError(UserError, ValueError):
    """Bad input: an environment, a tool, a row or a chat template that the protocol cannot use (one line)."""


def _where(fn: Callable) -> str:
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    return f"{type(owner).__name__}.{fn.__name__}" if owner is not None else name


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of tool `fn` (what `apply_chat_template(tools=...)` renders), or a
    ProtocolError naming the tool and what it lacks."""
    from transformers.utils import get_json_schema

    if not callable(fn) or not hasattr(fn, "__name__"):
        raise ProtocolError(f"tools: {fn!r} is not a function")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ProtocolError(f"tool {_where(fn)}: {e} (a tool needs a type hint on every argument and a "
                            "Google-style docstring describing it and each argument under 'Args:')") from None
    ret = inspect.signature(fn).return_annotation
    if ret not in (inspect.Signature.empty, str, "str"):
        raise ProtocolError(f"tool {_where(fn)}: returns {getattr(ret, '__name__', ret)} (its annotation); a tool "
                            "answers the model with text: return a str")
    return schema


def environment_tools(env: Any, where: str = "environment") -> list[Callable]:
    """The public methods of environment `env` (defined on its class, not starting with '_', not
    reset / get_reward / feedback), bound to it; a ProtocolError if it has no callable reset."""
    if not callable(getattr(env, "reset", None)):
        raise ProtocolError(f"{where}: {type(env).__name__} has no reset() method (an environment needs "
                            "reset(**row) -> str | None)")
    names = [n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if not n.startswith("_") and n not in NOT_TOOLS]
    return [getattr(env, n) for n in names]


@dataclass
class Toolbox:
    """What one episode may call: its tools by name (standalone and its environment's)."""
    tools: dict[str, Callable]


def _toolbox(tools: Sequence[Callable], where: str) -> Toolbox:
    out: dict[str, Callable] = {}
    for fn in tools:
        tool_schema(fn)
        if fn.__name__ in out:
            raise ProtocolError(f"{where}: two tools named {fn.__name__!r}")
        out[fn.__name__] = fn
    return Toolbox(out)


class Environments:
    """`tools=` and `environment_factory` (one callable or {name: callable}), checked at once:
    each factory is probed with one instance (reset present, every method a valid tool), as TRL
    does at start-up."""

    def __init__(self, environment_factory: Callable | Mapping[str, Callable] | None = None,
                 tools: Sequence[Callable] = ()):
        self.tools = list(tools or [])
        self.multi = isinstance(environment_factory, Mapping)
        if environment_factory is None:
            self.factories: dict[str | None, Callable] = {}
        elif self.multi:
            if not environment_factory:
                raise ProtocolError("environment_factory: an empty dict")
            self.factories = dict(environment_factory)
        else:
            self.factories = {None: environment_factory}
        self._schemas: dict[str | None, list[dict]] = {}
        """The tool schemas a prompt of each environment shows (standalone tools first)."""
        self.has_reward = False
        """Some environment has get_reward(): a reward source of weight 1 (TRL: reward_funcs may be left out)."""
        for name, factory in self.factories.items():
            where = "environment_factory" + ("" if name is None else f"[{name!r}]")
            if not callable(factory):
                raise ProtocolError(f"{where}: {factory!r} is not callable")
            probe = factory()
            box = _toolbox(self.tools + environment_tools(probe, where), where)
            self._schemas[name] = [tool_schema(fn) for fn in box.tools.values()]
            self.has_reward |= callable(getattr(probe, "get_reward", None))
        if not self.factories:
            self._schemas[None] = [tool_schema(fn) for fn in _toolbox(self.tools, "tools").tools.values()]

    @property
    def has_tools(self) -> bool:
        """Some prompt shows a tool (else no tool format is needed: feedback-only environments)."""
        return any(self._schemas.values())

    def name_for(self, row: Mapping[str, Any], where: str = "row") -> str | None:
        """The environment a row selects: its `environment` column with a dict factory, else None."""
        if not self.multi:
            return None
        if "environment" not in row:
            raise ProtocolError(f"{where}: environment_factory is a dict ({', '.join(map(str, self.factories))}) and "
                                f"the row has no 'environment' column (its columns: {', '.join(sorted(row))})")
        name = row["environment"]
        if name not in self.factories:
            raise ProtocolError(f"{where}: environment={name!r} is not among the environments of "
                                f"environment_factory ({', '.join(map(str, self.factories))})")
        return name

    def reset_kwargs(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """What reset(**row) gets: the row, without the `environment` column of a dict factory."""
        return {k: v for k, v in row.items() if not (self.multi and k == "environment")}

    def make(self, name: str | None):
        """A new environment instance (None: no environment_factory)."""
        return self.factories[name]() if self.factories else None

    def toolbox(self, env: Any = None) -> Toolbox:
        """The tools of one episode: the standalone tools and its environment's methods."""
        return _toolbox(self.tools + (environment_tools(env) if env is not None else []), "tools")

    def schemas(self, name: str | None = None) -> list[dict]:
        """The tool schemas rendered in a prompt of environment `name`."""
        return self._schemas[name]


class CallTimeout(TimeoutError):
    """An environment or tool call overran `EpisodeLimits.call_timeout_s`."""


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


async def call(fn: Callable, kwargs: Mapping[str, Any], timeout_s: float, what: str) -> Any:
    """`fn(**kwargs)` off the event loop (sync: a daemon thread of its own; async: awaited), within
    `timeout_s`; a CallTimeout naming `what` when it overruns, the callable's exception as raised."""
    if inspect.iscoroutinefunction(fn):
        try:
            return await asyncio.wait_for(fn(**kwargs), timeout_s)
        except asyncio.TimeoutError:
            raise CallTimeout(f"{what} timed out after {timeout_s:g} s") from None
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def work() -> None:
        try:
            result, error = fn(**kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
            result, error = None, e
        try:
            loop.call_soon_threadsafe(_settle, fut, result, error)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    threading.Thread(target=work, name=f"episode-call:{what}", daemon=True).start()
    try:
        result = await asyncio.wait_for(fut, timeout_s)
    except asyncio.TimeoutError:
        raise CallTimeout(f"{what} timed out after {timeout_s:g} s") from None
    if inspect.isawaitable(result):  # a sync callable that returned a coroutine (e.g. a functools.partial)
        return await asyncio.wait_for(result, timeout_s)
    return result


def load_environments(cfg: EnvConfig) -> Environments:
    """`Environments` from the run's `env` section: its factory (or {name: factory}) and tools
    loaded from their 'module:callable' / 'file.py:callable' specs (a bad spec is one line naming
    it), each factory called with `env.factory_kwargs`, and checked as `Environments` checks them."""
    from periodic_async.reward import load_reward_fn

    def factory(spec: str, where: str) -> Callable:
        fn = load_reward_fn(spec, what=where)
        return functools.partial(fn, **cfg.factory_kwargs) if cfg.factory_kwargs else fn

    if isinstance(cfg.factory, Mapping):
        factories = {name: factory(spec, f"env.factory[{name!r}]") for name, spec in cfg.factory.items()}
    else:
        factories = factory(cfg.factory, "env.factory") if cfg.factory else None
    return Environments(factories, [load_reward_fn(spec, what="env.tools") for spec in cfg.tools])
