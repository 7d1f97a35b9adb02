"""The seam between the Snakemake rules and the stages: logging, and one entry point per rule.

Each rule's ``script:`` calls :func:`run_rule` with the ``snakemake`` object; the plan is rebuilt from
the job's config (fingerprints come from the cache) and the stage runs with its log file attached.
"""

from __future__ import annotations

import contextlib
import json
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


def warnings_to_stderr() -> None:
    """While Snakemake parses the workflow, the package's warnings (a cache rebuilt, ...) reach the user."""
    root = logging.getLogger("dflash_build")
    if not any(getattr(h, "dflash_parse_time", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("dflash-build: %(levelname)s: %(message)s"))
        handler.dflash_parse_time = True  # type: ignore[attr-defined]
        root.addHandler(handler)


def plan_from(config: dict[str, Any]) -> plan_mod.Plan:
    return plan_mod.build(config_mod.from_dict(config))


class KeyMismatchError(RuntimeError):
    """The config, model or inputs changed since Snakemake planned this job: its output would go astray."""


def check_key(plan: plan_mod.Plan, stage: str, source: str, asked: str, planned: str) -> None:
    """Fail unless the job's own plan gives the key Snakemake asked for; say what differs if not.

    ``planned`` is the canonical JSON of the components Snakemake planned with (the rule's params).
    """
    from dflash_build.operate import diff

    sp = plan.sources[source]
    key, components = {
        "prepare": (sp.prompt_key, sp.prompt_components),
        "generate": (sp.gen_key, sp.gen_components),
        "tokenize": (sp.tok_key, sp.tok_components),
    }[stage]
    if key == asked:
        return
    changes = "\n".join(f"  {c}" for c in diff(json.loads(planned), components)) or "  (no differences recorded)"
    raise KeyMismatchError(
        f"{stage} {source}: Snakemake planned key {asked}, but the config and inputs now give {key}; "
        f"something changed since the workflow started:\n{changes}\nRun snakemake again to plan the new key."
    )


def run_rule(smk: Any, stage: str) -> None:
    """Run ``stage`` for a Snakemake job (the ``snakemake`` object a script receives).

    Before any work (no tokenizer, no GPU), the job checks that its own plan gives the key Snakemake
    asked for, and it reads and writes the paths Snakemake gave it.
    """
    from dflash_build import generate, mix, prepare, tokenize

    with logged(smk.log[0] if smk.log else None):
        plan = plan_from(smk.config)
        if stage == "prepare":
            check_key(plan, stage, smk.params.source, Path(smk.output.manifest).parent.name, smk.params.components)
        elif stage in ("generate", "tokenize"):
            check_key(plan, stage, smk.wildcards.source, smk.wildcards.key, smk.params.components)
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
        elif stage == "pack":
            from dflash_build import pack

            assert plan.config.pack is not None
            pack.run(smk.input[0], smk.output[0], plan.config.pack, plan.config.rows_per_file)
        else:
            raise ValueError(f"unknown stage {stage}")


def generate_resources(
    engine: config_mod.EngineSpec, given_gpus: Any, cluster: bool = False
) -> tuple[int, int, int | None]:
    """(gpu, gpu_jobs) one generate job asks for, and the gpu_jobs total to register (None: none).

    A job with its own engine holds a GPU: gpu=1. With shared engines a job feeds an engine instead, and
    ``engine.jobs_per_engine`` jobs feed each GPU's engine, so the user's ``--resources gpu=N`` becomes
    ``gpu_jobs = N x jobs_per_engine``. Submitted to a ``cluster`` (a Snakemake executor other than the
    local one), every job asks for the GPU its allocation needs (the executor turns gpu into a GPU
    request); the jobs grouped into one allocation then share its engine.
    """
    from dflash_build import engines

    if not engines.uses_gpu(engine):
        return 0, 0, None
    if not engine.shared or cluster:
        return 1, 0, None
    gpus = getattr(given_gpus, "value", given_gpus)
    return 0, 1, None if gpus is None else int(gpus) * engine.jobs_per_engine
