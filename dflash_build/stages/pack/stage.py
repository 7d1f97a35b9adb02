"""The pack stage (config pack): one job per config (stages.registry)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build.publish import release
from dflash_build.stages import pack
from dflash_build.stages.registry import Of, Paths, Stage
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    assert cfg.packed_dir is not None, "pack: the config has no pack section"
    return {"dataset": (release.record_dir(cfg.dataset_dir),)}, {"record": (release.record_dir(cfg.packed_dir),)}


def enabled(config: Config) -> bool:
    return config.pack is not None


def targets(plan: Plan) -> list[Path]:
    assert plan.config.packed_dir is not None
    return [release.record_dir(plan.config.packed_dir)]


def params(plan: Plan, of: Of) -> Any:
    # the packed rows depend on these and on the dataset (the input folder)
    cfg = plan.config
    assert cfg.pack is not None
    return {**dataclasses.asdict(cfg.pack), "rows_per_file": cfg.rows_per_file}


def summary(plan: Plan) -> list[str]:
    folder = plan.config.packed_dir
    if folder is None or not (folder / layout.MANIFEST).exists():
        return []
    return [pack.summary(json.loads((folder / layout.MANIFEST).read_text()), folder)]


STAGE = Stage("pack", ("dataset",), ("record",), "config", 70, paths, enabled, targets, params, summary=summary)
