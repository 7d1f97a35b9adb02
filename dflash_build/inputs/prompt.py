"""prompt: one column of the user's text (the source names it: ``fields: {prompt: COLUMN}``), an optional ``system``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_build.inputs import Conversation, InputFormat, UserText
from dflash_build.inputs.rows import as_text, field, system_column
from dflash_build.spec import SourceSpec


def convert(row: Mapping[str, Any], spec: SourceSpec) -> Conversation:
    return [*system_column(row, spec), {"role": "user", "content": as_text(field(row, spec, "prompt"))}], None


FORMAT = InputFormat(
    "prompt",
    {"prompt": "prompt", "system": "system"},
    convert,
    required=("prompt",),
    columnar=UserText("prompt"),
)
