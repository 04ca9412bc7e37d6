"""How tools and tool calls look in the model's context: the chat template's own format, or one
plain-text format for templates without tools.

Both formats render a prompt (messages and tool schemas -> ids), parse a model turn (ids -> the
assistant message and its `ToolCall`s) and render an environment turn (tool answers or feedback
-> the ids that follow the model's end-of-turn token, up to the next assistant header). An
environment turn's ids are cut from the chat template's rendering of a stand-in conversation
with and without the environment's messages (the rendering up to the last eos is the common
prefix), so the model's own ids are never rendered or tokenised again. That needs a chat
template that renders earlier messages the same whatever follows (prefix-preserving), checked
at every environment turn.

`TemplateFormat` (tool_format='template', TRL's behaviour): tools go into the prompt through
`apply_chat_template(tools=...)`, tool answers are 'tool' messages, and calls are parsed by
transformers' `tokenizer.parse_response` with the tokenizer's `response_template`; a tokenizer
without one gets TRL's template for its chat template where TRL knows it (Qwen2.5/3, Llama 3.x,
...; TRL's `add_response_schema`, read, the tokenizer left untouched).

`PlainTextFormat` (tool_format='plain'), for templates that render no tools (SmolLM2's):
  - the tools are described in the system message (`describe_tools`);
  - a call is a Python call with literal arguments between tags, anywhere in the reply:
        <tool_call>calculator(expression="3 * (4 + 5)")</tool_call>
    positional arguments fill the tool's parameters in order; several calls in one reply run in order;
  - the answers come back in one user message, one block per call:
        <tool_response>
        27
        </tool_response>
A reply with no complete <tool_call>...</tool_call> calls nothing (an unclosed tag is a bad call).
"""

from __future__ import annotations

import ast
import json
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal

from periodic_async.episode.protocol import ProtocolError

