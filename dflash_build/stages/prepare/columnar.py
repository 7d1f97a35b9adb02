"""Prepare's conversion of a batch of rows at once, on Arrow columns: the same bytes as the row path.

A row is *plain* when converting it needs no judgement: every turn is an object with a known ASCII
role, every kept content a non-blank string, no tools, a user turn, a length within the filters. Plain
rows are converted here: Arrow kernels write their JSON and Python hashes it, one SHA-256 a row (the
prompt id's, which is the dedup key's too unless folding changes the row). That is several times
faster than :func:`dflash_build.stages.prepare.to_prompt` and the JSON encoder row by row. Every other row (a drop,
tools, an odd type anywhere in the batch) goes back to the row path, so what a row becomes, and why a
row is dropped, is decided in one place; this module only recognises the rows that path would keep
unchanged, and writes their JSON exactly as Python's ``json`` would (tests compare the two, row for
row, on rows with every quirk the row path handles).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring  # json's own string writer (ensure_ascii=False)
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_build import inputs
from dflash_build.inputs import TurnList, UserText
from dflash_build.spec import SourceSpec

# Python's whitespace (str.isspace, str.split, str.strip) as RE2 classes: all of it (none is above
# U+3000), the ASCII part, and the ASCII part but the plain space.
_SPACE = "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(0x3001)) if c.isspace())
_ASCII_SPACE = "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(128)) if c.isspace())
_ASCII_SPACE_OTHER = "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(128)) if c.isspace() and c != " ")
_NOT_BLANK = f"[^{_SPACE}]"
# In an ASCII string, the whitespace runs " ".join(s.split()) rewrites: any run but one plain space.
_IRREGULAR_RUN = f"[{_ASCII_SPACE_OTHER}][{_ASCII_SPACE}]*| [{_ASCII_SPACE}]+"
_NEEDS_ESCAPE = '[\\x{0}-\\x{1f}"\\\\]'
# The scan of :func:`_may_change` reads 8 bytes at a time as a 64-bit word: a word has a byte below n
# when (w - n * ONES) & ~w & HIGH, a zero byte when (w - ONES) & ~w & HIGH (for n <= 128; see
# graphics.stanford.edu/~seander/bithacks.html).
_ONES = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)
_BELOW_SPACE = _ONES * np.uint64(0x20)
_QUOTES = _ONES * np.uint64(ord('"'))
_BACKSLASHES = _ONES * np.uint64(ord("\\"))
_TWO_SPACES = np.uint16(0x2020)
_FILLER = ord("a")
SCAN_WORDS = 8192  # words per block: its temporaries stay in the CPU's cache


@dataclass
class Converted:
    """The plain rows of a batch: which they are, and their JSON, each a string per plain row."""

    plain: np.ndarray  # bool per batch row
    prompt_bodies: pa.Array  # canonical JSON of {"messages", "tools"}: what the prompt id hashes
    messages: pa.Array  # the record's messages column (json.dumps(messages, ensure_ascii=False))
    # The plain rows (their positions among them) that folding changes, and the prompt bodies of
    # their folded messages: what their dedup keys hash. Every other row's dedup key is its prompt body's.
    refolded_rows: np.ndarray
    dedup_bodies: pa.Array
    # every message's text (answers are empty), and the plain row (its position among them) it is of
    text_rows: np.ndarray
    texts: pa.Array


@dataclass
class _Messages:
    """Every batch row's messages as flat columns, in order: row, role, content."""

    row: np.ndarray  # int64
    role: pa.Array  # string
    content: pa.Array  # string

    def only(self, keep: np.ndarray) -> _Messages:
        if keep.all():
            return self  # no copy of the texts
        mask = pa.array(keep)
        return _Messages(self.row[keep], self.role.filter(mask), self.content.filter(mask))


