"""Reading a source: its rows in batches, with their Arrow columns where the reader has them (the
columnar fast path converts those) and each row's Python value for the row path."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing, readers
from dflash_build.plan import Plan, SourcePlan, fingerprint_cache
from dflash_build.spec import SourceSpec
from dflash_build.stages.prepare.drops import DROP_INVALID_UTF8, DROP_MALFORMED, Drop


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


def batches(plan: Plan, source: str) -> Iterator[RowBatch]:
    sp: SourcePlan = plan.sources[source]
    if sp.spec.hf is None:
        cache = fingerprint_cache(plan.config)
        return (b for f in sp.input_files for b in local_batches(f, cache.file(f)))
    return hf_batches(sp.spec)


def raw_rows(plan: Plan, source: str) -> Iterator[RawRow]:
    """Every row of the source, one at a time, as the row path reads it."""
    for batch in batches(plan, source):
        yield from batch.raw_rows(range(len(batch.numbers)))
