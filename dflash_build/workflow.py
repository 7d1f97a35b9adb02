"""The seam between the Snakemake rules and the stages: logging, and one entry point per rule.

Each rule's ``script:`` calls :func:`run_rule` with the ``snakemake`` object; the plan is rebuilt from
the job's config for the job's own source only (fingerprints come from the cache), and the stage runs
with its log file attached, as one :class:`~dflash_build.stages.common.job.Job` made of the paths Snakemake gave
the job (every stage's ``run(job)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import importlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dflash_build import config as config_mod
from dflash_build import engines, keys, running
from dflash_build import plan as plan_mod
from dflash_build.publish import release
from dflash_build.spec import Config, ConfigError, EngineSpec
from dflash_build.stages import registry as stages
from dflash_build.stages.common.job import Job, StageFailure
from dflash_build.store import filesystem, layout
from dflash_build.store.rowindex import RowIndex

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _LogFile(logging.FileHandler):
    """A job's log file that, on a full disk, says so once on stderr instead of a traceback per record."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        env = filesystem.fault(error, self.baseFilename) if error is not None else None
        if env is None:
            super().handleError(record)
        elif not self.failed:
            self.failed = True
            print(f"dflash-build: the job's log stops here: {env}", file=sys.stderr)


def history_log(log_path: str | Path) -> Path:
    """Every run's lines of a job's log (``NAME.log.history``), which Snakemake does not delete."""
    return Path(f"{log_path}.history")


@contextlib.contextmanager
def logged(log_path: str | Path | None, writing: str | Path | None = None) -> Iterator[None]:
    """Send the package's log records to ``log_path`` (and stderr) for the duration of a job.

    A job the environment stops (a full disk, a store it cannot write) ends with one line that names the
    path (``writing``: the job's output, where the error names none) and what to do, and exit status 1.
    """
    root = logging.getLogger("dflash_build")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(_LogFile(log_path, mode="w", encoding="utf-8"))
        # Snakemake deletes a job's log before it runs the job again (a restore after a crash): every run's
        # lines are kept beside it too, appended under a header that names the run
        handlers.append(_LogFile(history_log(log_path), mode="a", encoding="utf-8"))
    for h in handlers:
        h.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(h)
    previous = root.level
    root.setLevel(logging.INFO)
    root.info("---- a run of this job (pid %d) ----", os.getpid())
    try:
        yield
    except (StageFailure, engines.EngineDied) as e:  # its message is the whole story
        root.error("%s", e)
        raise SystemExit(1) from None
    except Exception as e:
        if (env := filesystem.fault(e, writing)) is None:
            root.exception("job failed")
            raise
        root.error("%s", env)
        raise SystemExit(1) from None
    finally:
        root.setLevel(previous)
        for h in handlers:
            root.removeHandler(h)
            h.close()


