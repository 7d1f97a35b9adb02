"""messages: an OpenAI-style ``messages`` list of ``{role, content}``, and an optional ``tools`` column."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_build.inputs import Conversation, InputFormat, TurnList
from dflash_build.inputs.rows import chat_turns, field, normalise_tools
from dflash_build.spec import SourceSpec


def convert(row: Mapping[str, Any], spec: SourceSpec) -> Conversation:
    return chat_turns(row, spec, "messages"), normalise_tools(field(row, spec, "tools", required=False))


FORMAT = InputFormat(
    "messages",
    {"messages": "messages", "role": "role", "content": "content", "tools": "tools"},
    convert,
    columnar=TurnList("messages"),
)
