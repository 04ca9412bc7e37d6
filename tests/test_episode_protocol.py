"""The episode protocol without an engine (src/periodic_async/episode/protocol.py, formats.py, envs.py):
TRL's tool and environment rules with one error line per bad input, the plain-text call format's
round trip, the chat template's own format (Qwen2.5's, parsed by transformers), timed calls that
never hang, the calculator and its latency distribution."""

import asyncio
import time

import pytest

from periodic_async.episode import Environments, ProtocolError, make_format
from periodic_async.episode.envs import CalculatorEnv, Latency, answers_match, evaluate, extract_answer
from periodic_async.episode.formats import (PlainTextFormat, TemplateFormat, describe_tools, format_call, parse_call,
                                            with_tools)
from periodic_async.episode.protocol import CallTimeout, call, environment_tools, tool_schema


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return str(a + b)


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


# --- bad input: one line each ---------------------------------------------------------------

def test_tool_without_type_hints_or_docstring_is_one_line_naming_it():
    """A tool lacking a type hint, a docstring, an argument's description, or returning a
    non-string type is refused at start-up, one line naming the tool and what it lacks."""
    def no_hint(x) -> str:
        """Doc.

        Args:
            x: x
        """

    def no_doc(x: int) -> str:
        return ""

    def no_arg_doc(x: int) -> str:
        """Doc."""

    def returns_int(x: int) -> int:
        """Doc.

        Args:
            x: x
        """

    for fn, words in [(no_hint, "missing a type hint"), (no_doc, "no docstring"),
                      (no_arg_doc, "no description for the argument"), (returns_int, "returns int")]:
        with pytest.raises(ProtocolError) as e:
            Environments(tools=[add, fn])
        msg = _one_line(e)
        assert fn.__name__ in msg and words in msg, msg
    assert tool_schema(add)["function"]["parameters"]["required"] == ["a", "b"]


class NoReset:
    def step(self, x: int) -> str:
        """Step.

        Args:
            x: x
        """
        return ""


class Counter:
    """An environment with two tools and the protocol's own methods (not tools)."""

    def reset(self, **row):
        self.n = 0
        return f" (start at {row.get('start', 0)})"

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.n += by
        return str(self.n)

    def read(self) -> str:
        """The counter."""
        return str(self.n)

    def get_reward(self) -> float:
        return float(self.n)

    def feedback(self, reply: str):
        return None

    def _private(self) -> str:
        return ""


def test_environment_without_reset_and_tools_of_an_environment():
    """An environment class with no reset() is refused in one line; an environment's tools are its
    public methods except reset, get_reward and feedback (TRL's rule, plus our feedback hook)."""
    with pytest.raises(ProtocolError) as e:
        Environments(NoReset)
    assert "NoReset has no reset()" in _one_line(e)
    assert sorted(f.__name__ for f in environment_tools(Counter())) == ["increment", "read"]
    envs = Environments(Counter, tools=[add])
    assert [s["function"]["name"] for s in envs.schemas()] == ["add", "increment", "read"]


def test_dict_factory_rows_must_name_their_environment():
    """A dict environment_factory selects by the row's `environment` column: a row without it, or
    naming none of the environments, is one line naming the environments and the row's columns;
    reset gets the row without that column."""
    envs = Environments({"count": Counter, "count2": Counter})
    with pytest.raises(ProtocolError) as e:
        envs.name_for({"prompt": "x", "start": 1}, where="row 3")
    msg = _one_line(e)
    assert "row 3" in msg and "no 'environment' column" in msg and "count, count2" in msg and "prompt, start" in msg
    with pytest.raises(ProtocolError) as e:
        envs.name_for({"environment": "chess"})
    assert "'chess'" in _one_line(e)
    assert envs.name_for({"environment": "count2"}) == "count2"
    assert envs.reset_kwargs({"environment": "count", "start": 2}) == {"start": 2}
    assert Environments(Counter).reset_kwargs({"environment": "x"}) == {"environment": "x"}  # single: passed on


def test_template_without_tools_needs_the_plain_format(tokenizer):
    """A chat template that cannot render tools (the test tokenizer's, like SmolLM2's) with the
    template format chosen is one line saying to choose the plain format, which then works."""
    with pytest.raises(ProtocolError) as e:
        make_format(tokenizer, "template")
    assert "cannot render tools" in _one_line(e) and "tool_format='plain'" in str(e.value)
    assert isinstance(make_format(tokenizer, "plain"), PlainTextFormat)
    assert isinstance(make_format(tokenizer, "template", needs_tools=False), PlainTextFormat)  # feedback only


# --- the plain-text call format ---------------------------------------------------------------

