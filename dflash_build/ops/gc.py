"""`dflash-build gc`: what no registered config or built dataset references, and deleting it."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_build import measurements, trained
from dflash_build.ops.registrations import referenced, registrations
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import acceptance_report_of, trained_drafter_of
from dflash_build.store import atomic, layout
from dflash_build.store.journal import ROWS_FILE
from dflash_build.store.rowindex import RowIndex

TMP_AGE_SECONDS = 3600.0  # a temporary file or folder untouched this long belongs to a dead process
DATASET_BROKEN = "dataset built from deleted entries"


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    kept: bool  # unreferenced but kept (journals, unless asked)
    why: str = "unreferenced"


def _size(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes under ``path``; a file with several names (a shard and its journal's copy) counts once."""
    seen = set() if seen is None else seen
    total = 0
    for p in [path] if path.is_file() else path.rglob("*"):
        st = p.lstat()
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def _last_change(path: Path) -> float:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_mtime
    return max([path.lstat().st_mtime, *(p.lstat().st_mtime for p in path.rglob("*"))])


def all_references(plan: Plan) -> tuple[set[Path], dict[Path, list[str]]]:
    """What this config and every registered one reference; for each entry only others keep, which.

    Every registration counts, also the one of this config's own dataset folder: it names what that
    folder's last build used, which an edited, unbuilt config (this one) may no longer reference.
    """
    store = plan.config.store
    mine = referenced(plan)
    others: dict[Path, list[str]] = {}
    for ident, entry in registrations(store).items():
        for rel in entry["references"]:
            path = store / rel
            if path not in mine:
                others.setdefault(path, []).append(f"{entry['dataset']} ({ident})")
    return mine | set(others), others


def dataset_references(plan: Plan) -> dict[Path, list[str]]:
    """The store entries each built dataset folder was made from (its manifest), by entry: which folders.

    The folders are this config's and every registered config's; a dataset records its keys whatever
    config is current, so what it was built from is known even when its config was edited since.
    """
    store = plan.config.store
    used: dict[Path, list[str]] = {}
    for folder in sorted(_dataset_folders(plan)):
        try:
            manifest = json.loads((folder / layout.MANIFEST).read_text())
            sources = manifest["sources"]
        except (OSError, ValueError, KeyError):
            continue  # not built (yet), or not a dataset of ours
        for name, source in sources.items():
            entries = [layout.stage_dir(store, stage, name, source[stage.key]) for stage in layout.STAGES.values()]
            for entry in [*entries, layout.journal_dir(store, source["gen_key"])]:
                used.setdefault(entry, []).append(os.path.relpath(folder))
    return used


def _dataset_folders(plan: Plan) -> set[Path]:
    """This config's dist folders and every registered config's dataset folder, relative to the working
    directory (a packed folder's manifest names no sources: only the dataset's say what it uses)."""
    named = [*plan.config.dist_folders, *(Path(e["dataset"]) for e in registrations(plan.config.store).values())]
    return {Path(os.path.relpath(os.path.abspath(f))) for f in named}


def _acceptance_reports(plan: Plan) -> set[Path]:
    """The acceptance reports beside this config's dataset and every registered one (relative, like them)."""
    registered = (Path(e["dataset"]) for e in registrations(plan.config.store).values())
    datasets = [plan.config.dataset_dir, *registered]
    return {Path(os.path.relpath(os.path.abspath(acceptance_report_of(d)))) for d in datasets}


def _drafter_folders(plan: Plan) -> set[Path]:
    """The trained drafters beside this config's dataset and every registered one (relative, like them)."""
    registered = (Path(e["dataset"]) for e in registrations(plan.config.store).values())
    datasets = [plan.config.dataset_dir, *registered]
    return {Path(os.path.relpath(os.path.abspath(trained_drafter_of(d)))) for d in datasets}


def stray_temporaries(plan: Plan, older_than: float = TMP_AGE_SECONDS) -> list[Path]:
    """Temporary files and folders of atomic writes whose writer died (untouched for ``older_than`` s)."""
    now = time.time()
    found = {*plan.config.store.rglob(".*.tmp"), *plan.config.store.rglob(".*.old")}
    for dist in (*plan.config.dist_folders, plan.config.acceptance_dir):
        found |= {*dist.parent.glob(f".{dist.name}.*.tmp"), *dist.parent.glob(f".{dist.name}.*.old")}
        versions = release.versions_dir(dist)
        found |= {*versions.glob(".*.tmp"), *versions.glob(".*.old")}
    out = []
    for path in sorted(found):
        if any(parent in found for parent in path.parents):
            continue  # inside a stray folder: goes with it
        try:
            if now - _last_change(path) >= older_than:
                out.append(path)
        except FileNotFoundError:  # its writer finished meanwhile
            continue
    return out


