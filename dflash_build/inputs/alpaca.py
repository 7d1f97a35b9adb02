"""alpaca: an ``instruction``, its ``input`` after a blank line when there is one, an optional ``system``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_build.inputs import Conversation, InputFormat, UserText
from dflash_build.inputs.rows import as_text, field, system_column
from dflash_build.spec import SourceSpec


def convert(row: Mapping[str, Any], spec: SourceSpec) -> Conversation:
    instruction = as_text(field(row, spec, "instruction"))
    extra = field(row, spec, "input", required=False)
    if isinstance(extra, str) and extra.strip():
        instruction = f"{instruction}\n\n{extra}"
    return [*system_column(row, spec), {"role": "user", "content": instruction}], None


FORMAT = InputFormat(
    "alpaca",
    {"instruction": "instruction", "input": "input", "system": "system"},
    convert,
    columnar=UserText("instruction", extra="input"),
)
