"""Prepare stage: raw rows of one source → deduplicated, selected, sharded prompt records.

Every row that does not become a prompt is counted by reason (``DROP_*``) in the prompt manifest, with
a few example locations, so nothing disappears silently. The result does not depend on the order of
the input rows or files: duplicates keep the smallest prompt id, ``max_samples`` keeps the rows with
the smallest seeded hash, and shards take contiguous runs of prompt ids.
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing, language, readers
from dflash_build.plan import Plan, SourcePlan, fingerprint_cache
from dflash_build.spec import FORMAT_FIELDS, SourceSpec
from dflash_build.stages import columnar, neardup
from dflash_build.stages.decontaminate import ReferenceIndex
from dflash_build.stages.filters import DROP_CONTAMINATED, DROP_NEAR_DUPLICATE, Example, TextFilters
from dflash_build.store import atomic, layout
from dflash_build.store.records import PROMPT_SCHEMA

log = logging.getLogger(__name__)

DROP_MALFORMED = "malformed_row"
DROP_INVALID_UTF8 = "invalid_utf8"
DROP_NO_USER_TURN = "no_user_turn"
DROP_EMPTY_CONTENT = "empty_content"
DROP_NON_STRING_CONTENT = "non_string_content"
DROP_UNKNOWN_ROLE = "unknown_role"
DROP_MISSING_FIELD = "missing_field"
DROP_INVALID_TOOLS = "invalid_tools"
DROP_TOO_SHORT = "too_short"
DROP_TOO_LONG = "too_long"
DROP_DUPLICATE = "duplicate"
DROP_OVER_MAX_SAMPLES = "over_max_samples"
DROP_TEMPLATE_KWARG = "template_kwarg"  # a value chat_template_kwargs_from has no mapping for
DROP_LANGUAGE = "language"  # not in the source's languages
EXAMPLES_PER_REASON = 5
# Drops the config asked for: they never count towards a source's loss (checks.max_drop_fraction).
INTENDED_DROPS = frozenset(
    {
        DROP_DUPLICATE,
        DROP_OVER_MAX_SAMPLES,
        DROP_TOO_SHORT,
        DROP_TOO_LONG,
        DROP_CONTAMINATED,
        DROP_NEAR_DUPLICATE,
        DROP_LANGUAGE,
    }
)
# The config key behind each intended drop, for a source those drops empty.
DROP_SETTINGS = {
    DROP_DUPLICATE: "exact copies of other rows",
    DROP_OVER_MAX_SAMPLES: "max_samples",
    DROP_TOO_SHORT: "filters.min_chars",
    DROP_TOO_LONG: "filters.max_chars",
    DROP_CONTAMINATED: "decontaminate.references",
    DROP_NEAR_DUPLICATE: "dedup.near.threshold",
    DROP_LANGUAGE: "languages",
}

DEFAULT_ROLES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}
# The innermost block: a prose "<tools> XML tags" without its own closing tag must not swallow the real one.
_TOOLS_BLOCK = re.compile(r"<tools>((?:(?!<tools>).)*?)</tools>", re.DOTALL)


class Drop(Exception):
    """A row that cannot become a prompt; ``reason`` is one of the DROP_* constants."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RawRow:
    location: str  # human-readable, for drop examples: "data/x.jsonl:12"
    origin: dict[str, Any]  # content-derived, stored in meta: input digest + row index
    value: Any


BATCH_ROWS = 4096
JSONL_CHUNK_BYTES = 4 << 20


@dataclass
class RowBatch:
    """Rows read together: their Arrow columns when the reader has them (``columnar`` converts the
    plain ones), and each row's Python value as the row path reads it (:func:`to_prompt`)."""

    table: pa.Table | None
    numbers: np.ndarray  # int64: each row's number in its input (meta "row", and its location)
    input: str  # meta "input": the input file's short digest, or "hf"
    where: str  # a row's location is ``where`` followed by its number
    values: Callable[[Sequence[int]], list[Any]]  # the Python values of the rows at these indices

    def raw_rows(self, indices: Sequence[int]) -> Iterator[RawRow]:
        for i, value in zip(indices, self.values(indices), strict=True):
            number = int(self.numbers[i])
            yield RawRow(f"{self.where}{number}", {"input": self.input, "row": number}, value)


def local_batches(path: Path, digest: str) -> Iterator[RowBatch]:
    """Rows of a .jsonl, .json (a list of objects) or .parquet file, in batches."""
    short = digest[: hashing.KEY_LENGTH]
    if path.suffix == ".parquet":
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            table = pa.Table.from_batches([batch])
            numbers = np.arange(index, index + table.num_rows, dtype=np.int64)
            yield RowBatch(table, numbers, short, f"{path}:row ", _taken(table))
            index += table.num_rows
    elif path.suffix == ".jsonl":
        for chunk in readers.iter_jsonl_chunks(path, JSONL_CHUNK_BYTES):
            yield _jsonl_batch(chunk, short, f"{path}:")
    else:
        try:
            items = readers.load_json(path)
        except json.JSONDecodeError as e:  # a whole file that does not parse has no rows to count
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        values = [_as_drop(v) for v in items]
        numbers = np.arange(len(values), dtype=np.int64)
        yield RowBatch(None, numbers, short, f"{path}:item ", lambda idx: [values[i] for i in idx])


def _taken(table: pa.Table) -> Callable[[Sequence[int]], list[Any]]:
    return lambda idx: table.take(pa.array(idx, pa.int64())).to_pylist()


