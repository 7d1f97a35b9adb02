"""Prepare stage: raw rows of one source → deduplicated, selected, sharded prompt records.

Every row that does not become a prompt is counted by reason (``DROP_*``) in the prompt manifest, with
a few example locations, so nothing disappears silently. The result does not depend on the order of
the input rows or files: duplicates keep the smallest prompt id, ``max_samples`` keeps the rows with
the smallest seeded hash, and shards take contiguous runs of prompt ids.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import atomic, hashing, readers
from dflash_build.config import FORMAT_FIELDS, SourceSpec
from dflash_build.plan import Plan, SourcePlan, fingerprint_cache
from dflash_build.records import PROMPT_SCHEMA

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
EXAMPLES_PER_REASON = 5
# Drops the config asked for: they never count towards a source's loss (checks.max_drop_fraction).
INTENDED_DROPS = frozenset({DROP_DUPLICATE, DROP_OVER_MAX_SAMPLES, DROP_TOO_SHORT, DROP_TOO_LONG})

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


def iter_local_rows(path: Path, digest: str) -> Iterator[RawRow]:
    """Rows of a .jsonl, .json (a list of objects) or .parquet file, each with its location."""
    short = digest[: hashing.KEY_LENGTH]
    if path.suffix == ".parquet":
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for value in batch.to_pylist():
                yield RawRow(f"{path}:row {index}", {"input": short, "row": index}, value)
                index += 1
    elif path.suffix == ".jsonl":
        for lineno, value in readers.iter_jsonl(path):
            yield RawRow(f"{path}:{lineno}", {"input": short, "row": lineno}, _as_drop(value))
    else:
        try:
            items = readers.load_json(path)
        except json.JSONDecodeError as e:  # a whole file that does not parse has no rows to count
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        for index, value in enumerate(items):
            yield RawRow(f"{path}:item {index}", {"input": short, "row": index}, _as_drop(value))


def _as_drop(value: Any) -> Any:
    if isinstance(value, readers.InvalidUtf8):
        return Drop(DROP_INVALID_UTF8, value.detail)
    if isinstance(value, readers.InvalidJson):
        return Drop(DROP_MALFORMED, value.detail)
    return value


def iter_hf_rows(spec: SourceSpec) -> Iterator[RawRow]:
    import datasets

    hf = spec.hf
    assert hf is not None
    ds = datasets.load_dataset(
        hf.path, hf.name, split=hf.split, revision=None if hf.is_local else hf.revision, data_files=hf.data_files
    )
    for index, value in enumerate(ds):
        yield RawRow(f"{hf.path}[{hf.split}]#{index}", {"input": "hf", "row": index}, value)


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
    roles = {**DEFAULT_ROLES, **{k.lower(): v for k, v in spec.roles.items()}}
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


def prompt_id(messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> str:
    return hashing.content_key({"messages": messages, "tools": tools})


def dedup_key(messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> str:
    """Exact duplicates after Unicode NFC, whitespace folding and trimming."""

    def norm(text: str) -> str:
        return " ".join(unicodedata.normalize("NFC", text).split())

    return hashing.digest({"messages": [[m["role"], norm(m["content"])] for m in messages], "tools": tools})


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


@dataclass
class Selection:
    """Prepare's result before anything is written: the kept records by shard, and the accounting."""

    shards: dict[str, list[dict[str, Any]]]
    rows_in: int
    drops: DropCounter