def convert(table: pa.Table, spec: SourceSpec, roles: Mapping[str, str]) -> Converted | None:
    """The plain rows of ``table`` converted, or None when its columns are not of the plain types."""
    shape = inputs.get(spec.format).columnar
    if shape is None or spec.history == "source":  # the answers' texts and calls as history: the row path
        return None
    fields = inputs.columns(spec)
    n = table.num_rows
    plain = np.ones(n, dtype=bool)
    if isinstance(shape, TurnList):
        turns = _turns(table, spec, shape, fields, roles, plain)
        if turns is None:
            return None
        parts = [turns]
        tools = fields.get("tools")
        if tools is not None and tools in table.column_names:  # rows with tools: the row path reads them
            plain &= _as_bool(table.column(tools).is_null())
    else:
        user = _user_text(table, shape, fields, plain)
        if user is None:
            return None
        parts = [user]
    if "system" in fields:
        system = _system_column(table, fields["system"], plain)
        if system is None:
            return None
        parts.insert(0, system)
    messages = _in_order(parts)
    if isinstance(shape, TurnList) and shape.tools_in_system:  # its tool schemas: the row path reads them
        is_system = _as_bool(pc.equal(messages.role, "system"))
        holds_tools = _as_bool(pc.match_substring(messages.content, "<tools>")) & is_system
        plain[messages.row[holds_tools]] = False
    is_user = _as_bool(pc.equal(messages.role, "user"))
    plain &= np.bincount(messages.row[is_user], minlength=n) > 0
    not_answer = ~_as_bool(pc.equal(messages.role, "assistant"))
    lengths = _as_int(pc.utf8_length(messages.content))
    chars = np.bincount(messages.row[not_answer], weights=lengths[not_answer], minlength=n)
    plain &= chars >= spec.min_chars
    if spec.max_chars is not None:
        plain &= chars <= spec.max_chars
    return _bodies(plain, messages.only(plain[messages.row]))


def _turns(
    table: pa.Table,
    spec: SourceSpec,
    shape: TurnList,
    fields: Mapping[str, str],
    roles: Mapping[str, str],
    plain: np.ndarray,
) -> _Messages | None:
    list_column = fields[shape.column]
    if list_column not in table.column_names:
        return None
    column = table.column(list_column).combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return None
    item = column.type.value_type
    if not pa.types.is_struct(item) or item.get_field_index(fields["role"]) < 0:
        return None
    content_at = item.get_field_index(fields["content"])
    if content_at >= 0 and not _is_string(item.field(content_at).type):
        return None
    if not _is_string(item.field(item.get_field_index(fields["role"])).type):
        return None
    plain &= _as_bool(column.is_valid())
    flat = column.flatten()  # a missing list's items (if any) are not in it
    row = np.repeat(np.arange(len(column), dtype=np.int64), _as_int(column.value_lengths().fill_null(0)))
    children = dict(zip([f.name for f in item], flat.flatten(), strict=True))
    speaker = children[fields["role"]]
    content = children[fields["content"]] if content_at >= 0 else pa.nulls(len(flat), pa.string())
    # A turn that is not an object, or whose role is missing, not ASCII or unknown: the row path decides.
    lowered = pc.utf8_lower(speaker)
    role_index = pc.index_in(lowered, value_set=pa.array(list(roles), pa.string()))
    known = _as_bool(flat.is_valid()) & _as_bool(pc.string_is_ascii(speaker)) & _as_bool(role_index.is_valid())
    plain[row[~known]] = False
    role = pc.take(pa.array(list(roles.values()), pa.string()), role_index.fill_null(0))
    is_answer = _as_bool(pc.equal(role, "assistant"))
    if spec.turns == "first":  # the turns before the first answer
        answers_before = np.cumsum(is_answer) - is_answer
        starts = np.zeros(len(plain) + 1, dtype=np.int64)
        np.cumsum(np.bincount(row, minlength=len(plain)), out=starts[1:])
        in_row = answers_before - answers_before[starts[row]] if len(row) else answers_before
        keep = (in_row == 0) & ~is_answer
    else:  # every turn
        keep = np.ones(len(row), dtype=bool)
    at = np.flatnonzero(keep & known)
    content_at = at.copy()
    content = _and_empty(content)
    content_at[is_answer[at]] = len(content) - 1  # answers emptied (turns: all), never copied
    turns = _Messages(row[at], role.take(pa.array(at)), content.take(pa.array(content_at)))
    # Empty system turns say nothing and go; any other empty or missing content: the row path decides.
    is_system = _as_bool(pc.equal(turns.role, "system"))
    blank = _blank(turns.content)
    plain[turns.row[blank & ~is_system & ~is_answer[at]]] = False
    turns = turns.only(~(blank & is_system))
    if spec.turns == "all":
        turns = _all_turns_checked(turns, plain)
    return turns


