"""The export stage (config exports): one job per format (stages.registry)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build import versions
from dflash_build.publish import release
from dflash_build.stages import export
from dflash_build.stages.export import formats
from dflash_build.stages.registry import Of, Paths, Stage
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    assert of.fmt is not None
    store = [p for s in plan.sources for p in (plan.prompt_manifest(s), *plan.completion_shards(s))]
    inputs = {
        "dataset": (release.record_dir(cfg.dataset_dir),),
        "store": tuple(store) if formats.get(of.fmt).reads_store else (),
    }
    return inputs, {"record": (release.record_dir(cfg.export_dir(of.fmt)),)}


def enabled(config: Config) -> bool:
    return bool(config.exports)


def targets(plan: Plan) -> list[Path]:
    return [release.record_dir(plan.config.export_dir(fmt)) for fmt in plan.config.exports]


def params(plan: Plan, of: Of) -> Any:
    # the export depends on these and on the dataset (the input folder)
    assert of.fmt is not None
    return {**dataclasses.asdict(plan.config.exports[of.fmt]), "scheme": versions.EXPORT_VERSION}


def summary(plan: Plan) -> list[str]:
    out = []
    for fmt in plan.config.exports:
        folder = plan.config.export_dir(fmt)
        if (folder / layout.MANIFEST).exists():
            exported = json.loads((folder / layout.MANIFEST).read_text())
            out += [export.summary(exported, folder), *(f"warning: {w}" for w in export.warnings(exported))]
    return out


STAGE = Stage(
    "export", ("dataset", "store"), ("record",), "format", 80, paths, enabled, targets, params, summary=summary
)
