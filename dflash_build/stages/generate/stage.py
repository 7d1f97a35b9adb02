"""The generate stage as the build sees it: one job per prompt shard (stages.registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_build.stages.prepared.stage import record
from dflash_build.stages.registry import Of, Paths, Stage, shard_outputs
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    assert of.source is not None and of.shard is not None
    inputs = {
        "prompts": (plan.prompt_manifest(of.source),),
        "copies_of": tuple(plan.copies_inputs(of.source)),
        "prepared": record(plan),
    }
    return inputs, shard_outputs(layout.shard_file(plan.completion_dir(of.source), of.shard))


STAGE = Stage(
    "generate", ("prompts", "copies_of", "prepared"), ("data", "stats"), "shard", 30, paths, store=layout.COMPLETIONS
)
