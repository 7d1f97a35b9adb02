"""The seam between the Snakemake rules and the stages: logging, and one entry point per rule.

Each rule's ``script:`` calls :func:`run_rule` with the ``snakemake`` object; the plan is rebuilt from
the job's config (fingerprints come from the cache) and the stage runs with its log file attached.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def logged(log_path: str | Path | None) -> Iterator[None]:
    """Send the package's log records to ``log_path`` (and stderr) for the duration of a job."""
    root = logging.getLogger("dflash_build")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w", encoding="utf-8"))
    for h in handlers:
        h.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(h)
    previous = root.level
    root.setLevel(logging.INFO)
    try:
        yield
    except Exception:
        root.exception("job failed")
        raise
    finally:
        root.setLevel(previous)
        for h in handlers:
            root.removeHandler(h)
            h.close()


def plan_from(config: dict[str, Any]) -> plan_mod.Plan:
    return plan_mod.build(config_mod.from_dict(config))


def run_rule(smk: Any, stage: str) -> None:
    """Run ``stage`` for a Snakemake job (the ``snakemake`` object a script receives)."""
    from dflash_build import generate, mix, prepare, tokenize

    with logged(smk.log[0] if smk.log else None):
        plan = plan_from(smk.config)
        if stage == "prepare":
            prepare.run(plan, smk.params.source)
        elif stage == "generate":
            source, shard = smk.wildcards.source, smk.wildcards.shard
            paths = generate.ShardPaths(
                Path(smk.input[0]), Path(smk.output.data), Path(smk.output.stats), plan.journal_dir(source, shard)
            )
            generate.run(plan, source, shard, paths)
        elif stage == "tokenize":
            tokenize.run(plan, smk.wildcards.source, smk.wildcards.shard, Path(smk.input[0]), Path(smk.output.data))
        elif stage == "mix":
            mix.run(plan, smk.output[0])
        else:
            raise ValueError(f"unknown stage {stage}")
