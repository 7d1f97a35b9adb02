"""The mix stage: one job per config, the dataset (stages.registry)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build.publish import card, release
from dflash_build.stages import mix, size
from dflash_build.stages.registry import Of, Paths, Stage, always
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    final = of.sizing or layout.sizing_file(cfg.logs, cfg.dataset_name, layout.SIZING_ROUNDS[-1])
    across = cfg.dedup.near and cfg.dedup.across_sources
    if cfg.mix_generate != "as_needed":
        tokens = tuple(sorted(plan.all_token_shards()))
    else:  # the shards the top-up's sizing names; none before it is decided (Snakemake's checkpoint waits)
        tokens = tuple(Path(p) for p in size.sized_shards(plan, final)) if Path(final).exists() else ()
    inputs = {
        "tokens": tokens,
        "bands": tuple(plan.prompt_bands(s) for s in sorted(plan.sources)) if across else (),
        "manifests": tuple(plan.prompt_manifest(s) for s in plan.sources),
    }
    return inputs, {"record": (release.record_dir(cfg.dataset_dir),)}


def targets(plan: Plan) -> list[Path]:
    return [release.record_dir(plan.config.dataset_dir)]


def params(plan: Plan, of: Of) -> Any:
    return mix.params(plan.config)


def summary(plan: Plan) -> list[str]:
    folder = plan.config.dataset_dir
    manifest = folder / layout.MANIFEST
    return [card.summary(json.loads(manifest.read_text()), folder, sources=True)] if manifest.exists() else []


STAGE = Stage(
    "mix", ("tokens", "bands", "manifests"), ("record",), "config", 60, paths, always, targets, params, summary=summary
)
