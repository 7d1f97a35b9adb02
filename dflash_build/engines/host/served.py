"""The engine a job talks to when it is served: :class:`ServedEngine`, the Engine interface over the servers
the job is attached to, and the owner of their pool (a stalled server is stopped and replaced once)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from dflash_build.engines import registry
from dflash_build.engines.gpus import GpuLease
from dflash_build.engines.host.attach import Attached, attach, join_others
from dflash_build.engines.host.launch import LaunchSpec, launch_spec
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
            slots = sorted({engine["slot"] for engine in self.identity["engines"]})
            logs = ", ".join(str(Path(self.spec.log_dir) / f"{slot}.log") for slot in slots)
            e.add_note(
                f"No engine of the pool is left (each job replaces its own GPU's engine once). Finished rows are "
                f"journaled. See the engines' logs ({logs}) and the GPUs (nvidia-smi), then run the build again: "
                "it generates only the rest."
            )
            raise

    def lost(self, url: str, why: str, stalled: bool) -> PoolChange:
        """A server left the backend's pool: stop it if it stalled (or, when this job replaces it, stopped
        answering), and replace our own slot's once."""
        with self._lock:
            state = self.attached.leave(url)
        if state is None:
            return PoolChange()
        self.identity.setdefault("lost", []).append({**described(state), "stalled": stalled, "why": why[:300]})
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
                self.attached.leave(url)
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


def described(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in ("slot", "url", "pid", "spawned_at", "ready_at")}


def open_engine(
    cfg: Config,
    stop_ids: list[int],
    lease: GpuLease | None,
    tokenizer: Any,
    model_fingerprint: Any,
    context: int | None,
) -> ServedEngine:
    """Attach to (starting if needed) the engine servers for this config and return a client of them."""
    spec = launch_spec(cfg, stop_ids, lease, model_fingerprint, context)
    attached = attach(spec, pool=cfg.engine.shared)
    served = ServedEngine(spec, attached, stop_on_close=not cfg.engine.shared, pool=cfg.engine.shared)
    try:
        options = {
            "urls": attached.urls,
            "api": registry.get(spec.backend).serve.api,  # type: ignore[union-attr]  # launch_spec checked it
            "concurrency": concurrency(cfg.engine),
            "timeout": SHARED_REQUEST_TIMEOUT,  # a last resort: stalls are caught by engine.stall_timeout
            "retries": int(registry.get(cfg.engine.backend).value(cfg.engine.options, "retries")),
        }
        served.client = OpenAIEngine(
            options, stop_ids, tokenizer, cfg.model.path, cfg.engine.stall_timeout, spec.health_path, pool=served
        )
    except BaseException:
        served.close()
        raise
    return served