def test_plain_call_format_round_trip(tokenizer):
    """format_call -> text -> token ids -> PlainTextFormat.parse gives back each call's name and
    arguments exactly (strings with quotes, numbers, booleans, None, lists), several calls in order;
    positional arguments fill the parameters in order."""
    fmt = PlainTextFormat(tokenizer)
    schemas = Environments(tools=[add]).schemas()
    calls = [("add", {"a": 3, "b": -4}),
             ("search", {"query": 'say "hi"\n', "k": 2.5, "exact": True, "tags": [1, None]})]
    text = "Let me compute. " + " then ".join(format_call(n, a) for n, a in calls) + " done"
    message, parsed = fmt.parse(tokenizer(text).input_ids, [], schemas)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(n, a, None) for n, a in calls]
    assert [t["function"]["name"] for t in message["tool_calls"]] == ["add", "search"]
    by_name = {s["function"]["name"]: s for s in schemas}
    assert parse_call("add(1, b=2)", by_name).arguments == {"a": 1, "b": 2}
    assert fmt.parse(tokenizer("no call here").input_ids, [], schemas)[1] == []


def test_plain_call_format_bad_calls_are_reported_not_run(tokenizer):
    """Text that is not a call with literal arguments, an unclosed tag, or too many positional
    arguments is a call with an error (answered to the model), never evaluated."""
    by_name = {s["function"]["name"]: s for s in Environments(tools=[add]).schemas()}
    for src, words in [("add(1,", "could not parse"), ("os.system('x')", "expected name("),
                       ("add(__import__('os'))", "literals"), ("add(**d)", "literals"),
                       ("add(1, 2, 3)", "3 positional"), ("add(1, a=2)", "given twice")]:
        c = parse_call(src, by_name)
        assert c.error is not None and words in c.error, (src, c)
    _, calls = PlainTextFormat(tokenizer).parse(tokenizer("<tool_call>add(1, 2)").input_ids, [], [])
    assert len(calls) == 1 and "unclosed" in calls[0].error


