"""The engine a job talks to when it is served: :class:`ServedEngine`, the Engine interface over the servers
the job is attached to, and the owner of their pool (a stalled server is stopped and replaced once)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from dflash_build.engines import registry
from dflash_build.engines.base import EngineDied
from dflash_build.engines.gpus import GpuLease
from dflash_build.engines.host.attach import Attached, attach, join_others
from dflash_build.engines.host.launch import LaunchSpec, launch_spec
from dflash_build.engines.host.logs import engine_error, exit_code
from dflash_build.engines.host.slots import read_state, stop_host, stop_idle
from dflash_build.engines.openai_backend import OpenAIEngine, PoolChange, ServerDown
from dflash_build.spec import Config, EngineSpec

log = logging.getLogger(__name__)
SHARED_REQUEST_TIMEOUT = 6 * 3600.0  # a request may wait behind other jobs' requests in the engine's queue


def concurrency(engine: EngineSpec) -> int:
    """Requests one job keeps in flight per engine: enough to fill its batch on its own."""
    serve = registry.get(engine.backend).serve
    assert serve is not None, f"{engine.backend} engines are not served"
    return serve.concurrency(engine.options)


STALLED_STOP_SECONDS = 20.0  # a stalled server is SIGKILLed by its host at once; then the host itself
EXIT_WAIT_SECONDS = 10.0  # the host notices its server's exit within its poll
DYING_EXIT_WAIT_SECONDS = 60.0  # once its log shows the error: vLLM's shutdown is slower on a loaded machine


class ServedEngine:
    """The Engine interface over the servers a job is attached to (the openai backend does the HTTP).

    It owns the backend's pool (``PoolHooks``): a server that stalls is stopped (its host SIGKILLs it,
    so the GPU is free) unless another job already replaced it, and the job's own slot gets one
    replacement; a server that died is left; engines of the identity that start later are joined.
    """

    def __init__(self, spec: LaunchSpec, attached: Attached, stop_on_close: bool, pool: bool) -> None:
        self.spec, self.attached, self.stop_on_close, self.pool = spec, attached, stop_on_close, pool
        self.client: Any = None
        self.replaced = self.closed = False
        self.died: EngineDied | None = None  # a server that exited on its own error: not replaced
        # where each server's log stood when the job attached: an error before it was another job's
        self._log_sizes = {e["url"]: _size(e.get("log")) for e in attached.engines}
        self._left: dict[str, dict[str, Any]] = {}  # members a refresh saw go, until the backend says so
        self._lock = threading.Lock()  # the pool's changes come from threads of their own
        self.identity: dict[str, Any] = {
            "identity_key": spec.identity_key,
            "started_here": attached.started,
            "engines": [described(e) for e in attached.engines],
        }

    @property
    def name(self) -> str:
        """How warnings name it: every engine the job feeds now, with its host's pid."""
        served = ", ".join(f"{e['slot']} (pid {e['pid']}, {e['url']})" for e in self.attached.engines)
        return f"the shared engine {served or '(none left in the pool; a replacement may be starting)'}"

    def generate(self, requests: Any) -> Any:
        try:
            yield from self.client.generate(requests)
        except ServerDown as e:
            if self.died is not None:
                raise self.died from None
            slots = sorted({engine["slot"] for engine in self.identity["engines"]})
            logs = ", ".join(str(Path(self.spec.log_dir) / f"{slot}.log") for slot in slots)
            gpus = " and the GPUs (nvidia-smi)" if any(e.get("gpu") for e in self.attached.engines) else ""
            e.add_note(
                f"No engine of the pool is left (each job replaces its own GPU's engine once). Finished rows are "
                f"journaled. See the engines' logs ({logs}){gpus}, then run the build again: it generates only "
                "the rest."
            )
            raise

    def lost(self, url: str, why: str, stalled: bool) -> PoolChange:
        """A server left the backend's pool: stop it if it stalled (or, when this job replaces it, stopped
        answering), and replace our own slot's once."""
        with self._lock:
            state = self.attached.leave(url)
            left = self._left.pop(url, None)
        if (seen := state or left) is None:
            return PoolChange()
        self.identity.setdefault("lost", []).append({**described(seen), "stalled": stalled, "why": why[:300]})
        if not stalled and self._note_died(seen):
            return PoolChange()
        if state is None:  # a refresh saw its host go first: a replacement another job starts joins by refresh
            return PoolChange()
        # nobody replaced it yet: a stalled server is stopped, and so is one that does not answer when we are
        # about to replace it (a stall, as far as this job can tell; else the replacement would find its
        # host still up, while another job stops it, and join it again)
        if (stalled or self._replaces(state)) and read_state(self.spec.lock_dir, state["slot"]) == state:
            log.warning(
                "stopping the stalled engine on %s (host pid %d, server pid %s, log %s)",
                state["slot"],
                state["pid"],
                state.get("server_pid"),
                state.get("log"),
            )
            stop_host(state, "stalled", wait=STALLED_STOP_SECONDS)
        if not self._replaces(state):  # asked again: the job may have closed while the engine stopped
            return PoolChange()
        self.replaced = True
        log.warning("starting a replacement engine on %s", self.spec.slot)
        attached = attach(self.spec, pool=False)  # or join the one another job started meanwhile
        with self._lock:
            if self.closed:
                attached.release()
                return PoolChange()
            for joined_url, (joined, fd) in attached.members.items():
                if joined_url in self.attached.members:  # a refresh joined it meanwhile: hold it once
                    os.close(fd)
                    continue
                self.attached.members[joined_url] = (joined, fd)
                self.identity["engines"].append(described(joined))
        return PoolChange(joined=attached.urls)

    def _note_died(self, state: dict[str, Any]) -> bool:
        """Whether the server exited on its engine's own error; if so it is logged, and the job raises it."""
        if (error := self._died_of(state)) is None:
            return False
        log.error("%s", error)
        self.died = self.died or error
        return True

    def _died_of(self, state: dict[str, Any]) -> EngineDied | None:
        """The engine's own error, when its server exited on one while this job used it (a killed server
        leaves none, and is replaced): replacing it would only fail the same requests again."""
        if not state.get("log"):
            return None
        since = self._log_sizes.get(state["url"], 0)
        deadline, dying = time.monotonic() + EXIT_WAIT_SECONDS, time.monotonic() + DYING_EXIT_WAIT_SECONDS
        while (code := exit_code(state["log"], since)) is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the server logs its error, then exits; its host says so within a poll
            if time.monotonic() >= deadline and deadline < dying and engine_error(state["log"], since):
                deadline = dying  # it logged an error: a loaded machine may take longer to shut it down
        if code is None or code < 0:  # still up, or killed by a signal (kill -9): replaced as before
            return None
        error = engine_error(state["log"], since)
        if error is None:
            return None
        where = "on " + (f"GPU {state['gpu']}" if state.get("gpu") else "cpu")
        return EngineDied(
            f"the {self.spec.backend} engine {where} died: {error}; log: {state['log']}. Finished rows are "
            "journaled; no replacement was started, since the same requests would fail it again: fix the cause, "
            "then run again"
        )

    def _replaces(self, lost: dict[str, Any]) -> bool:
        """Whether this job replaces the lost engine: its own slot's, once, while the job is open."""
        return lost["slot"] == self.spec.slot and not (self.replaced or self.closed)

    def refresh(self) -> PoolChange:
        """Members whose engine stopped or was replaced leave; with ``pool``, newly started ones join."""
        with self._lock:
            if self.closed:
                return PoolChange()
            gone = [
                url
                for url, (state, _) in self.attached.members.items()
                if read_state(self.spec.lock_dir, state["slot"]) != state
            ]
            for url in gone:
                if (state := self.attached.leave(url)) is not None:
                    self._left[url] = state  # so the backend's word that it left can still tell why
            joined = join_others(self.spec, self.attached) if self.pool else []
            self.identity["engines"] += [described(self.attached.members[url][0]) for url in joined]
        return PoolChange(joined=joined, gone=gone)

    def interrupt(self) -> None:
        self.client.interrupt()

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            with self._lock:
                self.closed = True
                self.attached.release()
            if self.stop_on_close:
                stop_idle(self.spec.lock_dir, [self.spec.slot])


