"""The configs registered on a store: what each references, so gc from any of them keeps it."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.plan import Plan
from dflash_build.store import atomic, layout


def referenced(plan: Plan) -> set[Path]:
    refs = set()
    for name in plan.sources:
        refs |= {plan.prompt_dir(name), plan.completion_dir(name), plan.token_dir(name)}
        refs.add(layout.journal_dir(plan.config.store, plan.sources[name].gen_key))
    return refs


def registration_id(plan: Plan) -> str:
    """One registration per dataset folder: a config that builds that folder replaces the one before."""
    return hashing.digest({"dataset": os.path.abspath(plan.config.dataset_dir)})[:16]


def register(plan: Plan) -> Path:
    """Record in the store what this config references, so `gc` from any other config keeps it.

    Called at the start of every build (the Snakefile's onstart); never by a command, since an edited
    config that is not built yet uses nothing.
    """
    store = plan.config.store
    entry = {
        "dataset": os.path.abspath(plan.config.dataset_dir),
        "workdir": os.getcwd(),
        "host": platform.node(),
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "references": sorted(os.path.relpath(p, store) for p in referenced(plan)),
    }
    path = layout.registration(store, registration_id(plan))
    atomic.write_json(path, entry)
    return path


def registrations(store: Path) -> dict[str, dict[str, Any]]:
    """Every config registered on the store, by id; an unreadable registration is reported, not skipped."""
    out = {}
    for path in sorted(layout.registration(store).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            entry["references"] = list(entry["references"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"registration {path} is unreadable ({e}): fix it, or delete it with "
                f"`dflash-build configs --forget {path.stem}` if that config is retired"
            ) from e
        out[path.stem] = entry
    return out


def forget(store: Path, ident: str) -> Path:
    path = layout.registration(store, ident)
    if not path.exists():
        raise KeyError(f"no config {ident} is registered on {store} (see `dflash-build configs`)")
    path.unlink()
    return path