ToolFormat = Literal["template", "plain", "auto"]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Set when the call could not be read: the text answered to the model instead of a result."""


def _render(tokenizer, messages, tools=None, generation_prompt=False) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                        tokenize=True, return_dict=False)
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def renders_tools(tokenizer) -> bool:
    """The chat template renders a tool's schema, an assistant's tool call and a tool's answer."""
    mark = {"name": "fn_q7x", "arg": "arg_k3v", "val": "val_p9w", "out": "out_z5r"}
    schema = {"type": "function", "function": {"name": mark["name"], "description": "d", "parameters": {
        "type": "object", "properties": {mark["arg"]: {"type": "string", "description": "a"}}}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": mark["name"], "arguments": {mark["arg"]: mark["val"]}}}]},
                {"role": "tool", "name": mark["name"], "content": mark["out"]}]
    if tokenizer.chat_template is None:
        return False
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:  # a template that rejects the roles or the arguments
        return False
    return all(v in text for v in mark.values())


class _Format:
    """What both formats share: the environment turn's ids, cut from the template's rendering."""

    def __init__(self, tokenizer):
        if tokenizer.chat_template is None:
            raise ProtocolError("episodes need a chat template: the tokenizer has none")
        self.tokenizer = tokenizer

    def env_ids(self, messages: list[dict], call_name: str | None = None) -> list[int]:
        """Ids of the environment's `messages` and the next assistant header, to follow a model turn
        that ended with eos. `call_name`: the tool the model called (some templates name it)."""
        if call_name is not None:
            reply = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call_name, "arguments": {}}}]}
        else:
            reply = {"role": "assistant", "content": "x"}
        before = [{"role": "user", "content": "x"}, reply]
        prefix = _render(self.tokenizer, before)
        eos = self.tokenizer.eos_token_id
        if eos in prefix:
            prefix = prefix[: len(prefix) - prefix[::-1].index(eos)]
        full = _render(self.tokenizer, before + messages, generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ProtocolError("the chat template is not prefix-preserving: it renders an assistant turn "
                                "differently once messages follow it, so environment turns cannot be appended as ids")
        return full[len(prefix):]

    def feedback_messages(self, text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    def model_turn_ids(self, message: dict) -> list[int]:
        """The ids a model turn samples to say the assistant `message` (its content and tool calls),
        ending with eos: what the runner would have recorded for it."""
        raise NotImplementedError


class TemplateFormat(_Format):
    """The chat template's own tool format (module docstring)."""

    def __init__(self, tokenizer, response_template: dict | None = None):
        super().__init__(tokenizer)
        if not renders_tools(tokenizer):
            raise ProtocolError("the chat template cannot render tools (schemas, tool calls and tool answers); "
                                "choose the plain-text call format (tool_format='plain')")
        self.response_template = response_template or getattr(tokenizer, "response_template", None) \
            or _trl_response_template(tokenizer.chat_template)
        if self.response_template is None:
            raise ProtocolError("the chat template renders tools, but transformers has no response_template to "
                                "parse its calls: set tokenizer.response_template, or choose tool_format='plain'")

    def prompt_ids(self, messages: list[dict], schemas: list[dict]) -> list[int]:
        return _render(self.tokenizer, messages, schemas, generation_prompt=True)

    def model_turn_ids(self, message: dict) -> list[int]:
        before = [{"role": "user", "content": "x"}]
        head = _render(self.tokenizer, before, generation_prompt=True)
        full = _render(self.tokenizer, before + [message])
        eos = self.tokenizer.eos_token_id
        turn = full[len(head):]
        return turn[: turn.index(eos) + 1] if eos in turn else turn + [eos]

    def parse(self, ids: list[int], prefix: list[int], schemas: list[dict]) -> tuple[dict, list[ToolCall]]:
        try:
            message = self.tokenizer.parse_response(ids, self.response_template, prefix=prefix, tools=schemas or None)
        except (ValueError, TypeError) as e:  # a malformed call (e.g. broken JSON inside <tool_call>)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            bad = ToolCall("", error=f"could not parse the tool call: {first}")
            return {"role": "assistant", "content": text}, [bad]
        message = dict(message or {"role": "assistant", "content": ""})
        calls = []
        for raw in message.get("tool_calls") or []:
            fn = raw.get("function", raw) if isinstance(raw, dict) else {}
            name, args = fn.get("name"), fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    args = None
            if not isinstance(name, str) or not isinstance(args, dict):
                shown = json.dumps(fn, default=str)[:200]
                calls.append(ToolCall(str(name or ""), error=f"malformed tool call {shown}"))
            else:
                calls.append(ToolCall(name, args))
        return message, calls

    def answer_messages(self, answers: list[tuple[str, str]]) -> list[dict]:
        return [{"role": "tool", "name": name, "content": text} for name, text in answers]


def _trl_response_template(chat_template: str) -> dict | None:
    """TRL's response template for a chat template it knows (None: TRL missing or the template unknown)."""
    try:
        from trl.chat_template_utils import add_response_schema
    except ImportError:
        return None
    holder = types.SimpleNamespace(chat_template=chat_template)
    try:
        add_response_schema(holder)
    except ValueError:  # "Unrecognized chat template"
        return None
    return getattr(holder, "response_template", None)


# --- the plain-text call format ---------------------------------------------------------------

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<tool_response>", "</tool_response>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """A call in the plain-text format: <tool_call>name(key=value, ...)</tool_call>, values as Python literals."""
    return f"{CALL_OPEN}{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())}){CALL_CLOSE}"


def format_answer(text: str) -> str:
    return f"{ANSWER_OPEN}\n{text}\n{ANSWER_CLOSE}"


def _type_name(prop: dict) -> str:
    t = prop.get("type", "any")
    return "|".join(t) if isinstance(t, list) else t


def describe_tools(schemas: list[dict]) -> str:
    """The system-message block that teaches the plain-text format and lists the tools."""
    lines = ["You can call tools. To call one, write " + CALL_OPEN + "name(argument=value, ...)" + CALL_CLOSE +
             " with Python literal values and end your turn; the answer comes back as " + ANSWER_OPEN + "..." +
             ANSWER_CLOSE + ".", "Tools:"]
    for s in schemas:
        fn = s["function"]
        props = fn.get("parameters", {}).get("properties", {})
        lines.append(f"- {fn['name']}({', '.join(f'{k}: {_type_name(p)}' for k, p in props.items())}): "
                     f"{fn.get('description', '')}")
        lines += [f"    {k}: {p.get('description', '')}" for k, p in props.items()]
    return "\n".join(lines)


def parse_call(source: str, schemas: dict[str, dict] | None = None) -> ToolCall:
    """One call's text (between the tags) -> a ToolCall; `schemas` (name -> schema) maps positional
    arguments onto parameter names. Never evaluates anything but literals."""
    src = source.strip()
    try:
        node = ast.parse(src, mode="eval").body
    except SyntaxError as e:
        return ToolCall("", error=f"could not parse the tool call {src[:80]!r}: {e.msg}")
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return ToolCall("", error=f"could not parse the tool call {src[:80]!r}: expected name(argument=value, ...)")
    name = node.func.id
    try:
        values = [ast.literal_eval(a) for a in node.args]
        kwargs = {}
        for k in node.keywords:
            if k.arg is None:
                raise ValueError("** arguments are not literals")
            kwargs[k.arg] = ast.literal_eval(k.value)
    except (ValueError, TypeError, SyntaxError) as e:
        return ToolCall(name, error=f"tool call {src[:80]!r}: arguments must be Python literals ({e})")
    params = list((schemas or {}).get(name, {}).get("function", {}).get("parameters", {}).get("properties", {}))
    if len(values) > len(params):
        return ToolCall(name, error=f"tool {name}: {len(values)} positional arguments for parameters {params}")
    for p, v in zip(params, values):
        if p in kwargs:
            return ToolCall(name, error=f"tool {name}: argument {p!r} given twice")
        kwargs[p] = v
    return ToolCall(name, kwargs)


class PlainTextFormat(_Format):
    """The plain-text call format (module docstring)."""

    def prompt_ids(self, messages: list[dict], schemas: list[dict]) -> list[int]:
        return _render(self.tokenizer, with_tools(messages, schemas), generation_prompt=True)

    def parse(self, ids: list[int], prefix: list[int], schemas: list[dict]) -> tuple[dict, list[ToolCall]]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        by_name = {s["function"]["name"]: s for s in schemas}
        calls = [parse_call(m.group(1), by_name) for m in _CALL.finditer(text)]
        tail = text[max((m.end() for m in _CALL.finditer(text)), default=0):]
        if CALL_OPEN in tail:
            calls.append(ToolCall("", error=f"unclosed {CALL_OPEN}: a call ends with {CALL_CLOSE}"))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        good = [c for c in calls if c.error is None]
        if good:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in good]
        return message, calls

    def answer_messages(self, answers: list[tuple[str, str]]) -> list[dict]:
        return [{"role": "user", "content": "\n".join(format_answer(text) for _, text in answers)}]

    def model_turn_ids(self, message: dict) -> list[int]:
        text = message.get("content") or ""
        if CALL_OPEN not in text:  # the calls as TRL writes them, beside the content (the runner's are inside it)
            text += "".join(format_call(c["name"], _arguments(c)) for c in _calls(message))
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]


