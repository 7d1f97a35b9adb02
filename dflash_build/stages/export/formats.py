"""The export formats' descriptor and registry: each format is one module of this package defining
``FORMAT`` (or ``FORMATS`` for several), found by module; nothing outside the exports names one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build import discovery
from dflash_build.spec import ExportSpec, SourceSpec
from dflash_build.stages.export.jsonl import JsonlShards


@dataclass(frozen=True)
class Written:
    """What a format's writer gets: the dataset's parquet files, each source's (prompt shard, completion
    shard) pairs when the format reads the store, its settings, the shards it writes, the sources."""

    files: Sequence[Path]
    stores: Mapping[str, list[tuple[Path, Path]]]
    spec: ExportSpec
    out: JsonlShards
    sources: Mapping[str, SourceSpec]


@dataclass(frozen=True)
class ExportFormat:
    name: str
    write: Callable[[Written], dict[str, Any]]  # writes the rows; returns the counts the manifest keeps
    summary: Callable[[dict[str, Any], Path], str]  # the build summary's line of an export's manifest
    card: Callable[[dict[str, Any]], list[str]]  # the export card's lines about what it holds
    # it reads its sources' prompt and completion shards (the rule declares them), not the dataset alone
    reads_store: bool = False


_REGISTRY = discovery.Registry[ExportFormat]("dflash_build.stages.export", "FORMATS", "FORMAT")
__getattr__ = _REGISTRY.view("FORMATS")  # every export format, by name
get = _REGISTRY.get
