"""Loaded by every Python process the test tiers start (tests/conftest.py puts this folder on PYTHONPATH):
Snakemake, its jobs, the CLI, the engines. It keeps transformers' import structure, which transformers 5
builds on every import by reading each of its ~1,700 model files (0.3 of the 1.1 CPU-seconds a test job
spends before its work), in a file keyed by the release's files, so a job reads it instead. The structure
is the same either way (tests/test_site.py); what the package ships is not changed: this folder is the
test tiers' only."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

MODULE = "transformers.utils.import_utils"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-build-tests" / "transformers"


def cache_file(import_utils: Path, module_path: str, prefix: str | None) -> Path:
    """Where the structure of ``module_path`` is kept: keyed by the release (its import_utils file) and the
    folder's own listing (a file added or removed changes its mtime)."""
    stamp = [str(import_utils), str(import_utils.stat().st_mtime_ns), str(module_path), str(prefix)]
    with contextlib.suppress(OSError):
        stamp.append(str(Path(module_path).stat().st_mtime_ns))
    return CACHE / (hashlib.sha256("\0".join(stamp).encode()).hexdigest()[:24] + ".pickle")


def cached(define: Any, import_utils: Path) -> Any:
    @functools.lru_cache
    def define_import_structure(module_path: str, prefix: str | None = None) -> Any:
        path = cache_file(import_utils, str(module_path), prefix)
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
            return pickle.loads(path.read_bytes())
        structure = define(module_path, prefix)
        with contextlib.suppress(OSError):  # a read-only home: computed each time, as without this file
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(structure, f)
            os.replace(tmp, path)
        return structure

    return define_import_structure


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, origin: str) -> None:
        self.inner, self.origin = inner, origin

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        if callable(getattr(module, "define_import_structure", None)):
            module.define_import_structure = cached(module.define_import_structure, Path(self.origin))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and spec.origin:
            spec.loader = _Loader(spec.loader, spec.origin)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
