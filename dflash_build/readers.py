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
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


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
        value = json.loads(line)
    except json.JSONDecodeError as e:
        return InvalidJson(f"invalid JSON: {e.msg}")
    # json reads the escape \ud800 alone as a lone surrogate, which no UTF-8 text holds: not a UTF-8 row
    if _SURROGATE_ESCAPE.search(raw) and _has_surrogate(value):
        return InvalidUtf8("a lone surrogate escape (\\ud800-\\udfff without its pair) in a string")
    return value


# matches an escaped backslash before "ud800" too (no surrogate there): the value is checked after
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class LineChunk:
    """Whole lines of a file read at once: where each starts and stops in ``data`` (its newline out)."""

    first: int  # the first line's number (1-based; blank lines count)
    data: bytes
    starts: np.ndarray
    stops: np.ndarray

    @classmethod
    def of(cls, first: int, data: bytes) -> LineChunk:
        # one vectorised pass: splitting into a bytes object per line costs more than reading them
        newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == _NEWLINE)
        stops = newlines if data.endswith(b"\n") else np.append(newlines, len(data))
        starts = np.zeros(len(stops), dtype=stops.dtype)
        starts[1:] = newlines[: len(stops) - 1] + 1
        return cls(first, data, starts, stops)

    def __len__(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> bytes:
        return self.data[self.starts[i] : self.stops[i]]

    def has_blank_line(self) -> bool:
        """Whether a line is empty or only ASCII whitespace (``bytes.strip``'s)."""
        buf = np.frombuffer(self.data, dtype=np.uint8)
        candidates = self.stops == self.starts
        filled = np.flatnonzero(~candidates)
        candidates[filled] = _ASCII_SPACE[buf[self.starts[filled]]]  # a blank line starts with a space
        return any(not self.line(i).strip() for i in np.flatnonzero(candidates).tolist())


_NEWLINE = ord("\n")
_ASCII_SPACE = np.zeros(256, dtype=bool)
_ASCII_SPACE[list(b" \t\n\r\x0b\x0c")] = True


def iter_jsonl_chunks(path: Path, chunk_bytes: int) -> Iterator[LineChunk]:
    """Whole lines, about ``chunk_bytes`` at a time; the first chunk without its byte-order mark."""
    lineno = 1
    with open(path, "rb") as f:
        while data := f.read(chunk_bytes):
            data += f.readline()
            if lineno == 1 and data.startswith(codecs.BOM_UTF8):
                data = data[len(codecs.BOM_UTF8) :]
            chunk = LineChunk.of(lineno, data)
            lineno += len(chunk)  # every chunk but the last ends with a newline
            yield chunk


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
