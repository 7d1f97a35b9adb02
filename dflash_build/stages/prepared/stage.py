"""The prepared stage (every source prepared: the order-only input of generation): one job per config."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash_build.stages.registry import Of, Paths, Stage
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan


def record(plan: Plan) -> tuple[Path, ...]:
    """The record every generate and preflight job waits for."""
    cfg = plan.config
    return (Path(layout.prepared_record(cfg.logs, cfg.dataset_name)),)


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    return {"manifests": tuple(plan.prompt_manifest(s) for s in plan.sources)}, {"record": record(plan)}


STAGE = Stage("prepared", ("manifests",), ("record",), "config", 20, paths)
