"""`dflash-build verify`: every store file against the digest its sidecar or manifest recorded, the
journals, the row index and the dataset records; `--repair` removes what is damaged."""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_build import hashing, measurements
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import Config
from dflash_build.store import atomic, fingerprints, layout, rowindex
from dflash_build.store import records as R
from dflash_build.store.journal import PUBLISHED_DATA, PUBLISHED_STATS, ROWS_FILE, parse
from dflash_build.store.rowindex import RowIndex


@dataclass(frozen=True)
class Problem:
    path: Path
    reason: str
    remove: tuple[Path, ...]  # what --repair deletes so the next build rebuilds exactly this
    heal: Callable[[], object] | None = None  # what --repair does instead, for derived state
    unreadable: bool = False  # this process cannot read it (permission, I/O): no damage, --repair leaves it


def _count_lines(path: Path) -> int:
    """Rows of a JSONL file (an export's): its lines."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


_ACCESS = {errno.EACCES, errno.EPERM, errno.EIO}


class CannotRead(Exception):
    """A file this process cannot read (permission, I/O): not damage, and --repair must not delete it."""


def _check(path: Path, expected: dict[str, Any] | None) -> str | None:
    if expected is None:
        return "no manifest entry or stats sidecar describes it"
    try:
        rows = _count_lines(path) if path.suffix == ".jsonl" else pq.read_metadata(path).num_rows
    except OSError as e:
        if e.errno in _ACCESS or not os.access(path, os.R_OK):
            raise CannotRead(f"cannot be read ({e.strerror or e}): check its permissions and the disk") from e
        return f"unreadable parquet footer ({type(e).__name__}: {e})"
    except Exception as e:
        return f"unreadable parquet footer ({type(e).__name__}: {e})"
    if rows != expected["rows"]:
        return f"{rows} rows, manifest says {expected['rows']}"
    if expected["sha256"] is None:  # recorded by rows alone
        return None
    digest = hashing.sha256_file(path)
    if digest != expected["sha256"]:
        return f"content hash {digest[:16]} differs from the manifest's {expected['sha256'][:16]}"
    return None


def _store_files(plan: Plan) -> Iterator[tuple[Path, dict[str, Any] | None, tuple[Path, ...]]]:
    """(file, what its manifest says, what --repair removes): the file, its sidecar, what derives from it.

    Derived files go too, or Snakemake would never need the repaired file again: a completion shard
    takes its token shard, the dataset and its journal's published copy (the same file, linked) with
    it. A prompt shard takes its source's manifest, the one output of prepare (rules/prepare.smk), so
    that prepare runs again; its completions stay valid (generate depends on the manifest as ancient).
    A shard the manifest lists but the store lacks is reported missing.
    """
    dists = plan.config.dist_folders  # the packed folder derives from the dataset
    # --repair removes a dataset's build record, so that Snakemake builds the folder again; the folder
    # itself (a link to its last good version) stays until the new version replaces it
    records = tuple(release.record_dir(d) for d in dists)

    def with_sidecar(path: Path) -> tuple[Path, Path]:
        return path, layout.sidecar(path)

    def expected(path: Path) -> dict[str, Any] | None:
        sidecar = with_sidecar(path)[1]
        return json.loads(sidecar.read_text()).get("data") if sidecar.exists() else None

    for name, sp in plan.sources.items():
        manifest_file = plan.prompt_manifest(name)
        # without its manifest (prepare's one output) a source's prompt shards are not published yet
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {"shards": {}}
        for shard, path in zip(sp.shards, plan.prompt_shards(name), strict=True):
            if shard in manifest[R.PROMPTS_SHARDS]:
                yield path, manifest[R.PROMPTS_SHARDS][shard], (path, manifest_file)
        built = zip(sp.shards, plan.completion_shards(name), plan.token_shards(name), strict=True)
        for shard, completion, tokens in built:
            published = plan.journal_dir(name, shard)
            copy = (published / PUBLISHED_DATA, published / PUBLISHED_STATS)
            if completion.exists():
                derived = (*with_sidecar(completion), *copy, *with_sidecar(tokens), *records)
                yield completion, expected(completion), derived
            if tokens.exists():
                yield tokens, expected(tokens), (*with_sidecar(tokens), *records)
    for folder in dists:
        manifest_file = folder / layout.MANIFEST
        if manifest_file.exists():
            for info in json.loads(manifest_file.read_text())["files"]:
                yield folder / info["path"], info, records[dists.index(folder) :]


def _journal_problems(store: Path) -> Iterator[Problem]:
    """Damaged journal lines, and published copies that no longer match their sidecar."""
    for rows_file in layout.journal_files(store, ROWS_FILE):
        data = rows_file.read_bytes()
        _, bad = parse(data[: data.rfind(b"\n") + 1])
        if bad:

            def drop_bad_lines(path: Path = rows_file) -> None:
                raw = path.read_bytes()
                good = [line for line in raw[: raw.rfind(b"\n") + 1].splitlines() if parse(line)[0]]
                atomic.write_text(path, "".join(line.decode() + "\n" for line in good))

            reason = f"{len(bad)} damaged lines (first: line {bad[0]}); their rows would be generated again"
            yield Problem(rows_file, reason, (), drop_bad_lines)
    for data in layout.journal_files(store, PUBLISHED_DATA):
        stats_file = data.with_name(PUBLISHED_STATS)
        try:
            expected = json.loads(stats_file.read_text()).get("data")
        except (OSError, ValueError):
            expected = None
        try:
            reason = _check(data, expected)
        except CannotRead as e:
            yield Problem(data, f"published copy: {e}", (), unreadable=True)
            continue
        if reason is not None:
            yield Problem(data, f"published copy: {reason}", (data, stats_file))


def _derived_problems(plan: Plan) -> Iterator[Problem]:
    """The row index: damaged, or out of step with the store (derived state: --repair rebuilds it);
    one that cannot be read (permission, I/O) is reported as such and left alone."""
    store = plan.config.store
    index_file = store / rowindex.INDEX_FILE
    found = RowIndex.problem(store)
    if found is not None and not found[1]:
        yield Problem(index_file, found[0], (), unreadable=True)
        return
    reason = found[0] if found is not None else None
    if reason is None and index_file.exists():
        index = RowIndex(store, rowindex.read_only(index_file))
        try:
            missing, gone = index.differences()
        finally:
            index.close()
        if missing or gone:
            reason = (
                f"out of step with the store: {len(missing)} published shards missing or incomplete, "
                f"{len(gone)} entries for shards that are gone (the next build indexes them)"
            )
    elif reason is None and rowindex.published_shards(store):
        reason = "missing while the store has published shards"
    if reason is not None:
        yield Problem(index_file, reason, (), functools.partial(rowindex.rebuild, store))


def _acceptance_problems(plan: Plan) -> tuple[int, list[Problem]]:
    """The measurements this config's drafters and its acceptance report use: the summary readable, the
    requests as the summary recorded them. --repair removes a damaged one and the report's record, so that
    `snakemake accept` measures that drafter again (the report in place stands until then)."""
    report = plan.config.acceptance_dir
    checked, problems = 0, []
    for folder in sorted(measurements.in_use(plan, [report])):
        summary_file = folder / measurements.SUMMARY_FILE
        if not summary_file.exists():
            continue  # not measured yet, or gone: the report stands; the next accept run measures it
        checked += 1
        remove = (folder, release.record_dir(report))
        try:
            summary = json.loads(summary_file.read_text())
            if summary.get("kind") == "calibration":  # the engine's calibration: its summary is all of it
                _ = summary["trusted"], [s["trusted"] for s in summary["samplings"]]  # a damaged one raises
                continue
            overall = summary["slices"]["all"]["all"]
        except (ValueError, KeyError, TypeError) as e:
            problems.append(Problem(summary_file, f"damaged measurement summary ({type(e).__name__}: {e})", remove))
            continue
        requests = folder / measurements.REQUESTS_FILE
        # a measurement of the version before records no digest: its requests are not checked
        expected = summary.get(measurements.REQUESTS_FILE) or {"rows": overall["requests"], "sha256": None}
        try:
            reason = "missing" if not requests.exists() else _check(requests, expected)
        except CannotRead as e:
            problems.append(Problem(requests, str(e), (), unreadable=True))
            continue
        if reason is not None:
            problems.append(Problem(requests, reason, remove))
    return checked, problems


def cache_problems(config: Config) -> list[Problem]:
    """The fingerprint cache, checked before a plan is built (building one heals it, with a warning)."""
    cache_file = layout.fingerprint_cache_file(config.store)
    if cache_file.exists() and (reason := fingerprints.cache_problem(cache_file)) is not None:
        return [Problem(cache_file, reason + " (only a cache: rebuilt as this command plans)", (cache_file,))]
    return []


def verify(plan: Plan) -> tuple[int, list[Problem]]:
    """Re-read every store and dist file the config references, every journal and the index."""
    checked, problems = 0, []
    for path, expected, remove in _store_files(plan):
        checked += 1
        if not path.exists():
            problems.append(Problem(path, "missing", remove))
            continue
        try:
            reason = _check(path, expected)
        except CannotRead as e:
            problems.append(Problem(path, str(e), (), unreadable=True))
            continue
        if reason is not None:
            problems.append(Problem(path, reason, remove))
    store = plan.config.store
    checked += sum(len(layout.journal_files(store, name)) for name in (ROWS_FILE, PUBLISHED_DATA))
    problems += _journal_problems(store)
    checked += 1
    problems += _derived_problems(plan)
    measured, damaged = _acceptance_problems(plan)
    checked += measured
    problems += damaged
    for folder in plan.config.dist_folders:
        checked += 1
        if release.recorded_but_missing(folder):
            record = release.record_dir(folder)
            problems.append(Problem(folder, f"missing, although {record} records it as built", (record,)))
    return checked, problems


def repair(plan: Plan, problems: list[Problem]) -> list[Path]:
    """Remove what each problem names, and its index entries; the next build regenerates exactly that.

    Derived state (journal lines, the index) is healed in place instead.
    """
    removed = []
    with RowIndex.open(plan.config.store) as index:
        for problem in problems:
            if problem.heal is not None or problem.unreadable:
                continue
            for path in problem.remove:
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
                else:
                    continue
                if layout.is_completion_shard(path):
                    index.remove_shard(path)
                removed.append(path)
    for problem in problems:
        if problem.heal is not None and not problem.unreadable:
            problem.heal()
            removed.append(problem.path)
    return removed