def _jsonl_batch(chunk: readers.LineChunk, short: str, where: str) -> RowBatch:
    """One chunk of lines: parsed by Arrow when every line is a row it reads, else line by line."""
    table = _arrow_jsonl(chunk)
    if table is not None:
        numbers = np.arange(chunk.first, chunk.first + len(chunk), dtype=np.int64)
        return RowBatch(
            table, numbers, short, where, lambda idx: [_as_drop(readers.parse_jsonl_line(chunk.line(i))) for i in idx]
        )
    lines = chunk.data.split(b"\n")[: len(chunk)]
    parsed = [
        (chunk.first + i, v) for i, raw in enumerate(lines) if (v := readers.parse_jsonl_line(raw)) is not readers.BLANK
    ]
    numbers = np.array([n for n, _ in parsed], dtype=np.int64)
    return RowBatch(None, numbers, short, where, lambda idx: [_as_drop(parsed[i][1]) for i in idx])


def _arrow_jsonl(chunk: readers.LineChunk) -> pa.Table | None:
    """The chunk's rows as Arrow columns, one per line; None when a line is blank or is not one object
    Arrow parses (bad UTF-8 or JSON, two objects, a repeated key, a type that changes between rows):
    then the row path reads it. (A line blank to Python but not in ASCII does not parse either.)"""
    import pyarrow.json as pj

    if not len(chunk) or chunk.has_blank_line():
        return None
    try:
        chunk.data.decode("utf-8")  # Arrow's reader does not check
    except UnicodeDecodeError:
        return None
    try:
        options = pj.ReadOptions(use_threads=False, block_size=len(chunk.data) + 1)
        table = pj.read_json(pa.BufferReader(chunk.data), read_options=options)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return table if table.num_rows == len(chunk) else None


def _as_drop(value: Any) -> Any:
    if isinstance(value, readers.InvalidUtf8):
        return Drop(DROP_INVALID_UTF8, value.detail)
    if isinstance(value, readers.InvalidJson):
        return Drop(DROP_MALFORMED, value.detail)
    return value


def hf_batches(spec: SourceSpec) -> Iterator[RowBatch]:
    import datasets

    hf = spec.hf
    assert hf is not None
    ds = datasets.load_dataset(
        hf.path, hf.name, split=hf.split, revision=None if hf.is_local else hf.revision, data_files=hf.data_files
    )
    arrow = ds.with_format("arrow") if _arrow_is_python(ds.features) else None
    for lo in range(0, len(ds), BATCH_ROWS):
        hi = min(lo + BATCH_ROWS, len(ds))
        numbers = np.arange(lo, hi, dtype=np.int64)
        table = arrow[lo:hi] if arrow is not None else None
        values = lambda idx, lo=lo: list(ds.select([lo + i for i in idx]))  # noqa: E731
        yield RowBatch(table, numbers, "hf", f"{hf.path}[{hf.split}]#", values)


def _arrow_is_python(features: Any) -> bool:
    """Whether a dataset's rows are its Arrow rows as they are (plain values, lists and dicts of them):
    other features (images, legacy sequences of dicts, JSON) are decoded, so only the row path reads them."""
    import datasets

    if isinstance(features, dict):
        return all(_arrow_is_python(f) for f in features.values())
    if isinstance(features, datasets.List | datasets.LargeList):
        return _arrow_is_python(features.feature)
    return isinstance(features, datasets.Value)


def _field(row: Mapping[str, Any], spec: SourceSpec, name: str, required: bool = True) -> Any:
    column = spec.fields.get(name, FORMAT_FIELDS[spec.format][name])
    if column not in row or row[column] is None:
        if required:
            raise Drop(DROP_MISSING_FIELD, f"no '{column}' column")
        return None
    return row[column]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise Drop(DROP_NON_STRING_CONTENT, f"content is {type(value).__name__}")
    if not value.strip():
        raise Drop(DROP_EMPTY_CONTENT)
    return value


