"""Extension points found by module: each module of a package that names its descriptor adds it.

A backend, an input format and an export format are each one module of their own package holding one
descriptor (``BACKEND``, ``FORMAT``, or ``FORMATS`` for several); the package's registry is what this
finds there, so adding one touches no list elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def descriptors(package: str, attr: str) -> dict[str, Any]:
    """``{descriptor.name: descriptor}`` of every module of ``package`` that defines ``attr`` (one
    descriptor or a tuple of them), in module-name order; a name given twice is a programming error."""
    found: dict[str, Any] = {}
    root = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package}.{info.name}")
        named = vars(module).get(attr)  # defined there, not a registry's own lazy view of what it finds
        for descriptor in named if isinstance(named, tuple) else ([] if named is None else [named]):
            if descriptor.name in found:
                raise RuntimeError(f"{package}.{info.name}: a second descriptor named {descriptor.name!r}")
            found[descriptor.name] = descriptor
    return found


class Registry(Generic[T]):
    """One extension point's descriptors, found on first use, not at import (a descriptor module imports
    its registry's module, and may be imported first): ``found`` by name, ``get`` one, and ``view`` the
    module-level ``__getattr__`` that answers the registry's constant (``BACKENDS``, ``FORMATS``)."""

    def __init__(self, package: str, *attrs: str) -> None:
        self.package, self.attrs = package, attrs

    @functools.cached_property
    def found(self) -> dict[str, T]:
        out: dict[str, T] = {}
        for attr in self.attrs:
            out |= descriptors(self.package, attr)
        return out

    def get(self, name: str) -> T:
        return self.found[name]

    def view(self, constant: str) -> Callable[[str], Any]:
        def module_getattr(name: str) -> Any:
            if name == constant:
                return self.found
            raise AttributeError(name)

        return module_getattr
