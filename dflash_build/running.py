"""The jobs running now, each recorded by itself: what `status` reads instead of sampling a lock.

A job writes ``LOGS/running/ID.json`` (its stage, source and shard, pid, host, since when, its log) when it
starts, updates its ``progress`` as it goes (accept: which drafter, how far), and removes it when it ends.
A job killed outright leaves its record: a reader takes a record whose pid is gone on this host as no job
(the one liveness rule), and the next run of the same job replaces it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.engines.host.slots import alive
from dflash_build.store import atomic, layout

_CURRENT: dict[str, Any] = {}  # this process's record, while its job runs


@contextlib.contextmanager
def recorded(logs: Path, log: str | None, **what: Any) -> Iterator[None]:
    """Record the job (``what``: its stage, source, shard) for its duration."""
    if log is None:
        yield
        return
    path = layout.running_dir(logs) / f"{hashing.content_key({'log': str(log)})}.json"
    record = {**what, "pid": os.getpid(), "host": platform.node(), "since": round(time.time(), 3), "log": str(log)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, record)
    except OSError:  # a record is for `status` only: a job never fails for want of one
        yield
        return
    _CURRENT.update(path=path, record=record)
    try:
        yield
    finally:
        _CURRENT.clear()
        path.unlink(missing_ok=True)


def progress(**fields: Any) -> None:
    """Say how far the running job is (no-op outside a recorded job)."""
    if not _CURRENT:
        return
    earlier = dict(_CURRENT["record"].get("progress", {}))
    if "step" in fields and fields["step"] != earlier.get("step"):
        earlier.pop("done", None)  # how far the last step went says nothing of the next
    _CURRENT["record"] = {**_CURRENT["record"], "progress": {**earlier, **fields}}
    with contextlib.suppress(OSError):
        atomic.write_json(_CURRENT["path"], _CURRENT["record"])


def live(record: dict[str, Any]) -> bool:
    """Whether the process a record names (``pid`` on ``host``) still runs: one on another host is taken
    as running, since its process table cannot be seen from here."""
    return record.get("host") != platform.node() or alive(int(record.get("pid", 0)))


def jobs(logs: Path) -> list[dict[str, Any]]:
    """The running jobs' records (read only): a record whose process is gone on this host is none."""
    out = []
    for path in sorted(layout.running_dir(logs).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if live(record):
            out.append(record)
    return sorted(out, key=lambda r: r.get("since", 0))
