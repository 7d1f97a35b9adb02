"""The evalset stage (config eval): the held-out split, one job per config (stages.registry)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash_build.publish import release
from dflash_build.stages.registry import Of, Paths, Stage

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    # the held-out prompts lie beside each manifest (prepare writes them before it)
    inputs = {"manifests": tuple(plan.prompt_manifest(s) for s in sorted(plan.sources))}
    return inputs, {"record": (release.record_dir(cfg.eval_dir),)}


def enabled(config: Config) -> bool:
    return config.held_out is not None


def targets(plan: Plan) -> list[Path]:
    return [release.record_dir(plan.config.eval_dir)]


STAGE = Stage("evalset", ("manifests",), ("record",), "config", 90, paths, enabled, targets)
