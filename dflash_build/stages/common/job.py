"""The one contract of every stage: ``run(job) -> record``.

A :class:`Job` carries the plan, the paths its rule declares (inputs and outputs by name, as Snakemake
passed them) and, for a keyed stage, the key Snakemake asked for. A stage reads no input its rule does
not declare: what it reads beside a declared file (a prompt shard beside its source's manifest, a
dataset version behind its build record) is found from that file. :func:`dflash_build.stages.registry.planned`
makes the job a rule would make from the plan alone, from the stage's own descriptor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.stages.common.failure import StageFailure as StageFailure
from dflash_build.store import layout


@dataclass(frozen=True)
class Job:
    """One run of ``stage``: for a source (and shard), for an export format, or for the whole config."""

    stage: str
    plan: Plan
    inputs: Mapping[str, tuple[Path, ...]] = field(default_factory=dict)
    outputs: Mapping[str, tuple[Path, ...]] = field(default_factory=dict)
    source: str | None = None
    shard: str | None = None
    key: str | None = None  # the key Snakemake asked for (keyed stages: prepare, generate, tokenize)
    fmt: str | None = None  # export: the format
    # what the rule's script gives the stage beside the plan: functions of the layers above the stages
    # (accept's ``next_round``: ops' estimate of a change, which a stage cannot import)
    given: Mapping[str, Any] = field(default_factory=dict)

    def input(self, name: str) -> Path:
        """The one path of the declared input ``name``."""
        return _one(self.inputs, name, self.stage)

    def output(self, name: str) -> Path:
        """The one path of the declared output ``name``."""
        return _one(self.outputs, name, self.stage)

    def prompt_shard(self) -> Path:
        """The job's prompt shard: beside its source's manifest, the one prepare output jobs declare."""
        manifest = self.input("prompts")
        assert self.shard is not None, f"{self.stage}: a prompt shard needs a shard job"
        path = layout.shard_file(manifest.parent, self.shard)
        if not path.exists():
            raise FileNotFoundError(
                f"prompt shard {path} is missing although its manifest {manifest} exists; "
                f"delete {manifest} and run again to prepare the source anew"
            )
        return path

    def by_source(self, name: str) -> dict[str, list[Path]]:
        """The declared input ``name``'s paths grouped by the source whose store folder holds them, in
        the plan's source order; each source's paths sorted (shard order)."""
        dirs = {}
        for source in self.plan.sources:
            dirs.update(
                {
                    self.plan.prompt_dir(source): source,
                    self.plan.completion_dir(source): source,
                    self.plan.token_dir(source): source,
                }
            )
        grouped: dict[str, list[Path]] = {s: [] for s in self.plan.sources}
        for path in self.inputs.get(name, ()):
            source = dirs.get(path.parent)
            if source is None:
                raise ValueError(f"{self.stage}: input {path} lies in no source's store folder of this config")
            grouped[source].append(path)
        return {s: sorted(paths) for s, paths in grouped.items()}

    def published(self, name: str = "dataset") -> Path:
        """The folder (``dist/NAME``) whose build record is the declared input ``name`` (or output)."""
        record = self.input(name) if name in self.inputs else self.output(name)
        return release.folder_of(record)


def _one(paths: Mapping[str, tuple[Path, ...]], name: str, stage: str) -> Path:
    found = paths.get(name, ())
    if len(found) != 1:
        raise KeyError(f"{stage}: expected one path named {name!r}, got {len(found)}")
    return found[0]
