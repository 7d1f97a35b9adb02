"""The size stage (mix.generate: as_needed): one job per sizing round (stages.registry)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build.stages import size
from dflash_build.stages.registry import Of, Paths, Stage
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    assert of.round_ in layout.SIZING_ROUNDS, f"size: a round of {layout.SIZING_ROUNDS}"
    first = of.round_ == layout.SIZING_ROUNDS[0]
    earlier = of.sizing or (None if first else layout.sizing_file(cfg.logs, cfg.dataset_name, of.round_ - 1))
    sizing = Path(layout.sizing_file(cfg.logs, cfg.dataset_name, of.round_))
    decided = earlier is None or Path(earlier).exists()  # none before the round it measures is sized
    tokens = tuple(Path(p) for p in size.sized_shards(plan, earlier)) if decided else ()
    return {"tokens": tokens}, {"sizing": (sizing,)}


def params(plan: Plan, of: Of) -> Any:
    # a changed share, budget or weight sizes the rounds again (the params trigger); nothing regenerates
    return size.params(plan.config)


def enabled(config: Config) -> bool:
    return config.mix_generate == "as_needed"


STAGE = Stage("size", ("tokens",), ("sizing",), "round", 50, paths, enabled, params=params)
