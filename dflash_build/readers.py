"""Reading raw local files row by row, so that one bad row costs that row and nothing else.

Upstream dumps carry byte-level quirks that a plain ``open(..., encoding="utf-8")`` turns into a dead
source: a UTF-8 byte-order mark before the first row, or one invalid byte sequence somewhere in a
multi-gigabyte file. Here a BOM is skipped, and a row whose bytes are not UTF-8 comes back as an
:class:`InvalidUtf8` marker with its location, to be counted as a drop while every other row is kept.
Both ``prepare`` and the plan's row counts read through this module, so they agree on what a row is.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class InvalidUtf8:
    """A row whose bytes are not valid UTF-8."""

    detail: str


@dataclass(frozen=True)
class InvalidJson:
    """A row that is not valid JSON."""

    detail: str


BLANK = object()  # a line with nothing on it: not a row


def parse_jsonl_line(raw: bytes) -> Any:
    """One line's value, an :class:`InvalidUtf8` / :class:`InvalidJson` marker, or :data:`BLANK`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return InvalidUtf8(f"invalid UTF-8 at byte {e.start} of the line: {raw[e.start : e.end]!r}")
    if not line.strip():
        return BLANK
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        return InvalidJson(f"invalid JSON: {e.msg}")


def iter_jsonl_chunks(path: Path, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(number of its first line, bytes) of whole lines, about ``chunk_bytes`` at a time; the
    first chunk without its byte-order mark. Line numbers count every line, blank ones too."""
    lineno = 1
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            chunk += f.readline()
            first = lineno
            lineno += chunk.count(b"\n")
            if first == 1 and chunk.startswith(codecs.BOM_UTF8):
                chunk = chunk[len(codecs.BOM_UTF8) :]
            yield first, chunk


def count_jsonl(path: Path) -> int:
    """Rows of a .jsonl file: its non-blank lines (bad rows included: they are counted as drops)."""
    count = 0
    with open(path, "rb") as f:
        while lines := f.readlines(8 << 20):
            stripped = list(map(bytes.strip, lines))
            count += len(stripped) - stripped.count(b"") - stripped.count(codecs.BOM_UTF8)
    return count


def load_json(path: Path) -> list[Any]:
    """The items of a .json file (a list of objects, or one object).

    Invalid byte sequences are decoded as lone surrogates (``surrogateescape``), so the file still
    parses; an item that holds one comes back as :class:`InvalidUtf8`.
    """
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    data = json.loads(text)
    items = data if isinstance(data, list) else [data]
    return [InvalidUtf8("invalid UTF-8 in the item's strings") if _has_surrogate(v) else v for v in items]


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False
