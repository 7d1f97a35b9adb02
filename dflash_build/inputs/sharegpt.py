"""sharegpt: a ``conversations`` list of ``{from, value}`` turns, and an optional ``system`` column."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_build.inputs import Conversation, InputFormat, TurnList
from dflash_build.inputs.rows import chat_turns, system_column
from dflash_build.spec import SourceSpec


def convert(row: Mapping[str, Any], spec: SourceSpec) -> Conversation:
    return system_column(row, spec) + chat_turns(row, spec, "conversations"), None


FORMAT = InputFormat(
    "sharegpt",
    {"conversations": "conversations", "role": "from", "content": "value", "system": "system"},
    convert,
    columnar=TurnList("conversations"),
)