def normalise_tools(value: Any) -> list[dict[str, Any]] | None:
    """Tool schemas as the chat templates expect them: [{"type": "function", "function": {...}}]."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Drop(DROP_INVALID_TOOLS, f"tools are not JSON: {e.msg}") from e
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise Drop(DROP_INVALID_TOOLS, f"tools are {type(value).__name__}, not a list")
    tools = []
    for tool in value:
        if not isinstance(tool, dict):
            raise Drop(DROP_INVALID_TOOLS, "a tool is not an object")
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Drop(DROP_INVALID_TOOLS, "a tool has no function name")
        tools.append({"type": "function", "function": function})
    return tools or None


def _tools_from_system(text: str) -> list[dict[str, Any]] | None:
    """Tool schemas in a Hermes-style system prompt; None when it has none.

    Hermes prompts name the tag in prose first ("...signatures within <tools> </tools> XML tags")
    and only then hold the real block, written as JSON or as a Python literal (single quotes). Every
    ``<tools>`` block is tried in order; the first whose body parses is the schema list. A block that
    looks like data (starts with ``[`` or ``{``) but parses as neither is an invalid-tools drop.
    """
    for match in _TOOLS_BLOCK.finditer(text):
        body = match.group(1).strip()
        if not body.startswith(("[", "{")):
            continue  # the prose mention, or an empty block
        items = _parse_tool_block(body)
        if items is None:
            raise Drop(DROP_INVALID_TOOLS, f"<tools> block is neither JSON nor a Python literal: {body[:80]!r}")
        tools = normalise_tools(items)
        if tools is not None:
            return tools
    return None


def _parse_tool_block(body: str) -> list[Any] | None:
    """One JSON list, several JSON objects one after another, or one Python literal."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    pos = 0
    try:
        while pos < len(body):
            obj, pos = decoder.raw_decode(body, pos)
            items.extend(obj if isinstance(obj, list) else [obj])
            while pos < len(body) and body[pos] in " \t\r\n,":
                pos += 1
        return items
    except json.JSONDecodeError:
        pass
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, tuple):
        value = list(value)
    return value if isinstance(value, list) else [value]


def _turns(row: Mapping[str, Any], spec: SourceSpec, list_field: str) -> list[dict[str, str]]:
    turns = _field(row, spec, list_field)
    if not isinstance(turns, list):
        raise Drop(DROP_MALFORMED, f"'{list_field}' is {type(turns).__name__}, not a list")
    roles = role_map(spec)
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            raise Drop(DROP_MALFORMED, "a turn is not an object")
        speaker = _field(turn, spec, "role")
        role = roles.get(str(speaker).lower()) if isinstance(speaker, str) else None
        if role is None:
            raise Drop(DROP_UNKNOWN_ROLE, f"role {speaker!r}")
        if role == "assistant":
            if spec.turns == "first":
                break  # the target model answers from here on
            # turns: all regenerates this answer; the source's content is never shown to the model
            messages.append({"role": "assistant", "content": ""})
            continue
        content = _field(turn, spec, "content", required=role != "system")
        if role == "system" and (content is None or (isinstance(content, str) and not content.strip())):
            continue  # an empty system turn says nothing (Nemotron v2 has one on every row)
        messages.append({"role": role, "content": _text(content)})
    if spec.turns == "all":
        while messages and messages[-1]["role"] == "system":
            messages.pop()
        first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        if not any(m["role"] == "user" for m in messages[:first_answer]):
            raise Drop(DROP_NO_USER_TURN, "no user turn before the first answer")
    return messages


def role_map(spec: SourceSpec) -> dict[str, str]:
    """A source's speaker names (lower case) to chat roles: the defaults and the config's ``roles``."""
    return {**DEFAULT_ROLES, **{k.lower(): v for k, v in spec.roles.items()}}


def _system_column(row: Mapping[str, Any], spec: SourceSpec) -> list[dict[str, str]]:
    system = _field(row, spec, "system", required=False)
    if system is None or (isinstance(system, str) and not system.strip()):
        return []
    return [{"role": "system", "content": _text(system)}]


def to_prompt(row: Any, spec: SourceSpec) -> tuple[list[dict[str, str]], list[dict[str, Any]] | None]:
    """(messages, tool schemas or None), or raise Drop.

    ``turns: first`` keeps the conversation up to its first assistant turn; ``turns: all`` keeps it
    whole, with every assistant turn emptied (each one is regenerated).
    """
    if isinstance(row, Drop):
        raise row
    if not isinstance(row, Mapping):
        raise Drop(DROP_MALFORMED, f"row is {type(row).__name__}, not an object")
    tools = None
    if spec.format in ("sharegpt", "hermes"):
        messages = _system_column(row, spec) + _turns(row, spec, "conversations")
        if spec.format == "hermes":
            tools = normalise_tools(_field(row, spec, "tools", required=False))
            if tools is None:
                for i, m in enumerate(messages):
                    if m["role"] == "system" and (found := _tools_from_system(m["content"])) is not None:
                        # The target's own chat template writes its tool preamble from `tools`;
                        # keeping the dataset's preamble as well would show the model two of them.
                        tools = found
                        del messages[i]
                        break
    elif spec.format == "messages":
        messages = _turns(row, spec, "messages")
        tools = normalise_tools(_field(row, spec, "tools", required=False))
    elif spec.format == "alpaca":
        instruction = _text(_field(row, spec, "instruction"))
        extra = _field(row, spec, "input", required=False)
        if isinstance(extra, str) and extra.strip():
            instruction = f"{instruction}\n\n{extra}"
        messages = [*_system_column(row, spec), {"role": "user", "content": instruction}]
    else:  # prompt
        messages = [*_system_column(row, spec), {"role": "user", "content": _text(_field(row, spec, "prompt"))}]
    if not any(m["role"] == "user" for m in messages):
        raise Drop(DROP_NO_USER_TURN)
    chars = sum(len(m["content"]) for m in messages if m["role"] != "assistant")
    if chars < spec.min_chars:
        raise Drop(DROP_TOO_SHORT, f"{chars} characters")
    if spec.max_chars is not None and chars > spec.max_chars:
        raise Drop(DROP_TOO_LONG, f"{chars} characters")
    return messages, tools


def row_template_kwargs(row: Mapping[str, Any], spec: SourceSpec) -> dict[str, Any] | None:
    """This row's chat-template kwargs (``chat_template_kwargs_from``), or None when the source reads none."""
    if not spec.chat_template_kwargs_from:
        return None
    kwargs = {}
    for kwarg, source in spec.chat_template_kwargs_from.items():
        value = row.get(source.field)
        if value is None:
            if source.default is None:
                raise Drop(DROP_MISSING_FIELD, f"no '{source.field}' column (chat_template_kwargs_from.{kwarg})")
            kwargs[kwarg] = source.default
            continue
        if source.map is not None:
            if str(value) not in source.map:
                known = ", ".join(map(repr, source.map))
                raise Drop(DROP_TEMPLATE_KWARG, f"{source.field} = {value!r} is not in the map of {kwarg} ({known})")
            value = source.map[str(value)]
        kwargs[kwarg] = value
    return kwargs


def _body(
    messages: list[dict[str, str]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    body = {"messages": messages, "tools": None if tools is None else hashing.normalise(tools)}
    if kwargs:  # only when a source reads them, so every other prompt keeps its id
        body["template_kwargs"] = hashing.normalise(kwargs)
    return body


def prompt_id(
    messages: list[dict[str, str]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None = None
) -> str:
    """The prompt's identity: its messages, tools and (where a source reads them) template kwargs, as
    the same messages rendered with thinking on or off are two prompts."""
    # messages are str-to-str dicts already (to_prompt makes them), so only the tools need normalising
    return hashing.digest_normalised(_body(messages, tools, kwargs))[: hashing.KEY_LENGTH]


def dedup_key(
    messages: list[dict[str, str]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None = None
) -> str:
    """What duplicates share: the digest a prompt id takes (:func:`prompt_id`'s body, whole) of the
    messages after Unicode NFC, whitespace folding and trimming. So a row that folding leaves as it
    is has its prompt id's digest. Only compared within one prepare, never stored."""
    normalize = unicodedata.normalize
    folded = [{"role": m["role"], "content": " ".join(normalize("NFC", m["content"]).split())} for m in messages]
    return hashing.digest_normalised(_body(folded, tools, kwargs))


def selection_rank(seed: int, pid: str) -> str:
    return hashing.digest({"seed": seed, "prompt_id": pid})


def shard_bounds(n_rows: int, n_shards: int) -> list[tuple[int, int]]:
    return [(i * n_rows // n_shards, (i + 1) * n_rows // n_shards) for i in range(n_shards)]


class DropCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(f"{location}: {detail}" if detail else location)


# Prepare streams: each converted row goes to a spill bucket on disk (by the top bits of its prompt id)
# and leaves only its digests in memory, 24 bytes a row. Selection runs on those arrays; the buckets
# are then read back one at a time, in prompt id order, and the shards written as they fill. Peak
# memory: the digest arrays and their sort, the bucket buffers (SPILL_BUFFER_BYTES) and one bucket.
# The spill is uncompressed Arrow, mapped back one bucket at a time: about as much disk as the
# converted rows, beside the manifest (LZ4 saved disk but cost an eighth of prepare's time).
SPILL_BUFFER_BYTES = 32 << 20
SPILL_FLUSH_ROWS = 1024
ROWS_PER_BUCKET = 32768
MAX_BUCKETS = 512
_RECORD_JSON = json.JSONEncoder(ensure_ascii=False)  # = json.dumps(x, ensure_ascii=False), one encoder
_META_JSON = json.JSONEncoder(sort_keys=True)
_SPILL_SCHEMA = pa.schema([*PROMPT_SCHEMA, ("location", pa.string())])


def _bucket_count(expected_rows: int) -> int:
    """A power of two, so a bucket is a contiguous range of prompt ids."""
    buckets = 1
    while buckets < MAX_BUCKETS and buckets * ROWS_PER_BUCKET < expected_rows:
        buckets *= 2
    return buckets


class _Spill:
    """Converted records in bucket files under ``folder`` (removed by the caller), or nowhere."""

    def __init__(self, folder: Path | None, buckets: int) -> None:
        self.folder = folder
        self.shift = 64 - (buckets.bit_length() - 1)
        self.buffers: list[list[pa.Table]] = [[] for _ in range(buckets)]
        self.writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        self.buffered_rows = [0] * buckets
        self.buffered_bytes = [0.0] * buckets

    def _path(self, bucket: int) -> Path:
        assert self.folder is not None
        return self.folder / f"{bucket:04d}.arrow"

    def add(self, records: pa.Table, pids: np.ndarray) -> None:
        """Buffer each record (``pids``: their prompt ids as integers) in its bucket."""
        if self.folder is None or not records.num_rows:
            return
        buckets = pids >> np.uint64(self.shift) if self.shift < 64 else np.zeros(len(pids), dtype=np.uint64)
        order = np.argsort(buckets, kind="stable")
        records = records.take(pa.array(order))
        row_bytes = records.nbytes / records.num_rows  # once: a slice's nbytes walks its buffers
        ordered = buckets[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(ordered)], strict=True):
            bucket = int(ordered[lo])
            self.buffers[bucket].append(records.slice(lo, hi - lo))
            self.buffered_rows[bucket] += hi - lo
            self.buffered_bytes[bucket] += (hi - lo) * row_bytes
            if self.buffered_rows[bucket] >= SPILL_FLUSH_ROWS:
                self._flush(bucket)
        if sum(self.buffered_bytes) > SPILL_BUFFER_BYTES:
            for b in range(len(self.buffers)):
                self._flush(b)

    def _flush(self, bucket: int) -> None:
        parts = self.buffers[bucket]
        if not parts or self.folder is None:
            return
        if bucket not in self.writers:  # Arrow files, uncompressed: read back by mapping them
            self.writers[bucket] = pa.ipc.new_file(self._path(bucket), _SPILL_SCHEMA)
        self.writers[bucket].write_table(pa.concat_tables(parts))
        self.buffers[bucket], self.buffered_rows[bucket], self.buffered_bytes[bucket] = [], 0, 0.0

    def close(self) -> None:
        for bucket in range(len(self.buffers)):
            self._flush(bucket)
        for writer in self.writers.values():
            writer.close()

    def tables(self) -> Iterator[pa.Table]:
        """Each bucket's rows, in bucket order (prompt id ranges ascending)."""
        for bucket in sorted(self.writers):
            with pa.memory_map(str(self._path(bucket))) as source, pa.ipc.open_file(source) as reader:
                yield reader.read_all()


@dataclass
class Selection:
    """What prepare keeps of one source: the selected prompt ids in order, and the accounting.

    ``selected`` holds the prompt ids (as 64-bit integers, ascending) that become prompts: one per
    group of duplicates (the smallest prompt id), then the ``max_samples`` with the smallest seeded
    rank. Shard ``i`` takes the ``i``-th contiguous run of them (:func:`shard_bounds`).
    """

    selected: Any  # numpy uint64 array
    winners: Any  # numpy uint64 array: every group's smallest prompt id (selected ⊆ winners)
    rows_in: int
    drops: DropCounter
    shard_names: list[str]
    examples: list[Example] = field(default_factory=list)  # filter drops, by prompt id until located
    bands: Any = None  # with dedup.near: the selected prompts' band keys, (selected, bands) uint64
    references: dict[str, dict[str, int]] | None = None  # with decontaminate: each reference set's items

    @property
    def rows_out(self) -> int:
        return len(self.selected)

    def bounds(self) -> list[tuple[int, int]]:
        return shard_bounds(self.rows_out, len(self.shard_names))

    def shard_prompt_ids(self) -> dict[str, list[str]]:
        return {
            name: [f"{int(p):016x}" for p in self.selected[lo:hi]]
            for name, (lo, hi) in zip(self.shard_names, self.bounds(), strict=True)
        }


def _batches(plan: Plan, source: str) -> Iterator[RowBatch]:
    sp: SourcePlan = plan.sources[source]
    if sp.spec.hf is None:
        cache = fingerprint_cache(plan.config)
        return (b for f in sp.input_files for b in local_batches(f, cache.file(f)))
    return hf_batches(sp.spec)


def _raw_rows(plan: Plan, source: str) -> Iterator[RawRow]:
    """Every row of the source, one at a time, as the row path reads it."""
    for batch in _batches(plan, source):
        yield from batch.raw_rows(range(len(batch.numbers)))


class _Scanned:
    """The digests (24 bytes a converted row, and what ``filters`` keep) and, through the spill, the
    records of a source."""

    def __init__(self, source: str, spec: SourceSpec, spill: _Spill, filters: TextFilters) -> None:
        self.source, self.spec, self.spill, self.filters = source, spec, spill, filters
        self.roles = role_map(spec)
        self.dedup_digests = bytearray()  # 16 bytes per converted row
        self.pids = bytearray()  # 8 bytes per converted row, big-endian
        self.rows_in = 0
        self.drops = DropCounter()
        # with a language list: each converted row's language, as an index into language_names
        self.language_codes = bytearray()  # uint16 a row
        self.language_names: dict[str, int] = {}

    def _add_languages(self, found: list[str]) -> None:
        """The languages of the rows converted next (only with a language list: detecting costs time)."""
        codes = [self.language_names.setdefault(code, len(self.language_names)) for code in found]
        self.language_codes += np.array(codes, dtype=np.uint16).tobytes()

    def add(self, batch: RowBatch) -> None:
        self.rows_in += len(batch.numbers)
        # per-row template kwargs: the row path reads them
        columns = batch.table is not None and not self.spec.chat_template_kwargs_from
        converted = columnar.convert(batch.table, self.spec, self.roles) if columns else None
        plain = converted.plain if converted is not None else np.zeros(len(batch.numbers), dtype=bool)
        if converted is not None and plain.any():
            self._add_plain(batch, converted)
        records, pids = [], bytearray()
        found_languages: list[str] = []
        texts: list[str] = []
        text_rows: list[int] = []
        for raw in batch.raw_rows(np.flatnonzero(~plain).tolist()):
            try:
                messages, tools = to_prompt(raw.value, self.spec)
                kwargs = row_template_kwargs(raw.value, self.spec)
            except Drop as d:
                self.drops.add(d.reason, raw.location, d.detail)
                continue
            texts += [m["content"] for m in messages]
            if self.spec.languages is not None:
                found_languages.append(language.of_messages(messages))
            text_rows += [len(records)] * len(messages)
            pid = prompt_id(messages, tools, kwargs)
            self.dedup_digests += bytes.fromhex(dedup_key(messages, tools, kwargs)[:32])
            pids += bytes.fromhex(pid)
            records.append(
                {
                    "prompt_id": pid,
                    "source": self.source,
                    "category": self.spec.category,
                    "messages": _RECORD_JSON.encode(messages),
                    "tools": None if tools is None else _RECORD_JSON.encode(tools),
                    "meta": _META_JSON.encode(raw.origin),
                    "template_kwargs": None if kwargs is None else _RECORD_JSON.encode(kwargs),
                    "location": raw.location,
                }
            )
        self.pids += pids
        if self.spec.languages is not None:
            self._add_languages(found_languages)
        self.spill.add(pa.Table.from_pylist(records, schema=_SPILL_SCHEMA), _native_u64(pids))
        if self.filters.active:
            self.filters.add(np.array(text_rows, dtype=np.int64), pa.array(texts, pa.string()), len(records))

    def _add_plain(self, batch: RowBatch, converted: columnar.Converted) -> None:
        import pyarrow.compute as pc

        digest = np.frombuffer(columnar.digests(converted.prompt_bodies, 16), dtype=np.uint8).reshape(-1, 16).copy()
        pids = digest[:, :8].tobytes()
        if len(converted.refolded_rows):  # the rest: their prompt body's digest (dedup_key)
            refolded = np.frombuffer(columnar.digests(converted.dedup_bodies, 16), dtype=np.uint8)
            digest[converted.refolded_rows] = refolded.reshape(-1, 16)
        self.pids += pids
        self.dedup_digests += digest.tobytes()
        count = len(converted.messages)
        hex_ids = pids.hex().encode("ascii")
        ids = pa.StringArray.from_buffers(
            count, pa.py_buffer(np.arange(0, 16 * count + 1, 16, dtype=np.int32).tobytes()), pa.py_buffer(hex_ids)
        )
        numbers = pa.array(batch.numbers[converted.plain]).cast(pa.string())
        join = pc.binary_join_element_wise
        records = pa.table(
            {
                "prompt_id": ids,
                "source": pa.repeat(self.source, count).cast(pa.string()),
                "category": pa.repeat(self.spec.category, count).cast(pa.string()),
                "messages": converted.messages.cast(pa.string()),
                "tools": pa.nulls(count, pa.string()),
                "meta": join(f'{{"input": {_META_JSON.encode(batch.input)}, "row": ', numbers, "}", ""),
                "template_kwargs": pa.nulls(count, pa.string()),
                "location": join(batch.where, numbers, ""),
            },
            schema=_SPILL_SCHEMA,
        )
        if self.spec.languages is not None:
            self._add_languages(language.of_messages_json(converted.messages.cast(pa.string()).to_pylist()))
        self.spill.add(records, _native_u64(bytearray(pids)))
        if self.filters.active:
            self.filters.add(converted.text_rows, converted.texts, count)

    def _in_languages(self, rows: np.ndarray, pids: np.ndarray) -> tuple[np.ndarray, list[Example]]:
        """Of ``rows``, those in the source's languages (all without a list), and examples of the rest."""
        if self.spec.languages is None:
            return rows, []
        names = list(self.language_names)
        allowed = np.array([name in self.spec.languages for name in names], dtype=bool)
        codes = np.frombuffer(self.language_codes, dtype=np.uint16)[rows]
        keep = allowed[codes]
        self.drops.counts[DROP_LANGUAGE] += int((~keep).sum())
        examples = [
            Example(DROP_LANGUAGE, int(pids[rows[i]]), detail=f"language '{names[codes[i]]}'")
            for i in np.flatnonzero(~keep)[:EXAMPLES_PER_REASON]
        ]
        return rows[keep], examples

    def selection(self, shard_names: list[str]) -> Selection:
        """Dedup, then max_samples, on the digests."""
        spec, drops = self.spec, self.drops
        pid_values = _native_u64(self.pids)
        winner_rows = _group_first_rows(_native_u64(self.dedup_digests).reshape(-1, 2), pid_values)
        winners = pid_values[winner_rows]
        drops.counts[DROP_DUPLICATE] += len(pid_values) - len(winners)  # examples: as the shards are written
        in_language, language_examples = self._in_languages(winner_rows, pid_values)
        filtered = self.filters.apply(in_language, pid_values, EXAMPLES_PER_REASON)
        filtered.examples[:0] = language_examples
        drops.counts.update(filtered.counts)
        kept = pid_values[filtered.rows]
        selected = kept
        if spec.max_samples is not None and len(kept) > spec.max_samples:
            ranks = _native_u64(bytearray(selection_ranks(spec.seed, kept))).reshape(-1, 2)
            by_rank = np.lexsort((ranks[:, 1], ranks[:, 0]))
            over = by_rank[spec.max_samples :]
            drops.counts[DROP_OVER_MAX_SAMPLES] += len(over)
            drops.examples[DROP_OVER_MAX_SAMPLES] = [f"{int(kept[i]):016x}" for i in over[:EXAMPLES_PER_REASON]]
            selected = np.sort(kept[by_rank[: spec.max_samples]])
        for reason in (DROP_DUPLICATE, DROP_LANGUAGE):
            if not drops.counts[reason]:
                del drops.counts[reason]
        bands = None
        if self.filters.near is not None:
            bands = self.filters.bands(filtered.rows[np.searchsorted(kept, selected)])
        references = self.filters.references.summary if self.filters.references is not None else None
        return Selection(selected, winners, self.rows_in, drops, shard_names, filtered.examples, bands, references)


def _group_firsts(keys: Any, pids: Any) -> Any:
    """The smallest prompt id of each group of rows with equal ``keys`` (two 64-bit words a row),
    ascending."""
    return pids[_group_first_rows(keys, pids)]


def _group_first_rows(keys: Any, pids: Any) -> Any:
    """The row of :func:`_group_firsts`' each prompt id, in the same order."""
    order, tied = _sorted_by(keys[:, 0], lambda rows: np.lexsort((pids[rows], keys[rows, 1], keys[rows, 0])))
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = ~tied
    at = np.flatnonzero(tied) + 1
    starts[at] = keys[order[at], 1] != keys[order[at - 1], 1]
    # the same prompt id is the same messages, so it is in one group only: no two firsts share one
    firsts = order[starts]
    return firsts[np.argsort(pids[firsts])]


def _sorted_by(words: Any, order_of: Callable[[Any], Any]) -> tuple[Any, Any]:
    """Row order by ``words`` (64-bit integers), rows that tie on them ordered by ``order_of(rows)``
    (their order under a full key that starts with ``words``); and, for each row in that order but
    the first, whether it ties the row before on ``words``. One unstable sort of every row; only the
    tied runs (duplicates, mostly) are sorted again: a lexsort of every row on the full key costs
    ten times as much."""
    order = np.argsort(words)
    ordered = words[order]
    tied = ordered[1:] == ordered[:-1]
    in_run = np.zeros(len(order), dtype=bool)
    in_run[1:] |= tied
    in_run[:-1] |= tied
    at = np.flatnonzero(in_run)  # whole runs: sorting them again keeps each run where it is
    rows = order[at]
    order[at] = rows[order_of(rows)]
    return order, tied


def selection_ranks(seed: int, pids: Any) -> bytes:
    """:func:`selection_rank` of each prompt id (64-bit integers): the first 16 bytes of each digest."""
    head, tail = b'{"prompt_id":"', f'","seed":{hashing.canonical_json(seed)}}}'.encode()
    bodies = np.empty((len(pids), len(head) + 16 + len(tail)), dtype=np.uint8)
    bodies[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    hex_ids = np.asarray(pids, dtype=">u8").tobytes().hex().encode("ascii")
    bodies[:, len(head) : len(head) + 16] = np.frombuffer(hex_ids, dtype=np.uint8).reshape(-1, 16)
    bodies[:, len(head) + 16 :] = np.frombuffer(tail, dtype=np.uint8)
    width = bodies.shape[1]
    offsets = pa.py_buffer(np.arange(0, width * len(pids) + 1, width, dtype=np.int64).tobytes())
    texts = pa.LargeStringArray.from_buffers(len(pids), offsets, pa.py_buffer(bodies.tobytes()))
    return columnar.digests(texts, 16)


def _scan(plan: Plan, source: str, spill: _Spill) -> Selection:
    """Read and convert every row once, spill it, and select."""
    sp: SourcePlan = plan.sources[source]
    scanned = _Scanned(source, sp.spec, spill, text_filters(plan))
    for batch in _batches(plan, source):
        scanned.add(batch)
    spill.close()
    return scanned.selection(sp.shards)


def text_filters(plan: Plan) -> TextFilters:
    """The filters the config turns on: decontaminate's reference index is read once per prepare."""
    decon = plan.config.decontaminate
    references = None if decon is None else ReferenceIndex.build(decon, plan.reference_files)
    return TextFilters(plan.config.dedup.near, references)


def _native_u64(big_endian: bytearray) -> Any:
    """Big-endian 64-bit words as native integers, in place (no copy of the digest set)."""
    words = np.frombuffer(big_endian, dtype=">u8")
    return words.byteswap(inplace=True).view(np.uint64) if words.dtype != np.dtype(np.uint64) else words


def select(plan: Plan, source: str) -> Selection:
    """Prepare's selection without writing anything (``dflash-build plan`` uses it): memory as prepare."""
    selection = _scan(plan, source, _Spill(None, 1))
    _record_examples(selection, {})
    return selection


def _write_shards(selection: Selection, spill: _Spill, out_dir: Path) -> dict[str, dict[str, int | str]]:
    """Read the spill back bucket by bucket and write each shard as soon as its rows are all there."""
    bounds = iter(zip(selection.shard_names, selection.bounds(), strict=True))
    name, (lo, hi) = next(bounds)
    written: dict[str, dict[str, int | str]] = {}
    pending: list[pa.Table] = []
    have = 0

    def flush_full() -> None:
        nonlocal name, lo, hi, pending, have
        while have >= hi - lo:
            table = pa.concat_tables(pending) if pending else _SPILL_SCHEMA.empty_table()
            shard, rest = table.slice(0, hi - lo), table.slice(hi - lo)
            written[name] = atomic.write_parquet(
                layout.shard_file(out_dir, name),
                shard.select(PROMPT_SCHEMA.names),
                ["source", "category"],
                ["prompt_id"],
            )
            # a slice, not a copy: it holds the buffers of this bucket and at most one shard before it
            pending, have = ([rest] if rest.num_rows else []), rest.num_rows
            step = next(bounds, None)
            if step is None:
                return
            name, (lo, hi) = step

    flush_full()  # leading empty shards, when there are more shards than rows
    wanted = _example_ids(selection)
    for table in spill.tables():
        if wanted:
            _locate(table, wanted)
        kept = _selected_in_order(table, selection)
        if kept.num_rows:
            pending.append(kept)
            have += kept.num_rows
            flush_full()
        del table, kept
    if len(written) != len(selection.shard_names):
        raise RuntimeError(f"prepare wrote {len(written)} of {len(selection.shard_names)} shards; this is a bug")
    _record_examples(selection, {pid: where for pid, where in wanted.items() if where is not None})
    return written


def _example_ids(selection: Selection) -> dict[int, str | None]:
    """The prompt ids whose locations the filter examples name (None until found)."""
    ids = [e.pid for e in selection.examples] + [e.matched_pid for e in selection.examples if e.matched_pid is not None]
    return dict.fromkeys(ids)


def _locate(bucket: pa.Table, wanted: dict[int, str | None]) -> None:
    ids = hashing.hex_to_u64(bucket.column("prompt_id"))
    for i in np.flatnonzero(np.isin(ids, np.fromiter(wanted, dtype=np.uint64, count=len(wanted)))):
        pid = int(ids[i])
        if wanted[pid] is None:  # a repeated row: the first one found stands for it
            wanted[pid] = bucket.column("location")[int(i)].as_py()


def _record_examples(selection: Selection, where: dict[int, str]) -> None:
    """The filters' examples, each naming where the dropped row (and its near-copy) came from."""

    def named(pid: int) -> str:
        return where.get(pid) or f"prompt {pid:016x}"

    for e in selection.examples:
        detail = e.detail if e.matched_pid is None else f"near-copy of {named(e.matched_pid)}"
        selection.drops.examples[e.reason].append(f"{named(e.pid)}: {detail}")


def _selected_in_order(bucket: pa.Table, selection: Selection) -> pa.Table:
    """A bucket's rows that become prompts, by prompt id: each id once (of rows repeated in the input,
    the one with the smallest meta), and only the selected ids."""
    ids = hashing.hex_to_u64(bucket.column("prompt_id"))
    meta = bucket.column("meta")
    order, repeat = _sorted_by(ids, lambda rows: _id_meta_order(ids[rows], meta.take(pa.array(rows))))
    ids = ids[order]
    keep = np.ones(len(ids), dtype=bool)
    keep[1:] = ~repeat
    at = np.searchsorted(selection.selected, ids)
    inside = at < len(selection.selected)
    keep &= inside
    keep[inside] &= selection.selected[at[inside]] == ids[inside]
    _duplicate_examples(selection, bucket.column("location"), order, ids, keep, repeat)
    return bucket.take(pa.array(order[keep]))


def _id_meta_order(ids: Any, meta: pa.Array) -> Any:
    import pyarrow.compute as pc

    keys = pa.table({"id": ids, "meta": meta})
    return pc.sort_indices(keys, [("id", "ascending"), ("meta", "ascending")]).to_numpy()


def _duplicate_examples(
    selection: Selection, locations: pa.ChunkedArray, order: Any, ids: Any, keep: Any, repeat: Any
) -> None:
    """Note where dropped duplicates came from: rows (``order``, sorted ``ids``; ``repeat``: each but the
    first repeats the id before) not kept whose id is no group's smallest, or repeats an id just kept
    (the rest that is not kept went over max_samples)."""
    examples = selection.drops.examples[DROP_DUPLICATE]
    if len(examples) >= EXAMPLES_PER_REASON or DROP_DUPLICATE not in selection.drops.counts:
        return
    at = np.minimum(np.searchsorted(selection.winners, ids), max(len(selection.winners) - 1, 0))
    is_winner = selection.winners[at] == ids if len(selection.winners) else np.zeros(len(ids), dtype=bool)
    repeats = np.zeros(len(ids), dtype=bool)
    repeats[1:] = repeat
    for i in np.flatnonzero(~keep & (~is_winner | repeats))[: EXAMPLES_PER_REASON - len(examples)]:
        examples.append(locations[int(order[i])].as_py())


class SourceLossError(RuntimeError):
    """A source lost too many rows (or all of them) in prepare; the message says why and what to change."""


SAMPLE_ROWS = 1000


def check_sample(plan: Plan, source: str, rows: int = SAMPLE_ROWS) -> None:
    """Fail at planning when the first ``rows`` rows of a local source are all defects (a wrong
    ``format`` or ``fields``), which its prepare job would find only after other jobs took the GPUs.

    Reads one batch, so it costs milliseconds; a source that allows every loss (max_drop_fraction 1)
    is not checked. The full check is prepare's (:func:`check_losses`), and ``dflash-build plan`` runs it.
    """
    spec = plan.sources[source].spec
    if spec.hf is not None or spec.max_drop_fraction >= 1:
        return
    drops = DropCounter()
    seen = 0
    for row in itertools.islice(_raw_rows(plan, source), rows):
        seen += 1
        try:
            to_prompt(row.value, spec)
            row_template_kwargs(row.value, spec)
            return
        except Drop as drop:
            if drop.reason in INTENDED_DROPS:
                return
            drops.add(drop.reason, row.location, drop.detail)
    if not seen:
        return  # an empty input: prepare says so, with its own message
    key = f"sources.{source}"
    extra = f" or {key}.chat_template_kwargs_from" if spec.chat_template_kwargs_from else ""
    reasons = "; ".join(
        f"{reason}: {n}" + (f", e.g. {drops.examples[reason][0]}" if drops.examples[reason] else "")
        for reason, n in drops.counts.most_common(3)
    )
    raise SourceLossError(
        f"{key} ({', '.join(spec.files)}): the first {seen} rows are all dropped for defects ({reasons}), so "
        f"its prepare job would fail after the other sources' jobs took the GPUs. Fix {key}.format or "
        f"{key}.fields{extra}; if only these first rows are bad, set {key}.max_drop_fraction: 1.0 to skip this check."
    )


def check_losses(spec: SourceSpec, selection: Selection) -> None:
    """Fail loudly when a source yields nothing or drops more than ``max_drop_fraction`` to defects.

    Duplicates, ``max_samples`` and the length filters are what the config asked for and never count.
    """
    drops = selection.drops
    rows_out = selection.rows_out
    defects = {r: n for r, n in drops.counts.items() if r not in INTENDED_DROPS}
    lost = sum(defects.values())
    key = f"sources.{spec.name}"
    where = f"{key} ({', '.join(spec.files) if spec.hf is None else spec.hf.path})"
    if selection.rows_in == 0:
        raise SourceLossError(f"{where}: the input has no rows; check {key}.files / {key}.hf (path, name, split)")
    intended = {r: n for r, n in drops.counts.items() if r in INTENDED_DROPS}
    if rows_out == 0 and intended and sum(intended.values()) >= lost:
        steps = "; ".join(
            f"{reason} {n} ({DROP_SETTINGS[reason]}"
            + (f", e.g. {drops.examples[reason][0]})" if drops.examples[reason] else ")")
            for reason, n in sorted(intended.items(), key=lambda kv: -kv[1])
        )
        raise SourceLossError(
            f"{where}: every one of its {selection.rows_in} rows was removed, so the source yields no prompt "
            f"at all: {steps}. Loosen that step or remove the source."
        )
    fraction = lost / selection.rows_in
    if rows_out > 0 and fraction <= spec.max_drop_fraction:
        return
    lines = [
        f"{where}: {lost} of {selection.rows_in} rows ({fraction:.1%}) were dropped for defects"
        + (", so the source yields no prompt at all" if rows_out == 0 else "")
        + f"; the limit is {spec.max_drop_fraction:.0%} ({key}.max_drop_fraction or checks.max_drop_fraction)."
    ]
    for reason, n in sorted(drops.counts.items(), key=lambda kv: -kv[1])[:4]:
        examples = "; ".join(drops.examples[reason][:2])
        lines.append(f"  {reason}: {n} rows" + (f", e.g. {examples}" if examples else ""))
    lines.append(
        f"Fix the mapping ({key}.format, {key}.fields, {key}.roles) if the rows are good but read wrongly; "
        f"raise {key}.max_drop_fraction if these rows are meant to go."
    )
    raise SourceLossError("\n".join(lines))


def run(plan: Plan, source: str, manifest_path: Path | None = None) -> dict[str, Any]:
    """Build every prompt shard and then the manifest of ``source`` (at ``manifest_path``: Snakemake's
    output, else the plan's); returns the manifest. Nothing is published unless the source passes
    :func:`check_losses`."""
    import tempfile

    sp = plan.sources[source]
    manifest_path = manifest_path or plan.prompt_manifest(source)
    out_dir = manifest_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    # named like every temporary of the store: `gc` removes the spill of a killed prepare (stray_temporaries)
    with tempfile.TemporaryDirectory(prefix=".spill-", suffix=".tmp", dir=out_dir) as spill_dir:
        spill = _Spill(Path(spill_dir), _bucket_count(sp.raw_rows or sp.planned_rows))
        selection = _scan(plan, source, spill)
        check_losses(sp.spec, selection)
        shard_files = _write_shards(selection, spill, out_dir)
    if selection.bands is not None:
        neardup.write_bands(plan.prompt_bands(source), selection.selected, selection.bands)
    drops = selection.drops
    manifest = {
        "stage": "prepare",
        "source": source,
        "prompt_key": sp.prompt_key,
        "components": sp.prompt_components,
        "rows_in": selection.rows_in,
        "rows_out": selection.rows_out,
        "drops": dict(sorted(drops.counts.items())),
        "drop_examples": dict(sorted((r, e) for r, e in drops.examples.items() if e)),
        "shards": shard_files,
    }
    if selection.references is not None:
        manifest["references"] = selection.references
    atomic.write_json(manifest_path, manifest)
    log.info(
        "%s: %d rows in, %d prompts in %d shards, drops %s",
        source,
        selection.rows_in,
        selection.rows_out,
        sp.n_shards,
        dict(drops.counts),
    )
    return manifest