def _all_turns_checked(turns: _Messages, plain: np.ndarray) -> _Messages:
    """``turns: all``: trailing system turns go; a row needs a user turn before its first answer."""
    is_system = _as_bool(pc.equal(turns.role, "system"))
    # a turn is trailing when no non-system turn of its row comes after it
    last_other = np.full(len(plain), -1, dtype=np.int64)
    np.maximum.at(last_other, turns.row[~is_system], np.flatnonzero(~is_system))
    turns = turns.only(np.arange(len(turns.row)) <= last_other[turns.row])
    is_answer = _as_bool(pc.equal(turns.role, "assistant"))
    is_user = _as_bool(pc.equal(turns.role, "user"))
    first_answer = np.full(len(plain), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_answer, turns.row[is_answer], np.flatnonzero(is_answer))
    user_before = np.zeros(len(plain), dtype=bool)
    user_at = np.flatnonzero(is_user)
    user_before[turns.row[user_at[user_at < first_answer[turns.row[user_at]]]]] = True
    plain &= user_before
    return turns


def _user_text(table: pa.Table, shape: UserText, fields: Mapping[str, str], plain: np.ndarray) -> _Messages | None:
    """One text column (alpaca's instruction, with its input after a blank line when there is one)."""
    name = fields[shape.column]
    if name not in table.column_names or not _is_string(table.schema.field(name).type):
        return None
    text = table.column(name).combine_chunks()
    plain &= _as_bool(text.is_valid()) & ~_blank(text)
    extra_name = fields.get(shape.extra) if shape.extra else None
    if extra_name is not None and extra_name in table.column_names:
        if not _is_string(table.schema.field(extra_name).type):
            return None
        extra = table.column(extra_name).combine_chunks()
        with_extra = pa.array(_as_bool(extra.is_valid()) & ~_blank(extra))
        text = pc.if_else(with_extra, pc.binary_join_element_wise(text, extra, "\n\n"), text)
    text = text.fill_null("")
    return _Messages(np.arange(len(text), dtype=np.int64), pa.array(["user"] * len(text), pa.string()), text)


def _system_column(table: pa.Table, name: str, plain: np.ndarray) -> _Messages | None:
    """A system column's message where it is a non-blank string."""
    if name not in table.column_names:
        return _Messages(np.zeros(0, dtype=np.int64), pa.array([], pa.string()), pa.array([], pa.string()))
    if not _is_string(table.schema.field(name).type):
        return None
    text = table.column(name).combine_chunks()
    present = _as_bool(text.is_valid()) & ~_blank(text)
    rows = np.flatnonzero(present)
    return _Messages(rows, pa.array(["system"] * len(rows), pa.string()), text.filter(pa.array(present)))


def _in_order(parts: list[_Messages]) -> _Messages:
    """The parts' messages, row by row, each row's in the order of the parts (a stable sort)."""
    present = [p for p in parts if len(p.row)]
    if len(present) == 1:  # no system column, say: the messages are in order already
        return _Messages(present[0].row, present[0].role, present[0].content.cast(pa.string()))
    row = np.concatenate([p.row for p in parts])
    order = np.argsort(row, kind="stable")
    take = pa.array(order)
    return _Messages(
        row[order],
        pa.concat_arrays([p.role for p in parts]).take(take),
        pa.concat_arrays([p.content.cast(pa.string()) for p in parts]).take(take),
    )


_ROLE, _CONTENT = object(), object()
# (before, one message, separator, after): a row's canonical prompt body, and its record's messages
_CANONICAL = ('{"messages":[', ['{"content":"', _CONTENT, '","role":', _ROLE, "}"], ",", '],"tools":null}')
_RECORD = ("[", ['{"role": ', _ROLE, ', "content": "', _CONTENT, '"}'], ", ", "]")


def _bodies(plain: np.ndarray, messages: _Messages) -> Converted:
    """The JSON texts of each plain row, as ``json`` writes them (see prepare.prompt_id,
    prepare.dedup_key and the record's messages)."""
    content, refolded_at, refolded = escaped_texts(messages.content)
    names = pc.dictionary_encode(messages.role)
    role_json = [json.dumps(r, ensure_ascii=False) for r in names.dictionary.to_pylist()]
    role = pc.take(pa.array(role_json, pa.string()), names.indices)
    counts = np.bincount(messages.row, minlength=len(plain))[plain]
    # rows that folding changes: the canonical body of their folded messages
    plain_row = (np.cumsum(plain) - 1)[messages.row]
    is_changed = np.zeros(len(counts), dtype=bool)
    is_changed[plain_row[refolded_at]] = True
    changed = np.flatnonzero(is_changed)
    of_changed = np.flatnonzero(is_changed[plain_row])
    folded = _replace_at(content.take(pa.array(of_changed)), np.searchsorted(of_changed, refolded_at), refolded)
    return Converted(
        plain,
        _joined(_CANONICAL, role, content, counts),
        _joined(_RECORD, role, content, counts),
        changed,
        _joined(_CANONICAL, role.take(pa.array(of_changed)), folded, counts[changed]),
        plain_row,
        messages.content,
    )


