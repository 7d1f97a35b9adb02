"""Content keys: a SHA-256 over canonical JSON, and cached file fingerprints.

Canonical JSON sorts keys, has no insignificant whitespace, and writes every number one way: integral
floats become ints (``1.0`` and ``1`` are the same sampling value) and other floats use ``repr``,
the shortest string that round-trips. A key is the first 16 hex digits of the digest; the full digest
and every component go into the manifest next to the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflash_build.store import atomic

KEY_LENGTH = 16
_CHUNK = 8 << 20

log = logging.getLogger(__name__)


def normalise(value: Any) -> Any:
    """The JSON value a key hashes: string keys, lists for tuples, integral floats as ints."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite number {value!r} cannot enter a content key")
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return {str(k): normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [normalise(v) for v in value]
    raise TypeError(f"{type(value).__name__} cannot enter a content key: {value!r}")


# One encoder for every key: json.dumps with options builds a new one per call (a third of prepare's
# per-row hashing time).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> str:
    return _CANONICAL.encode(normalise(value))


def digest_normalised(value: Any) -> str:
    """:func:`digest` of a value that is already what :func:`normalise` makes it (str keys, no
    tuples or integral floats): the per-row hashes of prepare skip the walk."""
    return hashlib.sha256(_CANONICAL.encode(value).encode("utf-8")).hexdigest()


def digest(value: Any) -> str:
    """Full SHA-256 hex digest of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def content_key(components: Mapping[str, Any]) -> str:
    """The 16-hex-digit path segment for a key built from ``components``."""
    return digest(components)[:KEY_LENGTH]


def hex_to_u64(ids: Any) -> Any:
    """Prompt ids (16 hex digits, an Arrow string array) as a numpy array of 64-bit integers, read
    straight from Arrow's string buffer: their order as numbers is their order as text."""
    import numpy as np
    import pyarrow as pa

    array = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    if len(array) == 0:
        return np.zeros(0, dtype=np.uint64)
    if pa.types.is_large_string(array.type):
        array = array.cast(pa.string())
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset : array.offset + len(array) + 1]
    if array.null_count or not np.all(np.diff(offsets) == 16):
        raise ValueError("a prompt_id is not 16 hex digits")
    try:  # fromhex skips whitespace: a shorter result says there was some
        words = bytes.fromhex(array.buffers()[2][offsets[0] : offsets[-1]].to_pybytes().decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        words = b""
    if len(words) != 8 * len(array):
        raise ValueError("a prompt_id is not 16 hex digits")
    return np.frombuffer(words, dtype=">u8").astype(np.uint64)


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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
        sha = sha256_file(real)
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
