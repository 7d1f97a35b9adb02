"""The train stage (config train): one job per config, after the dataset, not part of the default target
(stages.registry): `snakemake train`, or `snakemake accept` for a config whose drafter is `trained`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash_build.publish import release
from dflash_build.stages.registry import Of, Paths, Stage, no_targets

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    return {"dataset": (release.record_dir(cfg.dataset_dir),)}, {"record": (release.record_dir(cfg.drafter_dir),)}


def enabled(config: Config) -> bool:
    return config.train is not None


def params(plan: Plan, of: Of) -> Any:
    # a changed trainer, recipe or setting reruns the rule (the dataset is its input); a drafter trained
    # before under the same key is taken from the store, never trained again
    train = plan.config.train
    assert train is not None
    return {"trainer": train.trainer, "recipe": train.recipe, "target": train.target, "settings": train.settings}


STAGE = Stage("train", ("dataset",), ("record",), "config", 95, paths, enabled, no_targets, params)
