"""Prepare stage: raw rows of one source → deduplicated, selected, sharded prompt records.

Every row that does not become a prompt is counted by reason (``DROP_*``) in the prompt manifest, with
a few example locations, so nothing disappears silently. The result does not depend on the order of
the input rows or files: duplicates keep the smallest prompt id, ``max_samples`` keeps the rows with
the smallest seeded hash, and shards take contiguous runs of prompt ids.
"""

from __future__ import annotations

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

from dflash_build import atomic, hashing
from dflash_build.config import FORMAT_FIELDS, SourceSpec
from dflash_build.plan import Plan, SourcePlan, fingerprint_cache
from dflash_build.records import PROMPT_SCHEMA

log = logging.getLogger(__name__)

DROP_MALFORMED = "malformed_row"
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
_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)


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
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    value = Drop(DROP_MALFORMED, f"invalid JSON: {e.msg}")
                yield RawRow(f"{path}:{lineno}", {"input": short, "row": lineno}, value)
    else:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for index, value in enumerate(data if isinstance(data, list) else [data]):
            yield RawRow(f"{path}:item {index}", {"input": short, "row": index}, value)


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
    """Tool schemas inside a Hermes-style ``<tools>...</tools>`` block: one JSON list or several objects."""
    match = _TOOLS_BLOCK.search(text)
    if match is None:
        return None
    body = match.group(1).strip()
    decoder = json.JSONDecoder()
    items: list[Any] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            raise Drop(DROP_INVALID_TOOLS, f"<tools> block is not JSON: {e.msg}") from e
        items.extend(obj if isinstance(obj, list) else [obj])
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
    return normalise_tools(items)


def _turns(row: Mapping[str, Any], spec: SourceSpec, list_field: str) -> list[dict[str, str]]:
    turns = _field(row, spec, list_field)
    if not isinstance(turns, list):
        raise Drop(DROP_MALFORMED, f"'{list_field}' is {type(turns).__name__}, not a list")
    roles = {**DEFAULT_ROLES, **spec.roles}
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
        messages.append({"role": role, "content": _text(_field(turn, spec, "content"))})
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


def run(plan: Plan, source: str) -> dict[str, Any]:
    """Build every prompt shard and the manifest of ``source``; returns the manifest."""
    sp = plan.sources[source]
    selection = select(plan, source)
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