def garbage(
    plan: Plan, journals: bool = False, tmp_age: float = TMP_AGE_SECONDS, break_datasets: bool = False
) -> list[Entry]:
    """Store entries no registered config references, and stray temporaries of dead writers.

    An entry a built dataset folder was made from is kept (``why`` names the folder) unless
    ``break_datasets``; then it is deleted, and ``why`` names the folder it breaks.
    """
    store = plan.config.store
    refs, _ = all_references(plan)
    used = dataset_references(plan)
    seen: set[tuple[int, int]] = set()
    out = []

    def consider(entry: Path, kept: bool = False) -> None:
        if entry in used:
            folders = ", ".join(used[entry])
            why = f"breaks dataset {folders}" if break_datasets else f"used by dataset {folders}"
            out.append(Entry(entry, _size(entry, seen), kept=kept or not break_datasets, why=why))
        else:
            out.append(Entry(entry, _size(entry, seen), kept=kept))

    for stage in layout.STAGES.values():
        for entry in layout.stage_entries(store, stage):
            if entry not in refs:
                consider(entry)
    for entry in layout.journal_entries(store):
        if entry not in refs:
            consider(entry, kept=any(entry.rglob(ROWS_FILE)) and not journals)
    # a measurement no drafter of this config keys to and no standing acceptance report was made from
    in_use = measurements.in_use(plan, sorted(_acceptance_reports(plan)))
    out += [Entry(e, _size(e, seen), kept=False) for e in layout.acceptance_entries(store) if e not in in_use]
    # a drafter no published drafter folder was made from (and a training's scratch left behind)
    kept_drafters = trained.in_use(plan, sorted(_drafter_folders(plan)))
    now = time.time()
    for entry in layout.trained_entries(store) + layout.trained_scratch(store):
        running = entry.name.endswith(".work") and now - _last_change(entry) < tmp_age  # a training may be on
        if layout.trained_dir(store, entry.name.removesuffix(".work")) not in kept_drafters and not running:
            out.append(Entry(entry, _size(entry, seen), kept=False))
    # A dataset whose store entries go goes with them (its versions and record, and its packed folders):
    # left in place, Snakemake would call it up to date while plan and verify find its shards gone.
    broken = sorted({Path(folder) for e in out if e.why.startswith("breaks") for folder in used[e.path]})
    for folder in broken:
        for dist in [folder, *sorted(folder.parent.glob(f"{folder.name}-packed-*"))]:
            for path in (dist, release.versions_dir(dist)):
                if path.exists() or path.is_symlink():
                    out.append(Entry(path, _size(path, seen), kept=False, why=DATASET_BROKEN))
    # versions no dataset folder or acceptance report links to any more: this config's, and every registered one's
    folders = _dataset_folders(plan) | _acceptance_reports(plan) | _drafter_folders(plan)
    folders |= {p for f in list(folders) for p in f.parent.glob(f"{f.name}-packed-*") if p.is_symlink()}
    for dist in sorted(folders):
        why = f"superseded version of {os.path.relpath(dist)}"
        out += [Entry(p, _size(p, seen), kept=False, why=why) for p in release.superseded(dist)]
    out += [Entry(p, _size(p, seen), kept=False, why="stray temporary") for p in stray_temporaries(plan, tmp_age)]
    return out


def protected(plan: Plan) -> dict[Path, list[str]]:
    """Store entries this config does not reference but another registered config does."""
    store = plan.config.store
    _, others = all_references(plan)
    return {p: who for p, who in others.items() if p.exists() and p.is_relative_to(store)}


def collect(plan: Plan, entries: list[Entry]) -> int:
    """Delete the entries that are not kept; returns bytes freed."""
    refs, _ = all_references(plan)
    freed = 0
    with RowIndex.open(plan.config.store) as index:
        for entry in entries:
            if entry.kept:
                continue
            if entry.path in refs:
                raise RuntimeError(f"refusing to delete {entry.path}: a registered config references it")
            for shard in entry.path.glob(f"*{layout.DATA}") if entry.path.is_dir() else ():
                index.remove_shard(shard)
            if entry.path.is_symlink():
                entry.path.unlink()
            elif entry.why == DATASET_BROKEN:
                atomic.remove_dir(entry.path)  # never half a dataset under its own name
            elif entry.path.is_dir():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink(missing_ok=True)
            freed += entry.bytes
    return freed