def _joined(form: tuple[str, list[Any], str, str], role: pa.Array, content: pa.Array, counts: np.ndarray) -> pa.Array:
    """One string per row: its ``counts`` messages written in ``form``."""
    before, message, separator, after = form
    pieces = [role if p is _ROLE else content if p is _CONTENT else p for p in message]
    join = pc.binary_join_element_wise
    if (counts == 1).all():  # one message a row (the usual prompt): one join, no lists
        return join(before + pieces[0], *pieces[1:-1], pieces[-1] + after, "")
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), join(*pieces, "")), separator)
    return join(before, joined, after, "")


def escaped_texts(text: pa.Array) -> tuple[pa.Array, np.ndarray, pa.Array]:
    """Each string escaped as ``json`` writes it inside quotes; and the strings that :func:`fold`
    changes: their positions, and their folds, escaped.

    Most strings need neither: ASCII, no character to escape, no whitespace but single spaces inside.
    One scan finds the others; the ASCII ones fold with Arrow, the rest with Python's own functions.
    """
    text = text.cast(pa.string())
    at = np.flatnonzero(_may_change(text))
    if not len(at):
        return text, at, pa.array([], pa.string())
    subset = text.take(pa.array(at))
    folded = fold(subset)
    changed = ~_as_bool(pc.equal(folded, subset))
    return _escaped(text, at), at[changed], _escaped(folded.filter(pa.array(changed)))


