"""The preflight stage: one job per config; not part of the default target (stages.registry)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash_build.stages.prepared.stage import record
from dflash_build.stages.registry import Of, Paths, Stage
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    summary = Path(layout.preflight_summary(cfg.logs, cfg.dataset_name))
    return {"prepared": record(plan)}, {"summary": (summary,)}


STAGE = Stage("preflight", ("prepared",), ("summary",), "config", 110, paths)
