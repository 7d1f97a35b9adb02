from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_build import hashing
from dflash_build.store import fingerprints


def test_canonical_json_writes_each_value_one_way() -> None:
    assert hashing.canonical_json({"b": 1.0, "a": [0.5, 2]}) == '{"a":[0.5,2],"b":1}'
    assert hashing.content_key({"t": 1}) == hashing.content_key({"t": 1.0})
    assert hashing.content_key({"a": 1, "b": 2}) == hashing.content_key({"b": 2, "a": 1})
    assert len(hashing.content_key({"x": None})) == hashing.KEY_LENGTH


@pytest.mark.parametrize("value", [float("nan"), float("inf"), object()])
def test_values_without_one_canonical_form_are_refused(value: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        hashing.content_key({"x": value})


def test_fingerprint_cache_rereads_only_changed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "weights.bin"
    data.write_bytes(b"abc" * 1000)
    reads: list[str] = []
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda p: reads.append(str(p)) or real(p))
    cache_file = tmp_path / "cache.json"
    first = fingerprints.FingerprintCache(cache_file)
    digest = first.file(data)
    first.save()
    assert fingerprints.FingerprintCache(cache_file).file(data) == digest
    assert len(reads) == 1, "a second run takes the digest from the cache"
    os.utime(data, ns=(1, 1))
    assert fingerprints.FingerprintCache(cache_file).file(data) == digest
    assert len(reads) == 2, "a touched file is hashed again, to the same digest"
    data.write_bytes(b"abd" * 1000)
    assert fingerprints.FingerprintCache(cache_file).file(data) != digest


def test_a_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    cache_file = tmp_path / "cache.json"
    cache_file.write_text("{not json")
    data = tmp_path / "f"
    data.write_bytes(b"x")
    assert fingerprints.FingerprintCache(cache_file).file(data) == hashing.sha256_file(data)
