"""The store's cache of file fingerprints: content digests kept by (path, size, mtime, inode), so a
dry run over a 50 GB model does not read it again."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.store import atomic

log = logging.getLogger(__name__)


class FingerprintCache:
    """File content hashes cached by (path, size, mtime, inode).

    A dry run over a 50 GB model must not re-read it; a ``touch`` or a copy invalidates the entry
    and the file is hashed again (to the same digest when the bytes did not change).
    """

    def __init__(
        self, cache_file: str | os.PathLike[str] | None, fallback: str | os.PathLike[str] | None = None
    ) -> None:
        """``fallback``: where the cache goes when ``cache_file`` cannot be written (a read-only or full
        store); read too, after ``cache_file`` (entries check their own file's stamp, so either may be stale)."""
        self.cache_file = Path(cache_file) if cache_file is not None else None
        self.fallback = Path(fallback) if fallback is not None else None
        self._entries: dict[str, dict[str, Any]] = {}
        self._dirty = False
        if self.cache_file is not None and self.cache_file.exists():
            problem = cache_problem(self.cache_file)
            if problem is None:
                self._entries = json.loads(self.cache_file.read_text(encoding="utf-8"))
            else:  # only a cache: start afresh (files are hashed again) and replace it on save
                log.warning("fingerprint cache %s is %s: rebuilding it", self.cache_file, problem)
                self._dirty = True
        if self.fallback is not None and self.fallback.exists() and cache_problem(self.fallback) is None:
            self._entries.update(json.loads(self.fallback.read_text(encoding="utf-8")))

    def file(self, path: str | os.PathLike[str]) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        entry = self._entries.get(real)
        fresh = entry is not None and all(entry.get(k) == v for k, v in stamp.items())
        if fresh and isinstance(entry.get("sha256"), str):
            return str(entry["sha256"])
        sha = hashing.sha256_file(real)
        self._entries[real] = {**stamp, "sha256": sha}
        self._dirty = True
        return sha

    def files(
        self, paths: Iterable[str | os.PathLike[str]], root: str | os.PathLike[str] | None = None
    ) -> dict[str, str]:
        """Digest per file, named relative to ``root`` (so moving a model folder keeps its key)."""
        out = {}
        for p in sorted(Path(x) for x in paths):
            name = str(p.relative_to(root)) if root is not None else p.name
            out[name] = self.file(p)
        return out

    def memo(self, key: str) -> Any:
        """A value derived from file contents (e.g. a row count), keyed by a content digest."""
        return self._entries.get(key, {}).get("value")

    def set_memo(self, key: str, value: Any) -> None:
        self._entries[key] = {"value": value}
        self._dirty = True

    def save(self) -> None:
        """Write the cache where it can be written: the store, else the fallback, else nowhere (it is
        only a cache, and a command that only reads must work on a store it cannot write)."""
        if not self._dirty:
            return
        for dest in (self.cache_file, self.fallback):
            if dest is None:
                continue
            try:
                atomic.write_json(dest, self._entries)
            except OSError as e:
                log.debug("fingerprint cache not written to %s (%s)", dest, e)
                continue
            self._dirty = False
            return


def cache_problem(path: Path) -> str | None:
    """Why a fingerprint cache file cannot be used (None: it can)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON and bad UTF-8 alike
        return f"unreadable ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        return "not a cache (a JSON object of entries)"
    return None
