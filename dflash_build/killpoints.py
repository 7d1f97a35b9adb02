"""Test hook: SIGKILL this process at a named point of a stage, as a crash or an OOM kill would.

Set ``DFLASH_BUILD_KILL_AT`` to ``rows:N`` (a generate job, after N rows are journaled and synced;
``rows:0`` once the engine is loaded), ``publish`` (after the last row, before the shard is written) or
``mix`` (the mix, after its files are written, before its folder is swapped in). ``sigterm:N`` sends
SIGTERM instead, after N rows are journaled, as Snakemake's shutdown would. ``group-sigterm:N`` and
``group-sigkill:N`` send that signal to the job's whole process group, which its Snakemake leads: what
Ctrl-C in a terminal or a SLURM preemption (SIGTERM) and a lost node (SIGKILL) do to every process.
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
from pathlib import Path

KILL_AT_ENV = "DFLASH_BUILD_KILL_AT"
_GROUP_SIGNALS = {"group-sigterm": signal.SIGTERM, "group-sigkill": signal.SIGKILL}


def kill_point() -> tuple[str, int]:
    """(kind, N) of the point asked for; ("", 0) when none is."""
    return parse(os.environ.get(KILL_AT_ENV, ""))


def parse(point: str) -> tuple[str, int]:
    """``KIND:N`` or ``KIND`` as (kind, N), N 0 when absent."""
    kind, _, n = point.partition(":")
    return kind, int(n or 0)


def die_at(kind: str) -> None:
    if kill_point()[0] == kind:
        die()


def die() -> None:
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def after_rows(journaled: int, sync: Callable[[], None]) -> None:
    """The generate job's point after each journaled row (``rows:N``, ``sigterm:N`` and the group signals)."""
    kind, n = kill_point()
    if kind == "rows" and journaled >= n:
        sync()
        die()
    if kind == "sigterm" and journaled == n:
        os.kill(os.getpid(), signal.SIGTERM)
    if kind in _GROUP_SIGNALS and journaled == n:
        signal_group(_GROUP_SIGNALS[kind])


def signal_group(signum: int) -> None:
    """``signum`` to every process of this job's group, once its leader is sure to be Snakemake: a build
    started without a session of its own shares its group with whatever started it (a test runner)."""
    leader = os.getpgrp()
    try:
        command = Path(f"/proc/{leader}/cmdline").read_bytes()
    except OSError:
        command = b""
    if b"snakemake" not in command:
        raise RuntimeError(
            f"{KILL_AT_ENV}: the process group's leader ({leader}) is not Snakemake; start the build in its own session"
        )
    if signum == signal.SIGKILL:
        logging.shutdown()
    os.killpg(leader, signum)


def hang_at_step(steps: int) -> None:
    """The in-process engine's point after each decoding step (``hang:N``): never returns at step N."""
    kind, n = kill_point()
    if kind == "hang" and steps >= n:
        logging.getLogger(__name__).warning("%s: hanging at decoding step %d", KILL_AT_ENV, steps)
        while True:
            time.sleep(3600)
