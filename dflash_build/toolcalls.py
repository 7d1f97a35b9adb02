"""Tool calls in a model's answer, read as the server that runs the model reads them (``model.tool_call_parser``).

An agent never sees the text of the target's tool calls: the server parses them out of the answer with the
parser its model is run with and hands the agent structured ``tool_calls``. So the answer's text splits
the way that parser splits it, unknown functions, unparsable calls and all:

- ``hermes``: JSON in ``<tool_call>`` tags (Hermes, Qwen2.5/Qwen3). A call of a function the request's
  tools do not declare is dropped; text whose calls do not parse is all content, with no call.
- ``qwen3_coder``: ``<function=NAME><parameter=KEY>value</parameter></function>`` inside ``<tool_call>``
  (Qwen3-Coder, Qwen3.5/3.6). Values are typed by the tool's parameter schema (a string stays a string,
  an integer parameter's value becomes an int, an object's is read as JSON, then as a Python literal).

Both follow SGLang 0.5.23's ``HermesDetector`` and ``Qwen3CoderDetector`` (``detect_and_parse``) rule for
rule; ``tests/test_sglang_contract.py`` checks them against those on one table of answers. The reasoning
(before the template's closing think marker) is split off first, as the server's reasoning parser does.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # as parsed: a dict for a well-formed call

    def as_openai(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` item (arguments as a JSON string, as servers send them)."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ToolCall, ...] = ()


Tools = list[dict[str, Any]] | None


def _functions(tools: Tools) -> list[dict[str, Any]]:
    """The declared functions, from OpenAI-style tools (``{"type": "function", "function": {...}}``)."""
    out = []
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get("type", "function") == "function":
            function = tool.get("function", tool)
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                out.append(function)
    return out


# -- hermes ------------------------------------------------------------------------------------------------
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


def hermes(text: str, tools: Tools) -> Parsed:
    start = text.find(TOOL_CALL_OPEN)
    if start == -1:
        return Parsed(text)
    declared = {f["name"] for f in _functions(tools)}
    calls = []
    try:
        for closed, open_ended in _HERMES_CALL.findall(text):
            raw = closed or open_ended
            if not raw:
                continue
            parsed = json.loads(raw.strip())
            for action in parsed if isinstance(parsed, list) else [parsed]:
                name = action.get("name")
                if name and name in declared:
                    calls.append(ToolCall(name, action.get("parameters") or action.get("arguments", {})))
    except Exception:  # the server's rule: an answer whose calls do not parse is all content
        return Parsed(text)
    return Parsed(text[:start].strip(), tuple(calls))


# -- qwen3_coder ---------------------------------------------------------------------------------------------
_CODER_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CODER_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_CODER_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def qwen3_coder(text: str, tools: Tools) -> Parsed:
    if TOOL_CALL_OPEN not in text:
        return Parsed(text)
    try:
        blocks = _CODER_CALL.findall(text) or ([text] if "<function=" in text else [])
        calls = []
        for block in blocks:
            for closed, open_ended in _CODER_FUNCTION.findall(block):
                body = closed or open_ended
                if ">" not in body:
                    continue
                name, _, params = body.partition(">")
                schema = _parameter_schemas(name, tools)
                arguments = {}
                for match in _CODER_PARAMETER.findall(params):
                    if ">" not in match:
                        continue
                    key, _, value = match.partition(">")
                    value = value.removeprefix("\n").removesuffix("\n")
                    arguments[key] = _typed(value, schema[key]) if key in schema else value
                calls.append(ToolCall(name, arguments))
    except Exception:  # the server's rule, as for hermes
        return Parsed(text)
    start = text.find(TOOL_CALL_OPEN)
    return Parsed(text[:start] if start > 0 else "", tuple(calls))


def _parameter_schemas(name: str, tools: Tools) -> dict[str, Any]:
    """The declared function's parameter schemas by name (its top-level properties, or those of its
    anyOf/oneOf/allOf branches); {} for a function the tools do not declare."""
    for function in _functions(tools):
        if function["name"] == name:
            params = function.get("parameters")
            if not isinstance(params, dict):
                return {}
            return _properties(params) or ({} if "properties" in params else params)
    return {}


def _properties(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    if isinstance(schema.get("properties"), dict):
        return dict(schema["properties"])
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) or []:
            for key, value in _properties(branch).items():
                merged.setdefault(key, value)
    return merged


def _schema_type(schema: Any) -> str | None:
    """The primary JSON type a parameter's schema names (type, anyOf/oneOf, enum, allOf, properties, items)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list) and declared:
        return next((t for t in declared if t != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        types = [t for t in map(_schema_type, branches) if t]
        if types:
            distinct = set(types)
            if len(distinct) == 1:
                return types[0]
            if len(distinct) == 2 and "null" in distinct:
                return next(t for t in types if t != "null")
            return "string" if "string" in distinct else types[0]
    if isinstance(schema.get("enum"), list):
        kinds = {_json_type(v) for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((t for t in map(_schema_type, schema["allOf"]) if t and t != "string"), "string")
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else None


def _json_type(value: Any) -> str:
    for kind, types in (("null", type(None)), ("boolean", bool), ("integer", int), ("number", float)):
        if isinstance(value, types):
            return kind
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "string"


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema declares; the text itself where it is not one."""
    if value.lower() == "null":
        return None
    kind = str(_schema_type(schema) or "string").strip().lower()
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        integral = "." not in value and "e" not in value.lower() and number.is_integer()
        return int(number) if integral else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return _literal(value)
    return _python_literal(value)


PARSERS: dict[str, Callable[[str, Tools], Parsed]] = {"hermes": hermes, "qwen3_coder": qwen3_coder}


def split_reasoning(text: str, think: tuple[str, str]) -> tuple[str | None, str]:
    """(reasoning, the rest) of an answer: the reasoning is what comes before the closing marker (the
    prompt may have opened it); None when there is no closing marker."""
    opening, closing = think
    if closing not in text:
        return None, text.strip()
    reasoning, _, answer = text.partition(closing)
    return reasoning.strip().removeprefix(opening).strip(), answer.strip()


def parse(parser: str, text: str, tools: Tools) -> Parsed:
    """The content and calls of an answer's text after its reasoning, by the named parser."""
    return PARSERS[parser](text, tools)


THINK = ("<think>", "</think>")  # the reasoning markers of the Qwen and Hermes templates


def read_answer(parser: str, text: str, tools: Tools, think: tuple[str, str] = THINK) -> tuple[str, Parsed]:
    """(the text before the calls, the calls) of a whole generated answer: its reasoning (kept, as
    generated) is split off first, as the server's reasoning parser does, so a call inside it is none."""
    reasoning, rest = split_reasoning(text, think)
    parsed = parse(parser, rest, tools)
    if reasoning is None:
        return parsed.content, parsed
    head = text[: text.index(think[1]) + len(think[1])]
    return f"{head}\n\n{parsed.content}" if parsed.content else head, parsed


# -- the dataset's own calls ----------------------------------------------------------------------------
_ANY_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_RESPONSE = re.compile(r"^\s*<tool_response>(.*)</tool_response>\s*$", re.DOTALL)


def dataset_calls(structured: Any, text: Any) -> list[dict[str, Any]]:
    """A dataset's assistant turn's calls as chat ``tool_calls`` (arguments parsed): its structured
    ``tool_calls`` (OpenAI messages), else the ``<tool_call>`` blocks of its text, JSON or a Python
    literal (Hermes datasets write both). A block that is neither is no call."""
    items: list[Any] = []
    if isinstance(structured, list):
        items = structured
    elif isinstance(text, str):
        for block in _ANY_CALL.findall(text):
            value = _literal(block.strip())
            items.extend(value if isinstance(value, list) else [value])
    calls = []
    for item in items:
        function = item.get("function", item) if isinstance(item, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            arguments = function.get("arguments", function.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = _literal(arguments) if arguments.strip() else {}
            calls.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return calls


def answer_text(structured: Any, text: str) -> str:
    """A dataset's assistant turn's text as history holds it beside its calls: without the
    ``<tool_call>`` blocks its calls were read from (the template writes the calls themselves)."""
    return text if isinstance(structured, list) else _ANY_CALL.sub("", text).strip()


def _literal(text: str) -> Any:
    """JSON, else a Python literal, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return _python_literal(text)


def _python_literal(text: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.literal_eval(text)
    except Exception:  # literal_eval raises several types; the text stays text
        return text


def unwrap_response(text: str) -> str:
    """A tool result without the ``<tool_response>`` tags a Hermes dataset writes around it: the target's
    template writes its own."""
    match = _RESPONSE.match(text)
    return match.group(1).strip() if match else text


def same_calls(ours: tuple[ToolCall, ...], theirs: list[dict[str, Any]], match: str) -> bool:
    """Whether the target's calls are the dataset's: the same functions in the same order and, with
    ``match`` arguments, arguments equal as canonical JSON."""
    if [c.name for c in ours] != [t["function"]["name"] for t in theirs]:
        return False
    if match == "name":
        return True
    canonical = [json.dumps(c.arguments, sort_keys=True) for c in ours]
    return canonical == [json.dumps(t["function"]["arguments"], sort_keys=True) for t in theirs]


def call_difference(ours: tuple[ToolCall, ...], theirs: list[dict[str, Any]]) -> str:
    """How the target's calls differ from the dataset's, for the mismatch note: the functions where they
    differ, else the first call whose arguments differ, with both arguments."""
    names = [c.name for c in ours]
    wanted = [t["function"]["name"] for t in theirs]
    if names != wanted:
        return f"answered {names or 'text'} where the dataset has {wanted or 'text'}"
    for i, (call, their) in enumerate(zip(ours, theirs, strict=True)):
        mine = json.dumps(call.arguments, sort_keys=True)
        want = json.dumps(their["function"]["arguments"], sort_keys=True)
        if mine != want:
            where = f"call {i + 1} of {len(ours)}"
            return f"called {call.name} ({where}) with arguments {mine} where the dataset has {want}"
    return f"answered {names} as the dataset does"
