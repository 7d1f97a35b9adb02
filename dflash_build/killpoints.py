"""Test hook: SIGKILL this process at a named point of a stage, as a crash or an OOM kill would.

Set ``DFLASH_BUILD_KILL_AT`` to ``rows:N`` (a generate job, after N rows are journaled and synced;
``rows:0`` once the engine is loaded), ``publish`` (after the last row, before the shard is written) or
``mix`` (the mix, after its files are written, before its folder is swapped in). ``sigterm:N`` sends
SIGTERM instead, after N rows are journaled, as Snakemake's shutdown or a SLURM preemption would.
``hang:N`` makes the in-process transformers engine hang for good at its Nth decoding step, as a
wedged GPU does.
Unset, nothing happens.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

KILL_AT_ENV = "DFLASH_BUILD_KILL_AT"


def kill_point() -> tuple[str, int]:
    """(kind, N) of the point asked for; ("", 0) when none is."""
    kind, _, n = os.environ.get(KILL_AT_ENV, "").partition(":")
    return kind, int(n or 0)


def die_at(kind: str) -> None:
    if kill_point()[0] == kind:
        die()


def die() -> None:
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def after_rows(journaled: int, sync: Callable[[], None]) -> None:
    """The generate job's point after each journaled row (``rows:N`` and ``sigterm:N``)."""
    kind, n = kill_point()
    if kind == "rows" and journaled >= n:
        sync()
        die()
    if kind == "sigterm" and journaled == n:
        os.kill(os.getpid(), signal.SIGTERM)


def hang_at_step(steps: int) -> None:
    """The in-process engine's point after each decoding step (``hang:N``): never returns at step N."""
    kind, n = kill_point()
    if kind == "hang" and steps >= n:
        logging.getLogger(__name__).warning("%s: hanging at decoding step %d", KILL_AT_ENV, steps)
        while True:
            time.sleep(3600)