def select(plan: Plan, source: str) -> Selection:
    """Load, convert, drop, dedup, select and shard one source, in memory (`plan` uses it too)."""
    sp: SourcePlan = plan.sources[source]
    spec = sp.spec
    drops = DropCounter()
    kept: dict[str, dict[str, Any]] = {}  # dedup key -> record
    rows_in = 0
    if spec.hf is None:
        cache = fingerprint_cache(plan.config)
        raw_rows: Iterator[RawRow] = (r for f in sp.input_files for r in iter_local_rows(f, cache.file(f)))
    else:
        raw_rows = iter_hf_rows(spec)
    for raw in raw_rows:
        rows_in += 1
        try:
            messages, tools = to_prompt(raw.value, spec)
        except Drop as d:
            drops.add(d.reason, raw.location, d.detail)
            continue
        record = {
            "prompt_id": prompt_id(messages, tools),
            "source": source,
            "category": spec.category,
            "messages": json.dumps(messages, ensure_ascii=False),
            "tools": None if tools is None else json.dumps(tools, ensure_ascii=False),
            "meta": json.dumps(raw.origin, sort_keys=True),
        }
        key = dedup_key(messages, tools)
        other = kept.get(key)
        if other is None:
            kept[key] = record
            continue
        drops.add(DROP_DUPLICATE, raw.location)
        if (record["prompt_id"], record["meta"]) < (other["prompt_id"], other["meta"]):
            kept[key] = record
    records = list(kept.values())
    if spec.max_samples is not None and len(records) > spec.max_samples:
        records.sort(key=lambda r: selection_rank(spec.seed, r["prompt_id"]))
        for r in records[spec.max_samples :]:
            drops.add(DROP_OVER_MAX_SAMPLES, r["prompt_id"])
        records = records[: spec.max_samples]
    records.sort(key=lambda r: r["prompt_id"])
    bounds = shard_bounds(len(records), sp.n_shards)
    return Selection({name: records[lo:hi] for name, (lo, hi) in zip(sp.shards, bounds, strict=True)}, rows_in, drops)


class SourceLossError(RuntimeError):
    """A source lost too many rows (or all of them) in prepare; the message says why and what to change."""


def check_losses(spec: SourceSpec, selection: Selection) -> None:
    """Fail loudly when a source yields nothing or drops more than ``max_drop_fraction`` to defects.

    Duplicates, ``max_samples`` and the length filters are what the config asked for and never count.
    """
    drops = selection.drops
    rows_out = sum(len(r) for r in selection.shards.values())
    defects = {r: n for r, n in drops.counts.items() if r not in INTENDED_DROPS}
    lost = sum(defects.values())
    key = f"sources.{spec.name}"
    where = f"{key} ({', '.join(spec.files) if spec.hf is None else spec.hf.path})"
    if selection.rows_in == 0:
        raise SourceLossError(f"{where}: the input has no rows; check {key}.files / {key}.hf (path, name, split)")
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
        lines.append(f"  {reason}: {n} rows, e.g. {examples}")
    lines.append(
        f"Fix the mapping ({key}.format, {key}.fields, {key}.roles) if the rows are good but read wrongly; "
        f"raise {key}.max_drop_fraction if these rows are meant to go."
    )
    raise SourceLossError("\n".join(lines))


def run(plan: Plan, source: str) -> dict[str, Any]:
    """Build every prompt shard and the manifest of ``source``; returns the manifest."""
    sp = plan.sources[source]
    selection = select(plan, source)
    check_losses(sp.spec, selection)
    out_dir = plan.prompt_dir(source)
    shard_files = {
        name: atomic.write_parquet(out_dir / f"{name}.parquet", pa.Table.from_pylist(records, schema=PROMPT_SCHEMA))
        for name, records in selection.shards.items()
    }
    drops = selection.drops
    rows_out = sum(len(r) for r in selection.shards.values())
    manifest = {
        "stage": "prepare",
        "source": source,
        "prompt_key": sp.prompt_key,
        "components": sp.prompt_components,
        "rows_in": selection.rows_in,
        "rows_out": rows_out,
        "drops": dict(sorted(drops.counts.items())),
        "drop_examples": dict(sorted(drops.examples.items())),
        "shards": shard_files,
    }
    atomic.write_json(out_dir / "manifest.json", manifest)
    log.info(
        "%s: %d rows in, %d prompts in %d shards, drops %s",
        source,
        selection.rows_in,
        rows_out,
        sp.n_shards,
        dict(drops.counts),
    )
    return manifest