def test_plain_format_prompt_and_environment_turn(tokenizer):
    """The tools are described in the system message (added when there is none); an environment
    turn's ids are exactly what the chat template renders after the model's eos, and end with the
    next assistant header."""
    schemas = Environments(tools=[add]).schemas()
    block = describe_tools(schemas)
    assert "add(a: integer, b: integer): Add two integers." in block and "<tool_call>" in block
    assert with_tools([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], schemas)[0]["content"] \
        == "S\n\n" + block
    fmt = PlainTextFormat(tokenizer)
    env = fmt.env_ids(fmt.answer_messages([("add", "7")]))
    assert tokenizer.decode(env) == "<|user|><tool_response>\n7\n</tool_response>\n<|assistant|>"
    full = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"},
                                          {"role": "user", "content": "<tool_response>\n7\n</tool_response>"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    assert full[-len(env):] == env


# --- the chat template's own format: Qwen2.5's, parsed by transformers ----------------------------

@pytest.fixture(scope="module")
def qwen_tokenizer(tokenizer_dir):
    """The test tokenizer with Qwen2.5's chat template (TRL's copy) and its turn tokens, eos <|im_end|>."""
    from pathlib import Path

    trl = pytest.importorskip("trl")
    from periodic_async.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tok


def test_template_format_uses_the_templates_tool_format(qwen_tokenizer):
    """With Qwen2.5's template: tools are rendered by the template, a <tool_call>{json}</tool_call>
    reply is parsed by transformers' parse_response (arguments typed by the schema), broken JSON is
    one bad call, and the environment turn is the template's own rendering of the tool answer."""
    tok = qwen_tokenizer
    fmt = make_format(tok, "template")
    assert isinstance(fmt, TemplateFormat)
    schemas = Environments(tools=[add]).schemas()
    messages = [{"role": "user", "content": "What is 3+4?"}]
    prompt = fmt.prompt_ids(messages, schemas)
    assert '"name": "add"' in tok.decode(prompt) and tok.decode(prompt).endswith("<|im_start|>assistant\n")
    reply = tok('<tool_call>\n{"name": "add", "arguments": {"a": "3", "b": 4}}\n</tool_call>').input_ids
    message, calls = fmt.parse(reply + [tok.eos_token_id], prompt, schemas)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 3, "b": 4}, None)]
    broken = tok('<tool_call>\n{"name": "add", "arguments": {"a": 3</tool_call>').input_ids + [tok.eos_token_id]
    (bad,) = fmt.parse(broken, prompt, schemas)[1]
    assert bad.error.startswith("could not parse the tool call")
    env = fmt.env_ids(fmt.answer_messages([("add", "7")]), "add")
    assert tok.decode(env) == ("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    full = tok.apply_chat_template(messages + [message, {"role": "tool", "name": "add", "content": "7"}], tools=schemas,
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    assert full[-len(env):] == env


def test_template_format_encodes_a_conversation_as_the_runner_records_it(qwen_tokenizer):
    """`encode_conversation` with Qwen2.5's template (the warm start's input): the assistant's tool
    call becomes the template's own call ids ending in eos, which `parse` reads back as the same
    call; the tool answer is the environment turn `env_ids` gives; the mask covers the model's
    turns only; and the whole is the template's rendering of the conversation, cut where the
    runner appends."""
    from periodic_async.episode import encode_conversation

    tok, schemas = qwen_tokenizer, Environments(tools=[add]).schemas()
    fmt = make_format(tok, "template")
    question = [{"role": "user", "content": "What is 3+4?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]}
    conversation = question + [call, {"role": "tool", "name": "add", "content": "7"},
                               {"role": "assistant", "content": "7"}]
    prompt, ids, mask = encode_conversation(fmt, conversation, schemas)
    turn = fmt.model_turn_ids(call)
    env = fmt.env_ids(fmt.answer_messages([("add", "7")]), "add")
    assert prompt == fmt.prompt_ids(question, schemas) and turn[-1] == tok.eos_token_id
    assert [(c.name, c.arguments) for c in fmt.parse(turn, prompt, schemas)[1]] == [("add", {"a": 3, "b": 4})]
    assert ids == turn + env + fmt.model_turn_ids(conversation[-1])
    assert mask == [1] * len(turn) + [0] * len(env) + [1] * (len(ids) - len(turn) - len(env))
    rendered = tok.apply_chat_template(conversation, tools=schemas, tokenize=True, return_dict=False)
    assert rendered[:len(prompt) + len(ids)] == prompt + ids


# --- calls off the loop, timed ------------------------------------------------------------------

def test_calls_time_out_and_never_hang():
    """A sync call that sleeps for a minute and an async one that never returns each raise a
    CallTimeout naming the call within a second of a 0.2 s limit; results and exceptions pass through."""
    def sleeper() -> str:
        time.sleep(60)
        return "late"

    async def never() -> str:
        await asyncio.Event().wait()
        return "never"

    async def main():
        out = {"add": await call(add, {"a": 1, "b": 2}, 1.0, "add")}
        for fn in (sleeper, never):
            t = time.perf_counter()
            with pytest.raises(CallTimeout, match=f"{fn.__name__} timed out after 0.2 s"):
                await call(fn, {}, 0.2, fn.__name__)
            out[fn.__name__] = time.perf_counter() - t
        with pytest.raises(ZeroDivisionError):
            await call(lambda: 1 / 0, {}, 1.0, "div")
        return out

    out = asyncio.run(main())
    assert out["add"] == "3" and out["sleeper"] < 1.2 and out["never"] < 1.2, out


# --- the calculator and its latency --------------------------------------------------------------

def test_calculator_evaluates_arithmetic_only():
    """Arithmetic evaluates (integers stay integers); names, calls, attributes and huge powers are
    refused as text answers; the verifier reads <answer> tags, else the last number."""
    assert evaluate("3 * (4 + 5) - 2 ** 3") == 19 and evaluate("7 / 2") == 3.5 and evaluate("-(2)") == -2
    env = CalculatorEnv()
    env.reset(answer="19", question="q")
    assert env.calculator("3 * (4 + 5) - 2 ** 3") == "19" and env.calculator("6 / 3") == "2"
    for bad in ("__import__('os')", "x + 1", "(1).real", "9 ** 999", "1 / 0", "1 +"):
        assert env.calculator(bad).startswith("error: "), bad
    assert extract_answer("so <answer> 12 </answer>") == "12" and extract_answer("3 then 4.5") == "4.5"
    assert answers_match("19.0", "19") and not answers_match("18", "19") and not answers_match(None, "1")


def test_calculator_verifier_gives_attempts_then_rewards():
    """With 3 attempts the verifier answers a wrong reply twice, then ends; a right reply ends at
    once with reward 1."""
    env = CalculatorEnv(attempts=3)
    env.reset(answer="7")
    assert "2 attempts left" in env.feedback("<answer>6</answer>")
    assert "1 attempts left" in env.feedback("it is 5")
    assert env.feedback("8") is None and env.get_reward() == 0.0
    env.reset(answer="7")
    assert env.feedback("<answer>7</answer>") is None and env.get_reward() == 1.0


def test_latency_is_seeded_lognormal_with_the_stated_quantiles():
    """Draws are a pure function of (seed, key); over 4,000 keys the median is 0.2 s and the 99th
    percentile 3 s within sampling error; `scale` multiplies every draw."""
    import numpy as np

    lat = Latency(median_s=0.2, p99_s=3.0, seed=1)
    draws = np.array([lat.draw("k", i) for i in range(4000)])
    assert lat.draw("k", 5) == draws[5] and Latency(seed=2).draw("k", 5) != draws[5]
    assert abs(np.median(draws) / 0.2 - 1) < 0.1 and abs(np.quantile(draws, 0.99) / 3.0 - 1) < 0.35
    assert Latency(seed=1, scale=0.01).draw("k", 7) == pytest.approx(0.01 * draws[7])