def _may_change(text: pa.Array) -> np.ndarray:
    """For each string, whether escaping or folding may change it: it holds a byte to escape (all ASCII
    whitespace but the space is one), two spaces, a space at either end, or a non-ASCII byte. Never
    False for one that does; True also for some that share an 8-byte word with one that does.

    Bit tricks on 64-bit words with numpy, a block at a time: twice as fast as Arrow's regex and
    ASCII kernels on the same bytes, which read a byte at a time."""
    offsets = _offsets(text)
    base, end = int(offsets[0]), int(offsets[-1])
    if end == base:
        return np.zeros(len(text), dtype=bool)
    chars = np.full(-(-(end - base + 1) // 8) * 8, _FILLER, dtype=np.uint8)  # a filler byte after the last
    chars[: end - base] = np.frombuffer(text.buffers()[2], dtype=np.uint8)[base:end]  # type: ignore[arg-type]
    words = chars.view(np.uint64)
    flagged = np.empty(len(words), dtype=bool)
    block = min(len(words), SCAN_WORDS)
    found, scratch, inverted = (np.empty(block, dtype=np.uint64) for _ in range(3))
    even, odd = np.empty(4 * block, dtype=bool), np.empty(4 * block, dtype=bool)
    for lo in range(0, len(words), SCAN_WORDS):
        hi = min(len(words), lo + SCAN_WORDS)
        n = hi - lo
        _special_bytes(words[lo:hi], found[:n], scratch[:n], inverted[:n])
        np.not_equal(found[:n], 0, out=flagged[lo:hi])
        # two spaces: as 16-bit pairs from even bytes, then from odd ones; a pair flags its first byte's word
        np.equal(chars[8 * lo : 8 * hi].view(np.uint16), _TWO_SPACES, out=even[: 4 * n])
        np.equal(chars[8 * lo + 1 : 8 * hi - 1].view(np.uint16), _TWO_SPACES, out=odd[: 4 * n - 1])
        odd[4 * n - 1] = hi < len(words) and chars[8 * hi - 1] == chars[8 * hi] == ord(" ")
        flagged[lo:hi] |= (even[: 4 * n].view(np.uint32) != 0) | (odd[: 4 * n].view(np.uint32) != 0)
    starts, stops = offsets[:-1] - base, offsets[1:] - base
    first, last = starts // 8, (np.maximum(stops, 1) - 1) // 8
    # a string's words: from its first to the next string's first, and its last (which that may share)
    in_string = np.logical_or.reduceat(flagged, first.clip(max=len(words) - 1)) | flagged[last]
    edge = (chars[starts] == ord(" ")) | (chars[(stops - 1).clip(min=0)] == ord(" "))
    return (stops > starts) & (in_string | edge)


def _special_bytes(words: np.ndarray, found: np.ndarray, scratch: np.ndarray, inverted: np.ndarray) -> None:
    """found: the high bit of each byte of ``words`` that is non-ASCII, below 0x20, a quote or a
    backslash (and maybe of others in a word that has one); in place, on the caller's scratch."""
    np.bitwise_and(words, _HIGH, out=found)
    np.invert(words, out=inverted)
    np.subtract(words, _BELOW_SPACE, out=scratch)
    scratch &= inverted
    found |= scratch
    for repeated in (_QUOTES, _BACKSLASHES):
        np.bitwise_xor(words, repeated, out=scratch)
        np.invert(scratch, out=inverted)
        scratch -= _ONES
        scratch &= inverted
        found |= scratch
    found &= _HIGH


def _escaped(text: pa.Array, candidates: np.ndarray | None = None) -> pa.Array:
    """``text`` with each string (of ``candidates``, else all) that needs escaping escaped."""
    among = text if candidates is None else text.take(pa.array(candidates))
    at = np.flatnonzero(_as_bool(pc.match_substring_regex(among, _NEEDS_ESCAPE)))
    if candidates is not None:
        at = candidates[at]
    if not len(at):
        return text
    escaped = [encode_basestring(s)[1:-1] for s in text.take(pa.array(at)).to_pylist()]
    return _replace_at(text, at, pa.array(escaped, pa.string()))


def fold(text: pa.Array) -> pa.Array:
    """``" ".join(unicodedata.normalize("NFC", s).split())`` of each string (prepare.dedup_key)."""
    ascii_ = _as_bool(pc.string_is_ascii(text))
    folded = pc.utf8_trim(pc.replace_substring_regex(text, _IRREGULAR_RUN, " "), " ")  # ASCII is NFC already
    other = np.flatnonzero(~ascii_)
    if not len(other):
        return folded
    normalize = unicodedata.normalize
    by_python = [" ".join(normalize("NFC", s).split()) for s in text.take(pa.array(other)).to_pylist()]
    return _replace_at(folded, other, pa.array(by_python, pa.string()))


def digests(bodies: pa.Array, size: int) -> bytes:
    """The first ``size`` bytes of the SHA-256 of each string's UTF-8, one after another."""
    if not len(bodies):
        return b""
    data = memoryview(bodies.buffers()[2])  # type: ignore[arg-type]
    sha = hashlib.sha256
    bounds = _offsets(bodies).tolist()
    return b"".join([sha(data[a:b]).digest()[:size] for a, b in itertools.pairwise(bounds)])


def _offsets(text: pa.Array) -> np.ndarray:
    """Where each string of ``text`` (string or large_string) starts in its data buffer, and the last ends."""
    width = np.int64 if pa.types.is_large_string(text.type) else np.int32
    return np.frombuffer(text.buffers()[1], dtype=width)[text.offset : text.offset + len(text) + 1]


def _and_empty(text: pa.Array) -> pa.Array:
    """``text`` and an empty string after it; the characters are not copied when none is missing."""
    text = text.cast(pa.string())
    if text.null_count:
        return pa.concat_arrays([text, pa.array([""], pa.string())])
    offsets = _offsets(text)
    offsets = pa.py_buffer(np.append(offsets, offsets[-1]).tobytes())
    return pa.StringArray.from_buffers(len(text) + 1, offsets, text.buffers()[2])


def _replace_at(values: pa.Array, at: np.ndarray, replacements: pa.Array) -> pa.Array:
    index = np.arange(len(values), dtype=np.int64)
    index[at] = len(values) + np.arange(len(at), dtype=np.int64)
    return pa.concat_arrays([values.cast(pa.string()), replacements]).take(pa.array(index))


def _blank(text: pa.Array) -> np.ndarray:
    """Missing, or only whitespace (``not s.strip()``)."""
    return ~_as_bool(pc.match_substring_regex(text, _NOT_BLANK))  # missing: False, so blank


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _as_bool(values: Any) -> np.ndarray:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if values.null_count:
        values = values.fill_null(False)
    # the bits themselves: Arrow's own conversion goes through its pandas layer, ten times slower
    bits = np.frombuffer(values.buffers()[1], dtype=np.uint8)
    return np.unpackbits(bits, count=values.offset + len(values), bitorder="little")[values.offset :].view(bool)


def _as_int(values: Any) -> np.ndarray:
    """Integers, missing ones 0."""
    if values.null_count:
        values = values.fill_null(0)
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