def _size(path: str | None) -> int:
    try:
        return 0 if path is None else os.path.getsize(path)
    except OSError:
        return 0


def described(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in ("slot", "url", "pid", "spawned_at", "ready_at")}


def open_engine(
    cfg: Config,
    stop_ids: list[int],
    lease: GpuLease | None,
    tokenizer: Any,
    model_fingerprint: Any,
    context: int | None,
    engine: EngineSpec | None = None,
) -> ServedEngine:
    """Attach to (starting if needed) the engine servers for this config and return a client of them;
    ``engine``: another engine for the config's target (one serving a drafter: registry.with_drafter)."""
    engine = engine or registry.for_generation(cfg.engine)
    spec = launch_spec(cfg, stop_ids, lease, model_fingerprint, context, engine)
    attached = attach(spec, pool=engine.shared)
    served = ServedEngine(spec, attached, stop_on_close=not engine.shared, pool=engine.shared)
    try:
        serve = registry.get(spec.backend).serve
        assert serve is not None  # launch_spec checked it
        options = {
            "urls": attached.urls,
            "api": serve.api,
            "concurrency": concurrency(engine),
            "timeout": SHARED_REQUEST_TIMEOUT,  # a last resort: stalls are caught by engine.stall_timeout
            "retries": int(registry.get(engine.backend).value(engine.options, "retries")),
        }
        served.client = OpenAIEngine(
            options, stop_ids, tokenizer, cfg.model.path, engine.stall_timeout, spec.health_path, pool=served,
            loops_in_request=serve.loops_in_request,
        )  # fmt: skip
    except BaseException:
        served.close()
        raise
    return served