def _calls(message: dict) -> list[dict]:
    return [c.get("function", c) for c in message.get("tool_calls") or []]


def _arguments(call: dict) -> dict[str, Any]:
    args = call.get("arguments") or {}
    return json.loads(args) if isinstance(args, str) else dict(args)


def encode_conversation(fmt: _Format, messages: list[dict], schemas: list[dict]) -> tuple[list[int], list[int],
                                                                                           list[int]]:
    """A finished episode written as chat messages (TRL's conversational format: system and user
    turns, then assistant turns with or without `tool_calls`, 'tool' answers and user feedback)
    as the ids the runner would have recorded: (prompt ids, the rest, its loss mask: 1 on the
    model's turns, 0 on the environment's). The supervised warm start of tool use trains on it."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ProtocolError("a conversation needs its prompt (system/user messages) and then an assistant message")
    prompt, ids, mask = fmt.prompt_ids(messages[:first], schemas), [], []
    i, last_call = first, None
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant":
            turn = fmt.model_turn_ids(m)
            last_call = _calls(m)[-1]["name"] if _calls(m) else None
            ids, mask, i = ids + turn, mask + [1] * len(turn), i + 1
            continue
        j = i  # the environment's turn: the tool answers, or the user's feedback, up to the next assistant
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        said = messages[i:j]
        if all(x.get("role") == "tool" for x in said):
            env = fmt.env_ids(fmt.answer_messages([(x.get("name", last_call), str(x["content"])) for x in said]),
                              last_call)
        elif all(x.get("role") == "user" for x in said):
            env = fmt.env_ids(fmt.feedback_messages("\n".join(str(x["content"]) for x in said)))
        else:
            raise ProtocolError(f"messages {i}..{j - 1}: an environment turn is tool answers or user feedback, "
                                f"not {[x.get('role') for x in said]}")
        if j == len(messages):
            break  # nothing of the model's follows: the conversation's last environment turn is not learnt from
        ids, mask, i = ids + env, mask + [0] * len(env), j
    return prompt, ids, mask


def with_tools(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """`messages` with the plain-text tool description in the system message (added first when there is none)."""
    if not schemas:
        return list(messages)
    block = describe_tools(schemas)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}] + list(messages[1:])
    return [{"role": "system", "content": block}] + list(messages)


def make_format(tokenizer, tool_format: ToolFormat = "template", needs_tools: bool = True) -> _Format:
    """The format episodes of `tokenizer` use: 'template', 'plain', or 'auto' (the template's where
    it renders tools, else plain). Without tools (an environment with feedback alone) any chat
    template will do, and the plain-text format is taken."""
    if tool_format not in ("template", "plain", "auto"):
        raise ProtocolError(f"tool_format={tool_format!r}: expected 'template', 'plain' or 'auto'")
    if tool_format == "auto":
        tool_format = "template" if renders_tools(tokenizer) else "plain"
    if tool_format == "plain" or not needs_tools:
        return PlainTextFormat(tokenizer)
    return TemplateFormat(tokenizer)

