"""The trainer backends by name (config `train.trainer`): each module of this package that defines
``TRAINER`` (:class:`~dflash_build.trainers.base.Trainer`)."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from dflash_build.spec import ConfigError
from dflash_build.trainers import base


@functools.cache
def trainers() -> dict[str, base.Trainer]:
    package = importlib.import_module("dflash_build.trainers")
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name in ("base", "registry") or info.name.endswith("_run"):  # the runners run elsewhere
            continue
        trainer = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "TRAINER", None)
        if trainer is not None:
            found[trainer.name] = trainer
    return found


def get(name: str, key: str = "train.trainer") -> base.Trainer:
    known = trainers()
    if name not in known:
        raise ConfigError(key, f"no trainer {name!r}{base.closest(name, tuple(known))}")
    return known[name]
