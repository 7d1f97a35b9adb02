"""A dataset folder (``dist/NAME``, ``dist/NAME-packed-N``) that a build replaces whole, atomically, and
only once it has passed its checks.

``dist/NAME`` is a symbolic link to one version, ``dist/.NAME.versions/<digest>/``. A build writes the
next version beside the one in use and then points the link at it with a single rename, so a reader
(``datasets.load_dataset("dist/NAME")``) sees the old dataset or the new one, never part of one or
none, and a build that fails (a missed share, a kill) leaves the last good dataset where it was.

Snakemake's output is the build record, ``dist/.NAME.versions/built/``: the report's plots and tables
(links to the version's own) and the name of the version it made. Snakemake deletes a job's output
before the job runs; deleting the record costs nothing, deleting the dataset would cost the last good
one. gc removes versions that are no longer linked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.store import atomic, layout

RECORD = "built"
VERSION_FILE = "version"
REPORT_PATTERNS = ("plots/*.png", "tables/*.csv")


def versions_dir(folder: Path) -> Path:
    """Where the versions of ``folder`` live: beside it, hidden."""
    return folder.parent / f".{folder.name}.versions"


def record_dir(folder: Path) -> Path:
    """The build record of ``folder``: the output Snakemake knows."""
    return versions_dir(folder) / RECORD


def folder_of(record: Path) -> Path:
    """The folder whose build record is ``record`` (the inverse of :func:`record_dir`)."""
    versions = Path(record).parent
    return versions.parent / versions.name.removeprefix(".").removesuffix(".versions")


def current(folder: Path) -> Path | None:
    """The version ``folder`` links to now; None when there is none (or a folder of the layout before)."""
    if not folder.is_symlink():
        return None
    target = folder.parent / os.readlink(folder)
    return target if target.is_dir() else None


@dataclass(frozen=True)
class InPlace:
    """The version of a published folder in place when a stage began, and its manifest: a version
    swapped in meanwhile does not mix into what the stage writes."""

    version: Path
    manifest: dict[str, Any]

    @property
    def files(self) -> list[Path]:
        return [self.version / f["path"] for f in self.manifest["files"]]


def in_place(folder: Path) -> InPlace:
    """What ``folder`` holds now (a folder of the layout before versions: itself)."""
    version = current(folder) or folder
    return InPlace(version, json.loads((version / layout.MANIFEST).read_text()))


def superseded(folder: Path) -> list[Path]:
    """Versions of ``folder`` that it no longer links to (and the record's strays): gc removes them."""
    versions = versions_dir(folder)
    if not versions.is_dir():
        return []
    keep = {current(folder), record_dir(folder)}
    return [p for p in sorted(versions.iterdir()) if p not in keep and not p.name.endswith(".tmp")]


def recorded_but_missing(folder: Path) -> bool:
    """A build record without the dataset it records: the link was deleted or points nowhere."""
    return record_dir(folder).is_dir() and current(folder) is None


@contextlib.contextmanager
def publish(folder: Path, record: Path) -> Iterator[Path]:
    """Write the next version of ``folder`` into the folder this yields; when the body returns, it
    becomes ``folder`` (one rename) and ``record`` says so. When the body raises, nothing changes.

    The version is named by the digest of its manifest.json, which lists every file's digest.
    """
    versions = versions_dir(folder)
    versions.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".", suffix=".tmp", dir=versions))
    tmp.chmod(atomic.DIR_MODE)
    try:
        yield tmp
        version = versions / hashing.sha256_file(tmp / layout.MANIFEST)[:16]
        if version.exists():  # the same dataset again: the version in place is the one
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, version)
            atomic.fsync_dir(versions)
        _point(folder, version)
        _write_record(record, version)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def unrecorded(folder: Path) -> bool:
    """A dataset in place without its build record: the last build of it failed or was killed (Snakemake
    deleted the record, its output, and the link kept the last good version). The next build runs it again."""
    return current(folder) is not None and not record_dir(folder).is_dir()


def pending(folders: tuple[Path, ...]) -> list[str]:
    """What ``plan`` and ``verify`` say of each folder whose last build failed: the same as ``snakemake -n``."""
    return [
        f"{folder}: built again by the next build (its last build failed or was stopped; the last good "
        f"version, {current(folder).name if current(folder) else '?'}, stays until then)"
        for folder in folders
        if unrecorded(folder)
    ]


def _point(folder: Path, version: Path) -> None:
    """Make ``folder`` a link to ``version`` with one rename (a relative link: the tree can move)."""
    link = folder.parent / f".{folder.name}.{os.getpid()}.link.tmp"  # gc's stray pattern, if we die here
    link.unlink(missing_ok=True)
    os.symlink(os.path.relpath(version, folder.parent), link)
    if folder.is_dir() and not folder.is_symlink():
        # a dataset of the layout before versions (a plain folder): it becomes a version itself; the
        # only moment without dist/NAME, once, at the upgrade
        os.replace(folder, Path(tempfile.mkdtemp(prefix="before-versions.", dir=versions_dir(folder))) / "data")
    os.replace(link, folder)
    atomic.fsync_dir(folder.parent)


def _write_record(record: Path, version: Path) -> None:
    with atomic.atomic_dir(record) as tmp:
        for pattern in REPORT_PATTERNS:
            for path in sorted(version.glob(pattern)):
                (tmp / path.parent.name).mkdir(exist_ok=True)
                atomic.link(path, tmp / path.parent.name / path.name)
        atomic.write_text(tmp / VERSION_FILE, version.name + "\n")
