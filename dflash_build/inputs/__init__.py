"""Input formats: how one row of a source becomes a conversation (messages and tool schemas).

Each format is one module of this package defining ``FORMAT``, an :class:`InputFormat`: the fields it
reads (with their default column names, which a source's ``fields`` renames), its conversion of one row,
and optionally the shape of its rows that prepare's columnar fast path
(:mod:`dflash_build.stages.prepare.columnar`) converts on Arrow columns; a format without one takes the
row path. A row that cannot become a prompt raises :class:`~dflash_build.inputs.drops.Drop` with its
reason. A new format is its module here and its name in the schema's ``format`` enum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dflash_build import discovery
from dflash_build.inputs.drops import DROP_MALFORMED, DROP_NO_USER_TURN, DROP_TOO_LONG, DROP_TOO_SHORT, Drop
from dflash_build.spec import SourceSpec

Conversation = tuple[list[dict[str, str]], list[dict[str, Any]] | None]  # (messages, tool schemas or None)


@dataclass(frozen=True)
class TurnList:
    """Rows whose ``column`` field is a list of turns, each with a role and a content field."""

    column: str
    # a system turn holding a <tools> block is read by the row path (its schemas become the tools)
    tools_in_system: bool = False


@dataclass(frozen=True)
class UserText:
    """Rows whose ``column`` field is the user's text, with ``extra`` after a blank line when present."""

    column: str
    extra: str | None = None


@dataclass(frozen=True)
class InputFormat:
    name: str
    fields: Mapping[str, str]  # the fields it reads -> their default column names
    convert: Callable[[Mapping[str, Any], SourceSpec], Conversation]
    required: tuple[str, ...] = ()  # fields a source must name (their default is only a placeholder)
    columnar: TurnList | UserText | None = None  # the rows the fast path converts; None: the row path only


_REGISTRY = discovery.Registry[InputFormat]("dflash_build.inputs", "FORMAT")
__getattr__ = _REGISTRY.view("FORMATS")  # every input format, by name
get = _REGISTRY.get


def columns(spec: SourceSpec) -> dict[str, str]:
    """A source's column of each field its format reads (the format's defaults, renamed by ``fields``)."""
    return {**get(spec.format).fields, **spec.fields}


def to_prompt(row: Any, spec: SourceSpec) -> Conversation:
    """(messages, tool schemas or None), or raise Drop.

    ``turns: first`` keeps the conversation up to its first assistant turn; ``turns: all`` keeps it
    whole, with every assistant turn emptied (each one is regenerated).
    """
    if isinstance(row, Drop):
        raise row
    if not isinstance(row, Mapping):
        raise Drop(DROP_MALFORMED, f"row is {type(row).__name__}, not an object")
    messages, tools = get(spec.format).convert(row, spec)
    if tools is None:  # a call no tool declares is nothing a turn can be compared with
        messages = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    if not any(m["role"] == "user" for m in messages):
        raise Drop(DROP_NO_USER_TURN)
    chars = sum(len(m["content"]) for m in messages if m["role"] != "assistant")
    if chars < spec.min_chars:
        raise Drop(DROP_TOO_SHORT, f"{chars} characters")
    if spec.max_chars is not None and chars > spec.max_chars:
        raise Drop(DROP_TOO_LONG, f"{chars} characters")
    return messages, tools
