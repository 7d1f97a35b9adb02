"""The test tiers' sitecustomize (tests/site): transformers' import structure read from its cache is the
one transformers builds, and a process started by a test finds the cache."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SITE


def _site(cache: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("tests_site_sitecustomize", SITE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    monkeypatch.setattr(site, "CACHE", cache)
    return site


def test_the_cached_import_structure_is_the_one_transformers_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.utils import import_utils

    site = _site(tmp_path, monkeypatch)
    own = import_utils.define_import_structure.__wrapped__  # transformers' own, without its lru_cache
    models = Path(import_utils.__file__).parent.parent / "models"
    origin = Path(import_utils.__file__)
    first = site.cached(own, origin)(str(models), "models")  # built, then written
    [kept] = list(tmp_path.glob("*.pickle"))
    calls: list[str] = []
    second = site.cached(lambda *a: calls.append("built") or own(*a), origin)(str(models), "models")
    assert calls == [], "read from the file, not built again"
    assert first == second == own(str(models), "models")
    assert site.cache_file(origin, str(models), "models") == kept
    assert site.cache_file(origin, str(models), None) != kept, "another call's structure is kept apart"


def test_a_process_the_tiers_start_imports_transformers_through_the_cache(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    assert str(SITE) in env["PYTHONPATH"].split(os.pathsep), "conftest puts tests/site on PYTHONPATH"
    code = "import transformers, sys; print(type(sys.modules['transformers']).__name__)"
    for _ in range(2):  # the first writes the file, the second reads it
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "_LazyModule"
    assert len(list((tmp_path / "dflash-build-tests" / "transformers").glob("*.pickle"))) == 1
