"""Atomic writes: every store file appears whole or not at all.

A file is written under a temporary name in its destination folder, flushed, fsync'd and renamed over
the destination; the folder is fsync'd so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

# mkstemp/mkdtemp create 0600/0700 temporaries; a published file gets the modes a plain open() would
# give it (0666/0777 less the umask), so others on the machine can read the store and the dataset.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
DIR_MODE = 0o777 & ~_UMASK


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success fsync it and rename it to ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except OSError as e:
        if e.filename is None:  # a failed write or fsync names no file: name the one being written
            e.filename = str(dest)
        raise
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(dest: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    with atomic_path(dest) as tmp, open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
        yield f


def write_json(dest: str | os.PathLike[str], obj: Any) -> None:
    with atomic_open(dest) as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def write_text(dest: str | os.PathLike[str], text: str) -> None:
    with atomic_open(dest) as f:
        f.write(text)


def write_parquet(
    dest: str | os.PathLike[str],
    table: pa.Table,
    dictionary: bool | list[str] = True,
    statistics: bool | list[str] = True,
) -> dict[str, int | str]:
    """Write ``table``; returns {"rows", "sha256"} of the file, for the sidecar that `verify` checks.

    ``dictionary`` and ``statistics``: the columns to dictionary-encode and keep min/max of (all by
    default). Long unique texts gain nothing from either, and both cost a pass over every value."""
    import hashlib

    with atomic_path(dest) as tmp:
        pq.write_table(table, tmp, compression="zstd", use_dictionary=dictionary, write_statistics=statistics)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
    return {"rows": table.num_rows, "sha256": digest}


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder under a temporary name beside ``dest``, then swap it in with renames.

    Every file inside must already be fsync'd by the caller (use the write_* helpers).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(DIR_MODE)
    try:
        yield tmp
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def remove_dir(path: str | os.PathLike[str]) -> None:
    """Remove a folder at once under its own name: it is renamed away first, then deleted.

    A crash mid-way leaves a ``.NAME.*.old`` folder (gc's stray temporaries), never a half folder.
    """
    path = Path(path)
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.replace(path, old / path.name)
    fsync_dir(path.parent)
    shutil.rmtree(old)


def link(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Make ``dest`` a second name of ``src`` (a hard link), atomically; a copy where links fail.

    Two names of one file: deleting either keeps the other, and neither costs space twice.
    """
    with atomic_path(dest) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:  # a file system without hard links (or another device): a real copy
            shutil.copyfile(src, tmp)
