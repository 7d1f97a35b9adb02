"""Read scalar metadata from a GGUF header without loading tensors.

transformers and gguf's reader parse the whole file (5-10 s for a 100 MB model); a generation job
only needs a couple of scalar keys. Layout: magic, version, tensor count, key/value count, then
key/value pairs (GGUF v2/v3, little-endian).
"""

from __future__ import annotations

import struct
from typing import IO, Any

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: IO[bytes], fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: IO[bytes]) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: IO[bytes], kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, count = _read(f, "<I"), _read(f, "<Q")
        if item_kind in _SCALARS and not keep:
            f.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
            return None
        items = [_value(f, item_kind, keep) for _ in range(count)]
        return items if keep else None
    raise ValueError(f"unknown GGUF value type {kind}")


def read_metadata(path: str, wanted: set[str] | None = None) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays skipped); stops once ``wanted`` are found."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _read(f, "<Q")  # tensor count
        for _ in range(_read(f, "<Q")):
            key = _string(f)
            value = _value(f, _read(f, "<I"), keep=False)
            if value is not None:
                out[key] = value
            if wanted is not None and wanted <= out.keys():
                break
    return out


def context_length(path: str) -> int | None:
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.context_length")
    return int(value) if value is not None else None
