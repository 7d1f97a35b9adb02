"""The tokenize stage as the build sees it: one job per completion shard (stages.registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_build.stages.registry import Of, Paths, Stage, shard_outputs
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    assert of.source is not None and of.shard is not None
    completions = layout.shard_file(plan.completion_dir(of.source), of.shard)
    inputs = {"completions": (completions,), "prompts": (plan.prompt_manifest(of.source),)}
    return inputs, shard_outputs(layout.shard_file(plan.token_dir(of.source), of.shard))


STAGE = Stage("tokenize", ("completions", "prompts"), ("data", "stats"), "shard", 40, paths, store=layout.TOKENS)
