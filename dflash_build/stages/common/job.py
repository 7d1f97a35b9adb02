"""The one contract of every stage: ``run(job) -> record``.

A :class:`Job` carries the plan, the paths its rule declares (inputs and outputs by name, as Snakemake
passed them) and, for a keyed stage, the key Snakemake asked for. A stage reads no input its rule does
not declare: what it reads beside a declared file (a prompt shard beside its source's manifest, a
dataset version behind its build record) is found from that file. :func:`planned` makes the job a rule
would make from the plan alone, for tests, benchmarks and ``dflash-build`` commands that run a stage
without Snakemake; :data:`INPUTS` and :data:`OUTPUTS` name what each stage's rule declares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.stages.common.failure import StageFailure as StageFailure
from dflash_build.stages.export import formats as export_formats
from dflash_build.store import layout

# What each rule declares, by name (rules/*.smk use the same names): the stage table's.
INPUTS: dict[str, tuple[str, ...]] = {s.name: s.inputs for s in layout.TABLE}
OUTPUTS: dict[str, tuple[str, ...]] = {s.name: s.outputs for s in layout.TABLE}


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


def sized_counts(plan: Plan, sizing: str | Path | None) -> dict[str, int]:
    """How many of each source's first shards a sizing file names (none yet: the pilot's, one each)."""
    if sizing is None:
        return dict.fromkeys(plan.sources, 1)
    return dict(json.loads(Path(sizing).read_text())["shards"])


def sized_shards(plan: Plan, sizing: str | Path | None) -> list[str]:
    """The token shards a sizing file names, by source name (:func:`sized_counts`)."""
    counts = sized_counts(plan, sizing)
    return [str(p) for name in sorted(plan.sources) for p in plan.token_shards(name)[: counts[name]]]


Paths = dict[str, tuple[Path, ...]]


@dataclass(frozen=True)
class _Of:
    """What one job is for: its source (and shard), its format, its sizing round and file."""

    source: str | None = None
    shard: str | None = None
    fmt: str | None = None
    round_: int | None = None
    sizing: str | Path | None = None


def _shard_outputs(data: Path) -> Paths:
    return {"data": (data,), "stats": (layout.sidecar(data),)}


def _prepare(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    assert of.source is not None
    references = tuple(sorted({f for fs in plan.reference_files.values() for f in fs}))
    bands = (plan.prompt_bands(of.source),) if plan.config.dedup.near else ()
    return (
        {"files": tuple(plan.sources[of.source].input_files), "references": references},
        {"manifest": (plan.prompt_manifest(of.source),), "bands": bands},
    )


def _prepared(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    inputs = {"manifests": tuple(plan.prompt_manifest(s) for s in plan.sources)}
    return inputs, {"record": (Path(layout.prepared_record(cfg.logs, cfg.dataset_name)),)}


def _generate(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    assert of.source is not None and of.shard is not None
    inputs = {
        "prompts": (plan.prompt_manifest(of.source),),
        "copies_of": tuple(plan.copies_inputs(of.source)),
        "prepared": _prepared(plan, of)[1]["record"],
    }
    return inputs, _shard_outputs(layout.shard_file(plan.completion_dir(of.source), of.shard))


def _tokenize(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    assert of.source is not None and of.shard is not None
    completions = layout.shard_file(plan.completion_dir(of.source), of.shard)
    inputs = {"completions": (completions,), "prompts": (plan.prompt_manifest(of.source),)}
    return inputs, _shard_outputs(layout.shard_file(plan.token_dir(of.source), of.shard))


def _size(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    assert of.round_ in layout.SIZING_ROUNDS, f"size: a round of {layout.SIZING_ROUNDS}"
    first = of.round_ == layout.SIZING_ROUNDS[0]
    earlier = of.sizing or (None if first else layout.sizing_file(cfg.logs, cfg.dataset_name, of.round_ - 1))
    sizing = Path(layout.sizing_file(cfg.logs, cfg.dataset_name, of.round_))
    decided = earlier is None or Path(earlier).exists()  # none before the round it measures is sized
    tokens = tuple(Path(p) for p in sized_shards(plan, earlier)) if decided else ()
    return {"tokens": tokens}, {"sizing": (sizing,)}


def _mix(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    final = of.sizing or layout.sizing_file(cfg.logs, cfg.dataset_name, layout.SIZING_ROUNDS[-1])
    across = cfg.dedup.near and cfg.dedup.across_sources
    if cfg.mix_generate != "as_needed":
        tokens = tuple(sorted(plan.all_token_shards()))
    else:  # the shards the top-up's sizing names; none before it is decided (Snakemake's checkpoint waits)
        tokens = tuple(Path(p) for p in sized_shards(plan, final)) if Path(final).exists() else ()
    inputs = {
        "tokens": tokens,
        "bands": tuple(plan.prompt_bands(s) for s in sorted(plan.sources)) if across else (),
        "manifests": tuple(plan.prompt_manifest(s) for s in plan.sources),
    }
    return inputs, {"record": (release.record_dir(cfg.dataset_dir),)}


def _pack(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    assert cfg.packed_dir is not None, "pack: the config has no pack section"
    return {"dataset": (release.record_dir(cfg.dataset_dir),)}, {"record": (release.record_dir(cfg.packed_dir),)}


def _export(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    assert of.fmt is not None
    store = [p for s in plan.sources for p in (plan.prompt_manifest(s), *plan.completion_shards(s))]
    inputs = {
        "dataset": (release.record_dir(cfg.dataset_dir),),
        "store": tuple(store) if export_formats.get(of.fmt).reads_store else (),
    }
    return inputs, {"record": (release.record_dir(cfg.export_dir(of.fmt)),)}


def _evalset(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    # the held-out prompts lie beside each manifest (prepare writes them before it)
    inputs = {"manifests": tuple(plan.prompt_manifest(s) for s in sorted(plan.sources))}
    return inputs, {"record": (release.record_dir(cfg.eval_dir),)}


def _accept(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    inputs = {"split": (release.record_dir(cfg.eval_dir),), "dataset": (release.record_dir(cfg.dataset_dir),)}
    return inputs, {"record": (release.record_dir(cfg.acceptance_dir),)}


def _preflight(plan: Plan, of: _Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    summary = Path(layout.preflight_summary(cfg.logs, cfg.dataset_name))
    return {"prepared": _prepared(plan, of)[1]["record"]}, {"summary": (summary,)}


# Each stage's paths from the plan (layout.TABLE names each stage and what its rule declares).
_PATHS = {"prepare": _prepare, "prepared": _prepared, "generate": _generate, "tokenize": _tokenize}
_PATHS |= {"size": _size, "mix": _mix, "pack": _pack, "export": _export, "evalset": _evalset, "accept": _accept}
_PATHS["preflight"] = _preflight


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
    if stage not in layout.BY_NAME:
        raise ValueError(f"no stage named {stage!r}")
    table = layout.BY_NAME[stage]
    inputs, outputs = _PATHS[stage](plan, _Of(source, shard, fmt, round_, sizing))
    key = plan.sources[source].keys[table.key] if table.key is not None and source is not None else None
    return Job(stage, plan, inputs, outputs, source=source, shard=shard, key=key, fmt=fmt)
