"""What the input formats share: a row's fields and texts, its turns as chat messages, tool schemas, and
its chat-template kwargs (``chat_template_kwargs_from``)."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from dflash_build import toolcalls
from dflash_build.inputs import get
from dflash_build.inputs.drops import (
    DROP_EMPTY_CONTENT,
    DROP_INVALID_TOOLS,
    DROP_MALFORMED,
    DROP_MISSING_FIELD,
    DROP_NO_USER_TURN,
    DROP_NON_STRING_CONTENT,
    DROP_TEMPLATE_KWARG,
    DROP_UNKNOWN_ROLE,
    Drop,
)
from dflash_build.spec import SourceSpec

DEFAULT_ROLES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}


# The innermost block: a prose "<tools> XML tags" without its own closing tag must not swallow the real one.
_TOOLS_BLOCK = re.compile(r"<tools>((?:(?!<tools>).)*?)</tools>", re.DOTALL)


def field(row: Mapping[str, Any], spec: SourceSpec, name: str, required: bool = True) -> Any:
    column = spec.fields.get(name, get(spec.format).fields[name])
    if column not in row or row[column] is None:
        if required:
            raise Drop(DROP_MISSING_FIELD, f"no '{column}' column")
        return None
    return row[column]


def as_text(value: Any) -> str:
    if not isinstance(value, str):
        raise Drop(DROP_NON_STRING_CONTENT, f"content is {type(value).__name__}")
    if not value.strip():
        raise Drop(DROP_EMPTY_CONTENT)
    return value


def normalise_tools(value: Any) -> list[dict[str, Any]] | None:
    """Tool schemas as the chat templates expect them: [{"type": "function", "function": {...}}]."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Drop(DROP_INVALID_TOOLS, f"tools are not JSON: {e.msg}") from e
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise Drop(DROP_INVALID_TOOLS, f"tools are {type(value).__name__}, not a list")
    tools = []
    for tool in value:
        if not isinstance(tool, dict):
            raise Drop(DROP_INVALID_TOOLS, "a tool is not an object")
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Drop(DROP_INVALID_TOOLS, "a tool has no function name")
        tools.append({"type": "function", "function": _without_nulls(function)})
    return tools or None


def _without_nulls(schema: Any) -> Any:
    """A tool schema without null-valued keys: a dataset stored as Arrow structs holds every tool's
    property names in each tool's schema, null where that tool has none (SWE-rebench-openhands), and a
    server never shows the target those."""
    if isinstance(schema, dict):
        return {k: _without_nulls(v) for k, v in schema.items() if v is not None}
    if isinstance(schema, list):
        return [_without_nulls(v) for v in schema]
    return schema


def tools_from_system(text: str) -> list[dict[str, Any]] | None:
    """Tool schemas in a Hermes-style system prompt; None when it has none.

    Hermes prompts name the tag in prose first ("...signatures within <tools> </tools> XML tags")
    and only then hold the real block, written as JSON or as a Python literal (single quotes). Every
    ``<tools>`` block is tried in order; the first whose body parses is the schema list. A block that
    looks like data (starts with ``[`` or ``{``) but parses as neither is an invalid-tools drop.
    """
    for match in _TOOLS_BLOCK.finditer(text):
        body = match.group(1).strip()
        if not body.startswith(("[", "{")):
            continue  # the prose mention, or an empty block
        items = _parse_tool_block(body)
        if items is None:
            raise Drop(DROP_INVALID_TOOLS, f"<tools> block is neither JSON nor a Python literal: {body[:80]!r}")
        tools = normalise_tools(items)
        if tools is not None:
            return tools
    return None


def _parse_tool_block(body: str) -> list[Any] | None:
    """One JSON list, several JSON objects one after another, or one Python literal."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    pos = 0
    try:
        while pos < len(body):
            obj, pos = decoder.raw_decode(body, pos)
            items.extend(obj if isinstance(obj, list) else [obj])
            while pos < len(body) and body[pos] in " \t\r\n,":
                pos += 1
        return items
    except json.JSONDecodeError:
        pass
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, tuple):
        value = list(value)
    return value if isinstance(value, list) else [value]


def chat_turns(row: Mapping[str, Any], spec: SourceSpec, list_field: str) -> list[dict[str, str]]:
    turns = field(row, spec, list_field)
    if not isinstance(turns, list):
        raise Drop(DROP_MALFORMED, f"'{list_field}' is {type(turns).__name__}, not a list")
    roles = role_map(spec)
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            raise Drop(DROP_MALFORMED, "a turn is not an object")
        speaker = field(turn, spec, "role")
        role = roles.get(str(speaker).lower()) if isinstance(speaker, str) else None
        if role is None:
            raise Drop(DROP_UNKNOWN_ROLE, f"role {speaker!r}")
        if role == "assistant":
            if spec.turns == "first":
                break  # the target model answers from here on
            # turns: all regenerates this answer; its calls are kept: a regenerated turn is compared with
            # them (to_prompt keeps them with tools). Its text is shown only as history: source's history.
            text = field(turn, spec, "content", required=False)
            calls = toolcalls.dataset_calls(turn.get("tool_calls"), text)
            said = text if isinstance(text, str) else ""  # a turn that only calls may have no text
            content = toolcalls.answer_text(turn.get("tool_calls"), said) if spec.history == "source" else ""
            messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            continue
        content = field(turn, spec, "content", required=role != "system")
        if role == "tool" and spec.turns == "all" and isinstance(content, str):
            content = toolcalls.unwrap_response(content)
        if role == "system" and (content is None or (isinstance(content, str) and not content.strip())):
            continue  # an empty system turn says nothing (Nemotron v2 has one on every row)
        messages.append({"role": role, "content": as_text(content)})
    if spec.turns == "all":
        while messages and messages[-1]["role"] == "system":
            messages.pop()
        first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        if not any(m["role"] == "user" for m in messages[:first_answer]):
            raise Drop(DROP_NO_USER_TURN, "no user turn before the first answer")
    return messages


def role_map(spec: SourceSpec) -> dict[str, str]:
    """A source's speaker names (lower case) to chat roles: the defaults and the config's ``roles``."""
    return {**DEFAULT_ROLES, **{k.lower(): v for k, v in spec.roles.items()}}


def system_column(row: Mapping[str, Any], spec: SourceSpec) -> list[dict[str, str]]:
    system = field(row, spec, "system", required=False)
    if system is None or (isinstance(system, str) and not system.strip()):
        return []
    return [{"role": "system", "content": as_text(system)}]


def row_template_kwargs(row: Mapping[str, Any], spec: SourceSpec) -> dict[str, Any] | None:
    """This row's chat-template kwargs (``chat_template_kwargs_from``), or None when the source reads none."""
    if not spec.chat_template_kwargs_from:
        return None
    kwargs = {}
    for kwarg, source in spec.chat_template_kwargs_from.items():
        value = row.get(source.field)
        if value is None:
            if source.default is None:
                raise Drop(DROP_MISSING_FIELD, f"no '{source.field}' column (chat_template_kwargs_from.{kwarg})")
            kwargs[kwarg] = source.default
            continue
        if source.map is not None:
            if str(value) not in source.map:
                known = ", ".join(map(repr, source.map))
                raise Drop(DROP_TEMPLATE_KWARG, f"{source.field} = {value!r} is not in the map of {kwarg} ({known})")
            value = source.map[str(value)]
        kwargs[kwarg] = value
    return kwargs
