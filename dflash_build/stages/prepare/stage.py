"""The prepare stage as the build sees it: one job per source (stages.registry)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash_build.stages.registry import Of, Paths, Stage
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    assert of.source is not None
    references = tuple(sorted({f for fs in plan.reference_files.values() for f in fs}))
    bands = (plan.prompt_bands(of.source),) if plan.config.dedup.near else ()
    return (
        {"files": tuple(Path(f) for f in plan.sources[of.source].input_files), "references": references},
        {"manifest": (plan.prompt_manifest(of.source),), "bands": bands},
    )


STAGE = Stage("prepare", ("files", "references"), ("manifest", "bands"), "source", 10, paths, store=layout.PROMPTS)
