"""hermes: sharegpt's turns, with tool schemas in a ``tools`` column or in the system prompt's <tools> block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_build.inputs import Conversation, InputFormat, TurnList
from dflash_build.inputs.rows import chat_turns, field, normalise_tools, system_column, tools_from_system
from dflash_build.spec import SourceSpec


def convert(row: Mapping[str, Any], spec: SourceSpec) -> Conversation:
    messages = system_column(row, spec) + chat_turns(row, spec, "conversations")
    tools = normalise_tools(field(row, spec, "tools", required=False))
    if tools is None:
        for i, m in enumerate(messages):
            if m["role"] == "system" and (found := tools_from_system(m["content"])) is not None:
                # The target's own chat template writes its tool preamble from `tools`; keeping the
                # dataset's preamble as well would show the model two of them.
                del messages[i]
                return messages, found
    return messages, tools


FORMAT = InputFormat(
    "hermes",
    {"conversations": "conversations", "role": "from", "content": "value", "system": "system", "tools": "tools"},
    convert,
    columnar=TurnList("conversations", tools_in_system=True),
)