def warnings_to_stderr() -> None:
    """While Snakemake parses the workflow, the package's warnings (a cache rebuilt, ...) reach the user."""
    root = logging.getLogger("dflash_build")
    if not any(getattr(h, "dflash_parse_time", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("dflash-build: %(levelname)s: %(message)s"))
        handler.dflash_parse_time = True  # type: ignore[attr-defined]
        root.addHandler(handler)


def warn_if_recorded_but_missing(config: Config) -> None:
    """Say so when a dataset folder was deleted by hand: its build record keeps Snakemake from rebuilding it."""
    for folder in config.dist_folders:
        if release.recorded_but_missing(folder):
            logging.getLogger("dflash_build").warning(
                "%s is missing although its build is recorded in %s: `dflash-build verify --repair` (or "
                "`snakemake --forcerun mix`) builds it again",
                folder,
                release.record_dir(folder),
            )


def unprepared_line(plan: plan_mod.Plan) -> str | None:
    """After a failed build: the sources it left unprepared, which every generate job waited for (the
    ``prepared`` gate), with their logs and what to do; None when every source is prepared."""
    missing = [name for name in plan.sources if not plan.prompt_manifest(name).exists()]
    if not missing:
        return None
    logs = ", ".join(layout.prepare_log(plan.config.logs, name, plan.sources[name].prompt_key) for name in missing)
    return (
        f"dflash-build: no generate job started: every one waits for all sources to be prepared, and these are "
        f"not prepared: {', '.join(missing)} (its prepare's error above; log: {logs}). Fix what the error names "
        "and run again: what was prepared is kept"
    )


def check_store(config: Config) -> None:
    """Before any job: the store can be written, and its filesystem has ``checks.min_free_gb`` free.

    One line each (a :class:`filesystem.StoreFault`) that names the store and what to do; a GPU job
    that would meet either fault later has then not started.
    """
    store = Path(config.store)
    filesystem.check_writable(store)
    free, _ = filesystem.free_bytes(store)
    if (why := filesystem.below_floor(store, free, config.checks.min_free_gb)) is not None:
        raise filesystem.StoreFault(f"refusing to start: {why}", errno.ENOSPC)


def or_exit(step: Callable[..., object], *args: Any) -> None:
    """A step of the workflow's own process (parse time, ``onstart``) that writes to the store: a full disk
    or a store it cannot write ends the run with one line and exit 1, without Snakemake's frames."""
    try:
        step(*args)
    except Exception as e:
        if (env := filesystem.fault(e)) is None:
            raise
        sys.exit(f"dflash-build: {env}")


T = TypeVar("T")


def parsed(step: Callable[..., T], *args: Any) -> T:
    """A parse-time step that reads the config (validate, build, plan): a config error ends the run in the
    one line that names the key, as `dflash-build plan` prints it, without Snakemake's frames."""
    try:
        return step(*args)
    except ConfigError as e:
        sys.exit(f"dflash-build: {e}")


RUN_LOCK = ".snakemake/dflash-build.lock"  # held by the live run of a working directory, naming it
_RUN_LOCK: list[Any] = []  # this process's hold on it, for its whole life


def build_running(workdir: Path) -> dict[str, Any] | None:
    """The live run of this working directory's workflow (pid, host, since), or None: none is alive."""
    try:
        record = json.loads((workdir / RUN_LOCK).read_text())
    except (OSError, ValueError):
        return None
    return record if running.live(record) else None


def release_stale_locks(workdir: Path) -> list[Path]:
    """After a killed Snakemake, its locks (``.snakemake/locks``) outlive it and the next plain run stops on
    them. Each run of this workflow holds an flock on ``.snakemake/dflash-build.lock`` while it lives (the
    kernel drops it with the process, kill -9 too): a run that gets it is the only one alive, so the locks
    it finds are a dead run's and go, with a line that says so. A run that does not get it leaves them
    to Snakemake, which refuses to run beside a live one. Returns the locks removed."""
    folder = (workdir / RUN_LOCK).parent
    folder.mkdir(exist_ok=True)
    handle = open(workdir / RUN_LOCK, "a+")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return []
    _RUN_LOCK.append(handle)
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": platform.node(), "since": round(time.time(), 3)}))
    handle.flush()  # `status` reads who runs the build from it
    stale = sorted((folder / "locks").glob("*.lock"))
    for lock in stale:
        lock.unlink(missing_ok=True)
    if stale:
        logging.getLogger("dflash_build").warning(
            "removed the locks of a run that ended without releasing them (killed): %d in %s; the build goes on "
            "where it stopped (incomplete outputs are run again, finished shards restored from their journals)",
            len(stale),
            folder / "locks",
        )
    return stale


def sync_index(config: Config) -> None:
    """The row index learns the shards it lacks (once per build, not per job: see rowindex)."""
    with RowIndex.open(config.store):
        pass


def is_dry_run(argv: list[str]) -> bool:
    """Whether Snakemake was asked for a dry run (``-n``, ``--dry-run``, ``--dryrun``, or ``-n`` among
    other short flags such as ``-np``). A Snakefile cannot ask Snakemake itself: at parse time its
    executor is not chosen yet (``workflow.dryrun`` reads false)."""
    for arg in argv[1:]:
        if arg in ("--dry-run", "--dryrun"):
            return True
        if arg.startswith("-") and not arg.startswith("--") and arg[1:].isalpha() and "n" in arg[1:]:
            return True
    return False


def plan_from(config: dict[str, Any], source: str | None = None) -> plan_mod.Plan:
    """The plan of ``config``; of its one source ``source`` only, when given (a shard job's)."""
    return plan_mod.build(config_mod.from_dict(config), only=source)


class KeyMismatchError(RuntimeError):
    """The config, model or inputs changed since Snakemake planned this job: its output would go astray."""


def check_key(plan: plan_mod.Plan, stage: str, source: str, asked: str, planned: str | None = None) -> None:
    """Fail unless the job's own plan gives the key Snakemake asked for; say what differs if not.

    ``planned``: the canonical JSON of the components Snakemake planned with (prepare's params); else
    they are read from the store, where the Snakefile recorded them (:func:`plan.record_components`).
    """
    sp = plan.sources[source]
    key_name = _KEYED[stage].key  # prompt_key, and prompt_components beside it
    key, components = getattr(sp, key_name), getattr(sp, key_name.removesuffix("_key") + "_components")
    if key == asked:
        return
    before = json.loads(planned) if planned is not None else plan_mod.planned_components(plan.config.store, asked)
    changes = "\n".join(f"  {c}" for c in keys.diff(before or {}, components)) or "  (no differences recorded)"
    raise KeyMismatchError(
        f"{stage} {source}: Snakemake planned key {asked}, but the config and inputs now give {key}; "
        f"something changed since the workflow started:\n{changes}\nRun snakemake again to plan the new key."
    )


_KEYED = {stage.rule: stage for stage in layout.STAGES.values()}  # the stages whose folders carry a key


# -- one job of each stage, from the paths Snakemake gave it ------------------------------------------
def _paths(named: Any, names: tuple[str, ...]) -> dict[str, tuple[Path, ...]]:
    """Snakemake's named inputs or outputs (a name may hold one path or a list), as paths by name."""
    paths = {}
    for name in names:
        value = getattr(named, name, None)
        items = [] if value is None else [value] if isinstance(value, str | Path) else list(value)
        paths[name] = tuple(Path(p) for p in items)
    return paths


def job_of(smk: Any, stage: str) -> Job:
    """The job Snakemake asked for: its plan (of its one source, for a source's job), its declared inputs
    and outputs by name, and its key (a wildcard, or prepare's ``key`` param)."""
    wildcards = smk.wildcards
    source = getattr(smk.params, "source", None) or getattr(wildcards, "source", None)
    key = getattr(smk.params, "key", None) or getattr(wildcards, "key", None)
    return Job(
        stage,
        plan_from(smk.config, source),
        _paths(smk.input, stages.get(stage).inputs),
        _paths(smk.output, stages.get(stage).outputs),
        source=source,
        shard=getattr(wildcards, "shard", None),
        key=key,
        fmt=getattr(wildcards, "fmt", None),
    )


def _first_output(smk: Any) -> str | None:
    """The job's first output (what a full disk stopped it writing, where the error names no file)."""
    try:
        return str(smk.output[0])
    except (TypeError, IndexError, KeyError):  # a job without outputs, or a stand-in with names only
        return None


def run_rule(smk: Any, stage: str, **given: Any) -> None:
    """Run ``stage`` for a Snakemake job (the ``snakemake`` object a script receives).

    Before any work (no tokenizer, no GPU), the job checks that its own plan gives the key Snakemake
    asked for. Each job imports dflash_build.stages.<stage> only, so a CPU tokenize job never loads the
    GPU driver.
    """
    module = importlib.import_module(f"dflash_build.stages.{stage}")
    log = smk.log[0] if smk.log else None
    with logged(log, _first_output(smk)):
        job = job_of(smk, stage)
        what = {"stage": stage, "source": job.source, "shard": job.shard, "format": job.fmt}
        with running.recorded(job.plan.config.logs, log, **what):  # what `status` shows running
            if job.key is not None and job.source is not None:
                check_key(job.plan, stage, job.source, job.key, getattr(smk.params, "components", None))
            module.run(dataclasses.replace(job, given=given))  # given: what its rule's script passes (Job.given)


def run_job(smk: Any) -> None:
    """Run the stage its rule runs (rules/scripts/stage.py, through :func:`dflash_build.warm.run`)."""
    run_rule(smk, stages.of_rule(smk.rule))


def generate_resources(engine: EngineSpec, given_gpus: Any) -> tuple[int, int, int | None]:
    """(gpu, gpu_jobs) one generate job asks for, and the gpu_jobs total to register (None: none).

    A job with its own engine holds a GPU: gpu=1. With shared engines a job feeds an engine instead, and
    ``engine.jobs_per_engine`` jobs feed each GPU's engine, so the user's ``--resources gpu=N`` becomes
    ``gpu_jobs = N x jobs_per_engine``. On a cluster the profile overrides both (profiles/slurm: gpu=1,
    gpu_jobs=0): every job asks for the GPU its allocation needs, and the jobs grouped into one
    allocation share its engine.
    """
    if not engines.uses_gpu(engine):
        return 0, 0, None
    if not engine.shared:
        return 1, 0, None
    gpus = getattr(given_gpus, "value", given_gpus)
    return 0, 1, None if gpus is None else int(gpus) * engine.jobs_per_engine
