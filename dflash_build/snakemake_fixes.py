"""Where this workflow changes Snakemake's own behaviour: each change fixes a defect of the pinned Snakemake
(or adds one notion it lacks), checks that the code it changes is still the code it was written for, and
leaves a Snakemake that differs alone (tests/test_snakemake_fixes.py fails then, so the pin is revisited).

- :func:`fix_list_params_changes`: ``--list-changes params`` listed every output.
- :func:`fix_needrun_behind_ancient_inputs`: a job whose inputs from a job that reruns are all ancient was
  never evaluated, so its own missing outputs went unlisted by ``-n`` and unbuilt until the next run.
- :func:`quiet_restore_without_backup`: every failed job with an ``update()`` output that did not exist before
  it ran (every new shard) was followed by "Cannot restore ...: no backup found", a warning about nothing.
- :func:`fix_sigterm_during_job_selection`: a SIGTERM (Ctrl-C's cousin, a SLURM preemption) that came
  while Snakemake selected jobs deadlocked it for good: its handler takes the scheduler's lock, which the
  interrupted main thread holds (found by the fault soak, bench/soak.py).
- :func:`order_only`: Make's order-only prerequisite, an input that orders jobs and decides nothing about
  whether they run (not its time, not its presence in the recorded set of inputs).
"""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
from collections import deque
from typing import Any

ORDER_ONLY = "order_only"

# The one line of DAG.update_needrun that masks every job downstream of one that reruns, and what masks
# only those reached through an input that is not ancient (Snakemake's own later pass skips the others).
_MASK_ALL = "masked.update(self.bfs(self.depending, job))"
_MASK_FRESH = "masked.update(await _downstream_through_fresh_inputs(self, job))"


# What PersistenceBase._input does in the pinned release, which record_order_only_inputs_apart relies on: it
# records each input of the job, a plain file as itself (order-only inputs are plain files), sorted.
_RECORDED_INPUTS = ("for f in job.input:", "else f", "return sorted(get_paths())")


# The Snakemake releases these changes were written for and tested on (pyproject.toml pins the same range).
TESTED = ("9.27.1",)
# Set to 1, a build runs on a Snakemake whose code a fix does not find, without that fix (docs/snakemake.md
# says what each one's absence costs).
UNFIXED_ENV = "DFLASH_BUILD_SNAKEMAKE_UNFIXED"


def apply() -> list[str]:
    """Every change below, once per process (the Snakefile calls this at parse time). A Snakemake outside
    :data:`TESTED`, or one whose code a change does not find, stops the run in one line naming the version
    and the changes, unless :data:`UNFIXED_ENV` is 1. Returns the changes that did not apply."""
    import snakemake
    import snakemake.api

    missed = []
    for fix in FIXES:
        try:
            applied = fix() is not False
        except (ImportError, AttributeError, OSError, TypeError):  # its target moved or went
            applied = False
        if not applied:
            missed.append(fix.__name__)
    version = getattr(snakemake, "__version__", "?")
    if (missed or version not in TESTED) and os.environ.get(UNFIXED_ENV) != "1":
        what = f"its code is not what {', '.join(missed)} was written for" if missed else "it is not tested"
        sys.exit(
            f"dflash-build: Snakemake {version}: {what} (tested: {', '.join(TESTED)}); install "
            f"snakemake=={TESTED[-1]} (pyproject.toml's range), or set {UNFIXED_ENV}=1 to run without those "
            "fixes (docs/snakemake.md: what each absence costs)"
        )
    return missed


def fix_sigterm_during_job_selection() -> bool:
    """Make the job scheduler's lock re-entrant, so its SIGTERM handler can take it in the main thread.

    ``JobScheduler.exit_gracefully`` (its SIGTERM handler) does ``with self._lock``; the main thread holds
    that lock while it selects jobs (``run_selector``, which waits on the ILP solver's process). A SIGTERM
    then runs the handler in the main thread, inside that section: it waits for a lock its own thread holds,
    forever, and the jobs' error callbacks queue behind it. With a re-entrant lock the handler only marks
    the shutdown, as it means to; other threads are excluded as before. True if Snakemake was changed.
    """
    import threading

    from snakemake.scheduling import job_scheduler

    scheduler = job_scheduler.JobScheduler
    if getattr(scheduler.__init__, "dflash_fixed", False):
        return True
    handler = inspect.getsource(scheduler.exit_gracefully)
    if "self._lock = threading.Lock()" not in inspect.getsource(scheduler.__init__) or "self._lock" not in handler:
        return False
    init = scheduler.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._lock = threading.RLock()  # nothing holds it yet: no thread has started

    __init__.dflash_fixed = True  # type: ignore[attr-defined]
    scheduler.__init__ = __init__  # type: ignore[method-assign]
    return True


