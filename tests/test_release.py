"""The dataset folder is replaced whole and atomically, and only by a build that finished."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dflash_build.publish import release
from dflash_build.store import atomic


def _publish(folder: Path, n: int) -> None:
    with release.publish(folder, release.record_dir(folder)) as tmp:
        (tmp / "plots").mkdir()
        atomic.write_text(tmp / "plots" / "mix.png", f"png {n}")
        atomic.write_json(tmp / "manifest.json", {"build": n, "rows": list(range(n))})


def test_a_build_becomes_the_folder_and_the_one_before_stays_until_gc(tmp_path: Path) -> None:
    folder = tmp_path / "dist" / "mix"
    _publish(folder, 1)
    first = release.current(folder)
    assert first is not None and json.loads((folder / "manifest.json").read_text())["build"] == 1
    record = release.record_dir(folder)
    assert (record / release.VERSION_FILE).read_text().strip() == first.name
    assert (record / "plots" / "mix.png").samefile(first / "plots" / "mix.png"), "the report links the version's"
    _publish(folder, 2)
    assert json.loads((folder / "manifest.json").read_text())["build"] == 2
    assert release.superseded(folder) == [first]
    _publish(folder, 2)
    assert release.superseded(folder) == [first], "the same dataset again is the same version"


def test_a_build_that_fails_changes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "mix"
    _publish(folder, 1)
    before = sorted(release.versions_dir(folder).rglob("*"))
    with pytest.raises(RuntimeError), release.publish(folder, release.record_dir(folder)) as tmp:
        atomic.write_json(tmp / "manifest.json", {"build": 2})
        raise RuntimeError("the mix missed its shares")
    assert json.loads((folder / "manifest.json").read_text())["build"] == 1
    assert sorted(release.versions_dir(folder).rglob("*")) == before, "no version, no temporary left"


def test_a_folder_of_the_layout_before_becomes_a_version(tmp_path: Path) -> None:
    folder = tmp_path / "mix"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"build": 0}')
    _publish(folder, 1)
    assert folder.is_symlink() and json.loads((folder / "manifest.json").read_text())["build"] == 1
    [old] = release.superseded(folder)
    assert json.loads((old / "data" / "manifest.json").read_text()) == {"build": 0}


def test_readers_see_one_whole_dataset_or_the_next_never_none(tmp_path: Path) -> None:
    folder = tmp_path / "mix"
    _publish(folder, 1)
    seen: list[int] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
                assert manifest["rows"] == list(range(manifest["build"]))
                seen.append(manifest["build"])
            except BaseException as e:
                failures.append(e)
                return

    reader = threading.Thread(target=read)
    reader.start()
    for n in range(2, 60):
        _publish(folder, n)
    done.set()
    reader.join()
    assert not failures, failures[0]
    assert seen == sorted(seen) and len(set(seen)) > 1
    assert release.recorded_but_missing(folder) is False
    folder.unlink()
    assert release.recorded_but_missing(folder), "a deleted folder with its record left is found"
