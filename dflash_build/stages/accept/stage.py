"""The accept stage (config accept): acceptance per slice, one job per config, not part of the default
target (stages.registry)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dflash_build.publish import release
from dflash_build.stages.registry import Of, Paths, Stage, no_targets

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    inputs = {"split": (release.record_dir(cfg.eval_dir),), "dataset": (release.record_dir(cfg.dataset_dir),)}
    # a `trained` drafter is the train stage's: accept runs after it
    trained = cfg.accept is not None and any(d.trained for d in cfg.accept.drafters.values())
    inputs["drafter"] = (release.record_dir(cfg.drafter_dir),) if trained else ()
    return inputs, {"record": (release.record_dir(cfg.acceptance_dir),)}


def enabled(config: Config) -> bool:
    return config.accept is not None


def params(plan: Plan, of: Of) -> Any:
    # a drafter added, changed (its files' digests) or re-optioned reruns the rule; the ones measured
    # before are read from the store
    # a trained drafter's files are the train stage's output, its input here: the fingerprint the plan
    # reads before that stage runs would be the drafter it replaces
    accept = plan.config.accept
    assert accept is not None
    fingerprints = {n: f for n, f in plan.drafter_fingerprints.items() if not accept.drafters[n].trained}
    return {**dataclasses.asdict(accept), "fingerprints": fingerprints}


STAGE = Stage("accept", ("split", "dataset", "drafter"), ("record",), "config", 100, paths, enabled, no_targets, params)