def quiet_restore_without_backup() -> bool:
    """Restore an ``update()`` output after a failed job without a warning when it had no earlier version.

    Snakemake backs up an ``update()`` output before its job runs only if it exists, then on failure tries
    to restore every one and warns "Cannot restore PATH: no backup found." for each that had none: after
    every failed generate job of a new shard, a line that reads like a second fault. A missing backup of an
    output that was not there is the expected case; True if Snakemake was changed.
    """
    from snakemake.persistence import FileBackupMixin

    restore = FileBackupMixin.restore_output
    if getattr(restore, "dflash_fixed", False):
        return True
    if "no backup found" not in inspect.getsource(restore):
        return False

    def restore_output(self: Any, path: Any) -> bool:
        return bool(self._get_backup_path(path).exists() and restore(self, path))

    restore_output.dflash_fixed = True  # type: ignore[attr-defined]
    FileBackupMixin.restore_output = restore_output  # type: ignore[method-assign]
    return True


def fix_list_params_changes() -> bool:
    """Make ``snakemake --list-changes params`` list only outputs whose params changed.

    Snakemake 9's ``ParamsChange`` (persistence) iterates its files even when it holds no change, and
    ``params_changed`` returns one for every output with recorded params, so the command listed the
    last output of every job: ``snakemake -R $(snakemake --list-changes params)`` then reran prepare
    jobs for nothing. An iteration that yields files only for a real change is what the listing (its
    one user that iterates) means; a Snakemake that already does so is left alone.
    """
    from snakemake.persistence import ParamsChange

    if list(ParamsChange(files={"probe"})):
        ParamsChange.__iter__ = lambda self: iter(self.files if self else ())  # type: ignore[method-assign]
    return not list(ParamsChange(files={"probe"}))


async def _downstream_through_fresh_inputs(dag: Any, job: Any) -> set[Any]:
    """``job`` and every job downstream of it through inputs that are not all ancient (and present)."""
    seen = {job}
    queue = deque([job])
    while queue:
        for job_, files in dag.depending[queue.popleft()].items():
            if job_ in seen:
                continue
            ancient = True
            for f in files:
                ancient = ancient and f.is_ancient and await f.exists()
            if not ancient:
                seen.add(job_)
                queue.append(job_)
    return seen


def fix_needrun_behind_ancient_inputs() -> bool:
    """Evaluate the jobs whose only inputs from a job that reruns are ancient; True if Snakemake was changed.

    ``DAG.update_needrun`` visits jobs in topological order and, once a job must run, masks every job
    downstream of it: those are left to a second pass that follows the edges from each job that runs.
    That pass skips a job whose inputs from it are all ancient ("no other reason to run"), without asking
    whether the job has a reason of its own, so a generate job whose output is missing went unlisted by
    ``snakemake -n`` and unbuilt (a second build made it) whenever its source's prepare reran with the
    same key (moved input files), and behind the gate every generate job waits on (rules/prepared.smk,
    whose record is the generate jobs' order-only input). Masking only what is reached through inputs
    that are not ancient has the first pass evaluate those jobs like any other.
    """
    from snakemake import dag as dag_module

    method = dag_module.DAG.update_needrun
    if getattr(method, "dflash_fixed", False):
        return True
    source = textwrap.dedent(inspect.getsource(method))
    if source.count(_MASK_ALL) != 1:
        return False
    namespace = dict(vars(dag_module), _downstream_through_fresh_inputs=_downstream_through_fresh_inputs)
    exec(compile(source.replace(_MASK_ALL, _MASK_FRESH), inspect.getsourcefile(method) or "dag.py", "exec"), namespace)
    fixed = namespace["update_needrun"]
    fixed.dflash_fixed = True
    dag_module.DAG.update_needrun = fixed
    return True


def order_only(path: Any) -> Any:
    """An input that only orders: the job waits for the job that writes it when that job runs, and neither
    its time (ancient) nor its presence decides whether the job runs (it is left out of the inputs
    Snakemake records, so adding one to a rule reruns none of its jobs)."""
    from snakemake.io import ancient, flag

    return flag(ancient(path), ORDER_ONLY)


def record_order_only_inputs_apart() -> bool:
    """Leave order-only inputs out of the set of inputs Snakemake records and compares (the ``input``
    rerun trigger), so a rule given one reruns none of the jobs it made before."""
    from snakemake.io import is_flagged
    from snakemake.persistence import PersistenceBase

    recorded = PersistenceBase._input
    if getattr(recorded, "dflash_fixed", False):
        return True
    # the recorded list holds each plain input as itself, sorted: what the filter below compares with
    source = inspect.getsource(recorded)
    if any(line not in source for line in _RECORDED_INPUTS):
        return False

    def _input(self: Any, job: Any) -> list[str]:
        skipped = {str(f) for f in job.input if is_flagged(f, ORDER_ONLY)}
        return [p for p in recorded(self, job) if str(p) not in skipped] if skipped else recorded(self, job)

    _input.dflash_fixed = True  # type: ignore[attr-defined]
    PersistenceBase._input = _input  # type: ignore[method-assign]
    return True


FIXES = (
    fix_list_params_changes,
    fix_needrun_behind_ancient_inputs,
    record_order_only_inputs_apart,
    quiet_restore_without_backup,
    fix_sigterm_during_job_selection,
)
