"""What keeps a generate job in hand: signals (a clean stop keeps every journaled row), progress lines
and the stop of an engine that stalls."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_build import engines
from dflash_build.engines import Result
from dflash_build.store import records as R
from dflash_build.store.journal import Journal

log = logging.getLogger(__name__)


class Interrupted(RuntimeError):
    """A signal stopped the job: what finished is journaled, the rest is generated on the next run."""


class SignalStop:
    """The driver owns SIGTERM and SIGINT while it generates (Snakemake's shutdown, SLURM preemption).

    On the first signal it stops sending requests and lets the engine abort what is in flight; the
    driver then syncs the journal and fails the job, so only the in-flight rows are lost. A second
    signal stops at once (the journal is synced on every flush and tolerates a torn last line).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.engine: engines.Engine | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._saved = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise Interrupted(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum
        log.warning("%s: finishing what is journaled, then stopping", signal.Signals(signum).name)
        if self.engine is not None:
            self.engine.interrupt()

    def check(self, label: str, journaled: int, journal: Journal) -> None:
        """Fail the job if a signal came, once the journal holds what finished."""
        if self.signum is None:
            return
        journal.sync()
        raise Interrupted(
            f"{label}: stopped by {signal.Signals(self.signum).name}; the {journaled} rows finished in this run "
            f"are kept in {journal.path}, the rest is generated when the job runs again"
        )


PROGRESS_EVERY_SECONDS = 30.0


class Progress:
    """Rows done/total, output tok/s, ETA and truncation rate: a bar on a terminal, else log lines.

    While the engine works, a heartbeat (:meth:`watch`) writes the line every ``PROGRESS_EVERY_SECONDS``
    whether or not a row finished, and warns, naming the engine, when no answer has come back for
    ``engine.stall_timeout`` seconds while requests are in flight: a stopped or wedged engine is seen
    in minutes, not at the per-request deadline.
    """

    def __init__(self, total: int, already: int, label: str, every: float = PROGRESS_EVERY_SECONDS) -> None:
        self.total, self.label, self.every = total, label, every
        self.done, self.truncated, self.output_tokens = already, 0, 0
        self.new = 0
        self.start = self.last = self.last_answer = time.monotonic()
        self.stalls = 0  # warnings given (each names the engine)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=already, desc=label, unit="row")

    def update(self, result: Result, row_finished: bool) -> None:
        with self._lock:
            self.last_answer = time.monotonic()
            self.output_tokens += len(result.output_ids)
            if not row_finished:
                return
            self.done += 1
            self.new += 1
            self.truncated += result.finish_reason == R.FINISH_LENGTH
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(self.rates())
            return
        if self.done == self.total:
            self._line()

    def watch(
        self,
        in_flight: Callable[[], int],
        engine: str | Callable[[], str],
        stall_timeout: float,
        then: str,
        steps: Callable[[], int] | None = None,
        on_stall: Callable[[str], None] | None = None,
    ) -> None:
        """Start the heartbeat: ``in_flight()`` says how many requests the engine holds now; ``steps()``
        (an in-process engine's decoding steps) counts as progress too; ``then`` says in the warning what
        happens next. With ``on_stall``, an engine that made no progress for ``stall_timeout`` while it
        holds requests is handed to it, once."""
        tick = max(0.2, min(self.every, stall_timeout) / 4)

        def beat() -> None:
            warned_for = None  # the progress time the last warning was about
            seen, stepped_at = (steps() if steps else 0), time.monotonic()
            while not self._stop.wait(tick):
                now = time.monotonic()
                if self.bar is None and now - self.last >= self.every:
                    self._line()
                if steps is not None and steps() != seen:
                    seen, stepped_at = steps(), now
                progressed = max(self.last_answer, stepped_at)
                waiting, silent = in_flight(), now - progressed
                if not (waiting and silent >= stall_timeout) or warned_for == progressed:
                    continue
                warned_for = progressed
                self.stalls += 1
                who = engine() if callable(engine) else engine  # a pool's members change
                message = (
                    f"{self.label}: no answer from {who} for {silent:.0f}s while {waiting} requests are in flight "
                    f"(engine.stall_timeout {stall_timeout:g}s); it may be stopped, deadlocked or its GPU wedged: "
                    f"{then}"
                )
                log.warning("%s", message)
                if on_stall is not None:
                    on_stall(message)
                    return

        self._heartbeat = threading.Thread(target=beat, name=f"heartbeat {self.label}", daemon=True)
        self._heartbeat.start()

    def _line(self) -> None:
        with self._lock:
            self.last = time.monotonic()
            line = f"{self.label}: {self.done}/{self.total} rows, {self.rates()}"
        log.info("%s", line)

    def rates(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.new / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (
            f"{self.output_tokens / elapsed:.1f} output tok/s, ETA {eta:.0f}s, "
            f"truncated {self.truncated / max(self.new, 1):.1%}"
        )

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.bar is not None:
            self.bar.close()


STALL_STOP_GRACE_SECONDS = 10.0  # an interrupted engine returns within this, or the job exits at once

STALLED_EXIT_CODE = 75  # EX_TEMPFAIL: a rerun finishes the shard


class StallStop:
    """An in-process engine that makes no progress cannot be replaced: stop the job, keeping the journal.

    The engine is interrupted; if it returns, the job fails with :class:`engines.EngineStalled`. A hung
    one (a wedged GPU, a kernel that never returns) never does, so after a grace the journal is synced
    and the process exits, as a kill would (the fault tests prove a rerun loses nothing then).
    """

    def __init__(self, engine: engines.Engine, journal: Journal, grace: float = STALL_STOP_GRACE_SECONDS) -> None:
        self.engine, self.journal, self.grace = engine, journal, grace
        self.message: str | None = None
        self.returned = threading.Event()  # the job's thread is out of the engine

    def __call__(self, message: str) -> None:
        self.message = (
            f"{message}. It runs in this job, so it cannot be replaced: the rows finished so far are kept in "
            f"{self.journal.path}; check the GPU (nvidia-smi) and the job's log, then run the build again"
        )
        log.error("%s", self.message)
        self.engine.interrupt()
        if self.returned.wait(self.grace):
            return
        self.journal.sync()
        log.error("the engine did not return within %gs of its interrupt: exiting now", self.grace)
        logging.shutdown()
        os._exit(STALLED_EXIT_CODE)

    def check(self) -> None:
        self.returned.set()
        if self.message is not None:
            raise engines.EngineStalled(self.message)
