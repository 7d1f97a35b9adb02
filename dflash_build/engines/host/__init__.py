"""Engines that outlive a job: one long-lived server per GPU, shared by the generate jobs (``engine.shared``).

Starting a large model's engine takes minutes, and a job that owns its engine also idles the GPU while
its shard's last long answers drain at a shrinking batch. With shared engines:

- **Start.** The first job that needs GPU g's engine starts it: a *host* process (``python -m
  dflash_build.engines.host serve``, in its own session, so Snakemake's end does not take it down) takes
  GPU g's lock (the same lock an in-process engine takes: never two engines on one GPU) and runs the
  server on g's port with ``CUDA_VISIBLE_DEVICES=g``: SGLang's HTTP server (``sglang_backend.serve``),
  llama.cpp's, or our own around the transformers backend (``engines.server``). Its output goes to
  ``logs/engines/<slot>.log``; once the server answers, the host writes ``<lock_dir>/engine-<slot>.json``.
- **Identity.** An engine serves only jobs that want exactly what it was started with (``identity``: the
  backend, the model and its fingerprint, every launch option, the stop ids). A job that wants another
  waits until the engine's users are done, stops it and starts its own.
- **Use.** A job holds a shared lock on ``engine-<slot>.use.lock`` while it sends requests, and sends
  them to its own GPU's engine and to every other running engine of the same identity, least loaded
  first. Two jobs per GPU (``engine.jobs_per_engine``) keep each engine's batch full while one of them
  waits for its last answers, and the last shards of the build spread over every GPU.
- **Stop.** A host stops its server when nobody has used it for ``engine.idle_timeout`` seconds, when the
  workflow ends (``stop_idle``, from the Snakefile's onsuccess/onerror), or on ``dflash-build engines
  --stop``; the server dies with its host even on SIGKILL (PDEATHSIG). So after a crash or a kill -9 of
  everything, no server holds a GPU longer than the idle timeout. The processes a server starts (vLLM's
  engine core) go with the server, or, when its host was killed -9, before the slot's next server starts
  and at the next workflow's end or ``engines --stop`` (``slots.leftovers``): never beside a new engine.
  Each engine's life is appended to
  ``logs/engines/engines.jsonl`` (start, ready, stop, reason, time in use).
- **Under a scheduler** (SLURM): an engine serves the jobs of its own allocation only (its slot and
  identity name the scheduler's job id), so the generate jobs that Snakemake groups into one allocation
  share it, and it stops when the allocation's task ends, whatever the cluster does with leftover
  processes. GPU locks and ports follow the node's GPU index, so two allocations on a node never collide.

``dflash-build engines`` lists the running ones. With ``engine.shared: false`` a server backend
(``llamacpp``) still runs through a host, started and stopped by its job.

The package, one job per module: ``slots`` (a slot's state file and locks), ``launch`` (what a host
runs: the launch spec and identity), ``attach`` (the job's side: start, reuse, replace), ``served`` (the
Engine a job talks to, owner of its pool of servers), ``broker`` (SLURM: hosts started in the
allocation's batch step), ``process`` (the host process itself).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dflash_build.engines import registry
from dflash_build.engines.base import EngineFailed as EngineFailed
from dflash_build.engines.host.attach import Attached as Attached
from dflash_build.engines.host.attach import attach as attach
from dflash_build.engines.host.broker import BROKER_ENV as BROKER_ENV
from dflash_build.engines.host.broker import start_allocation_broker as start_allocation_broker
from dflash_build.engines.host.launch import OWNER_ENV as OWNER_ENV
from dflash_build.engines.host.launch import LaunchSpec as LaunchSpec
from dflash_build.engines.host.launch import launch_spec as launch_spec
from dflash_build.engines.host.served import ServedEngine as ServedEngine
from dflash_build.engines.host.served import open_engine as open_engine
from dflash_build.engines.host.slots import alive as alive
from dflash_build.engines.host.slots import host_slots as host_slots
from dflash_build.engines.host.slots import leftovers as leftovers
from dflash_build.engines.host.slots import processes as processes
from dflash_build.engines.host.slots import read_state as read_state
from dflash_build.engines.host.slots import running, starting, stop_idle
from dflash_build.engines.host.slots import state_path as state_path
from dflash_build.spec import Config, EngineSpec

__all__ = ["running", "starting", "stop_idle"]


def describe(states: list[dict[str, Any]]) -> str:
    """A line per running engine (``dflash-build engines``)."""
    if not states:
        return "no engine running"
    lines = []
    now = time.time()
    for s in states:
        lines.append(
            f"{s['slot']:<8} {s['backend']:<12} {s['url']:<24} identity {s['identity_key']} "
            f"up {now - s['ready_at']:.0f}s, host pid {s['pid']}, log {s['log']}"
        )
    return "\n".join(lines)


def through_server(engine: EngineSpec) -> bool:
    """Whether jobs talk to a host's server instead of an engine of their own."""
    return engine.shared or registry.get(engine.backend).always_through_server


def stop_workflow_engines(cfg: Config) -> list[str]:
    """At the end of a workflow: stop the unused engines this config's builds started (their logs are
    under its logs folder); prints what it stopped."""
    if not through_server(cfg.engine):
        return []
    mine = (cfg.logs / "engines").resolve()
    slots = [s["slot"] for s in running(cfg.engine.lock_dir) if Path(s["log"]).parent == mine]
    stopped = stop_idle(cfg.engine.lock_dir, slots) if slots else []
    if stopped:
        history = cfg.logs / "engines" / "engines.jsonl"  # as the config names it
        print(f"dflash-build: stopped the shared engines on {', '.join(stopped)} (history: {history})")
    return stopped
