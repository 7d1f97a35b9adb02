"""Content keys: a SHA-256 over canonical JSON, and file digests (cached in the store: store.fingerprints).

Canonical JSON sorts keys, has no insignificant whitespace, and writes every number one way: integral
floats become ints (``1.0`` and ``1`` are the same sampling value) and other floats use ``repr``,
the shortest string that round-trips. A key is the first 16 hex digits of the digest; the full digest
and every component go into the manifest next to the data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

KEY_LENGTH = 16
_CHUNK = 8 << 20


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


SPLITMIX_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: spreads consecutive inputs apart


def splitmix64(x: Any) -> Any:
    """SplitMix64's finaliser over a numpy uint64 array: a bijection of 64-bit integers that spreads
    every input bit (the mix's ranks, the variant draw)."""
    import numpy as np

    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
