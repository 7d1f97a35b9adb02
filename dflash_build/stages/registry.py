"""The stages, each declared once by its own package: ``dflash_build/stages/NAME/stage.py`` holds ``STAGE``,
its descriptor (name, what its rule declares, the paths of a job from the plan, whether the config enables
it, what it adds to the build's final targets, its params, and for a keyed stage its store folder).

The Snakefile includes ``rules/NAME.smk`` of every enabled stage, the final targets and the rules' params
come from here, and :func:`planned` makes a job from its ``paths``. This module holds the descriptor type
and the discovery only: it imports no stage and re-exports nothing, so every descriptor imports it from
below (tests/test_layout.py); ``ops/`` and the cli import a stage's entry points from the stage itself.
Descriptors are found by package name at run time, so adding a stage touches no list elsewhere
(docs/architecture.md, "Where the system grows"). Reading a descriptor imports its stage package (Python
imports a package before its ``stage`` module): parsing the workflow imports all of them, a job its own
only (:func:`get`); no stage package imports an engine library at the top, so neither loads one.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build.stages.common.job import Job
from dflash_build.store import layout

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config

Paths = Mapping[str, tuple[Path, ...]]
PER = ("source", "shard", "round", "format", "config")


@dataclass(frozen=True)
class Of:
    """What one job is for: its source (and shard), its format, its sizing round and file."""

    source: str | None = None
    shard: str | None = None
    fmt: str | None = None
    round_: int | None = None
    sizing: str | Path | None = None


def shard_outputs(data: Path) -> Paths:
    """A shard job's outputs: its data file and its stats sidecar."""
    return {"data": (data,), "stats": (layout.sidecar(data),)}


def always(config: Config) -> bool:
    return True


def no_targets(plan: Plan) -> list[Path]:
    return []


def says_nothing(plan: Plan) -> list[str]:
    return []


@dataclass(frozen=True)
class Stage:
    """One stage: its name (its package ``dflash_build.stages.NAME``, its rule file ``rules/NAME.smk`` and
    its rule), the names its rule gives its inputs and outputs (what its ``Job`` reads them by), what one
    of its jobs is for (``per``: source, shard, round, format or the whole config), and where it sits in
    the order the data flows (``order``). ``paths``: a job's inputs and outputs from the plan;
    ``enabled``: whether the config includes its rule; ``targets``: what it adds to the build's default
    target (``snakemake`` with no target); ``params``: what its rule's params trigger reruns on (None:
    none); ``store``: a keyed stage's folder in the store (layout.Keyed); ``summary``: the lines a build
    that ends well prints of what the stage built."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    per: str
    order: int
    paths: Callable[[Plan, Of], tuple[Paths, Paths]]
    enabled: Callable[[Config], bool] = always
    targets: Callable[[Plan], list[Path]] = no_targets
    params: Callable[..., Any] | None = None
    store: layout.Keyed | None = None
    summary: Callable[[Plan], list[str]] = says_nothing

    def __post_init__(self) -> None:
        if self.per not in PER:
            raise ValueError(f"stage {self.name}: per must be one of {PER}, not {self.per!r}")

    @property
    def rule(self) -> str:
        """The rule that writes it (prepare's, one per source: ``prepare_SOURCE``)."""
        return self.name

    @property
    def key(self) -> str | None:
        return self.store.key if self.store is not None else None

    @property
    def rule_file(self) -> str:
        return f"rules/{self.name}.smk"


PACKAGE = "dflash_build.stages"


@functools.cache
def names() -> tuple[str, ...]:
    """Every stage's name: each subpackage of stages/ with a ``stage`` module, found without importing any
    (a job imports its own stage only: 0.03 CPU-s less a job than importing all of them, measured)."""
    folder = Path(importlib.import_module(PACKAGE).__file__ or "").parent
    return tuple(sorted(p.parent.name for p in folder.glob("*/stage.py") if (p.parent / "__init__.py").is_file()))


@functools.cache
def get(name: str) -> Stage:
    """The descriptor of the stage ``name``; imports that stage's package only."""
    if name not in names():
        raise ValueError(f"no stage named {name!r} (stages: {', '.join(names())})")
    stage = importlib.import_module(f"{PACKAGE}.{name}.stage").STAGE
    if stage.name != name:
        raise RuntimeError(f"{PACKAGE}.{name}.stage: STAGE is named {stage.name!r}, not its package's name {name!r}")
    return stage


@functools.cache
def stages() -> tuple[Stage, ...]:
    """Every stage's descriptor, in the order the data flows (imports every stage package)."""
    return tuple(sorted((get(name) for name in names()), key=lambda s: (s.order, s.name)))


def of_rule(rule: str) -> str:
    """The stage a rule runs: its name, or the stage whose name leads it (``prepare_SOURCE``, ``size_pilot``)."""
    found = [name for name in names() if rule == name or rule.startswith(f"{name}_")]
    if not found:
        raise ValueError(f"rule {rule!r} runs no stage (stages: {', '.join(names())})")
    return max(found, key=len)


def enabled(config: Config) -> list[Stage]:
    """The stages whose rules a build of ``config`` includes, in order."""
    return [s for s in stages() if s.enabled(config)]


def final_targets(plan: Plan) -> list[Path]:
    """What ``snakemake`` with no target builds: each enabled stage's targets, in order."""
    return [p for s in enabled(plan.config) for p in s.targets(plan)]


def planned(
    plan: Plan,
    stage: str,
    source: str | None = None,
    shard: str | None = None,
    fmt: str | None = None,
    round_: int | None = None,
    sizing: str | Path | None = None,
) -> Job:
    """The job ``stage``'s rule makes, from the plan alone (the paths the Snakefile declares: the rules'
    input functions call this); ``round_``: the sizing round of a ``size`` job (1: on the pilot, 2: the
    top-up); ``sizing``: the sizing file a size or mix job reads its shards from (mix.generate:
    as_needed; the checkpoint's output under Snakemake, else the one in the logs folder)."""
    descriptor = get(stage)
    inputs, outputs = descriptor.paths(plan, Of(source, shard, fmt, round_, sizing))
    key = plan.sources[source].keys[descriptor.key] if descriptor.key is not None and source is not None else None
    return Job(stage, plan, inputs, outputs, source=source, shard=shard, key=key, fmt=fmt)
