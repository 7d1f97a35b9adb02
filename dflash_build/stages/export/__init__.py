"""Export stage (optional): the mixed dataset in the form a drafter trainer reads, beside the dataset.

Each format is one module of this package (:mod:`.formats` is the descriptor): ``tokens`` (``specforge``,
``speculators``: token rows with the trainers' own length policy and filters) and ``conversations``
(the regenerated answers as text). Each export is a folder version like the dataset's
(:mod:`dflash_build.publish.release`): ``data/*.jsonl``, ``manifest.json`` and a card, swapped in whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build import hashing
from dflash_build.publish import release
from dflash_build.spec import ExportSpec
from dflash_build.stages.common.failure import StageFailure
from dflash_build.stages.export import formats
from dflash_build.stages.export.jsonl import DATA_DIR, JsonlShards
from dflash_build.store import atomic, layout
from dflash_build.versions import EXPORT_VERSION

if TYPE_CHECKING:
    from dflash_build.stages.common.job import Job

log = logging.getLogger(__name__)


class ExportEmptyError(StageFailure):
    """Every sample of the dataset would be left out of an export: it fails instead of writing nothing."""


def export_key(mix_manifest: dict[str, Any], spec: ExportSpec) -> str:
    """What decides an export: the dataset's content, the export's settings, the scheme."""
    content = [f["sha256"] for f in mix_manifest["files"]]
    return hashing.digest({"mix": content, "export": asdict(spec), "version": EXPORT_VERSION})[:16]


def run(job: Job) -> dict[str, Any]:
    """Write the job's format's export of the dataset (its declared input) as a new version of the export
    folder, whose build record is the job's output. Conversations read each source's completion shards
    (declared) and the prompt shards beside its manifest (declared)."""
    assert job.fmt is not None
    spec = job.plan.config.exports[job.fmt]
    record = job.output("record")
    out_dir = release.folder_of(record)
    dataset = release.in_place(job.published("dataset"))
    mix_manifest, files = dataset.manifest, dataset.files
    stores = _prompts_and_completions(job.by_source("store"))
    with release.publish(out_dir, record) as tmp:
        shards = JsonlShards(tmp / DATA_DIR, spec.shard_rows)
        sources = {n: sp.spec for n, sp in job.plan.sources.items()}
        counts = formats.get(spec.format).write(formats.Written(files, stores, spec, shards, sources))
        if counts["samples_in"] and not counts["rows"]:
            reasons = ", ".join(f"{n} {why}" for why, n in (counts.get("dropped") or {}).items())
            raise ExportEmptyError(
                f"export.{spec.format}: all {counts['samples_in']} samples of {mix_manifest['dataset']} were left "
                f"out ({reasons}): a trainer would get nothing. Raise export.{spec.format}.max_length, or set "
                f"export.{spec.format}.long to warn, cut or split; the last good {out_dir.name} stays as it was"
            )
        manifest = {
            "stage": "export",
            "format": spec.format,
            "scheme": EXPORT_VERSION,
            "export_key": export_key(mix_manifest, spec),
            "dataset": out_dir.name,
            "exported_from": mix_manifest["dataset"],
            "export": asdict(spec),
            "files": shards.close(tmp),
            **counts,
        }
        atomic.write_json(tmp / layout.MANIFEST, manifest)
        atomic.write_text(tmp / "README.md", card(manifest))
    log.info("%s", summary(manifest, out_dir))
    for line in warnings(manifest):
        log.warning("%s", line)
    return manifest


def _prompts_and_completions(store: Mapping[str, list[Path]]) -> dict[str, list[tuple[Path, Path]]]:
    """Each source's (prompt shard, completion shard) pairs, in shard order, from its declared manifest
    and completion shards: a prompt shard lies beside its manifest, named as its completion shard."""
    pairs = {}
    for source, paths in store.items():
        manifests = [p for p in paths if p.name == layout.MANIFEST]
        if manifests:
            pairs[source] = [(manifests[0].parent / p.name, p) for p in paths if p.name != layout.MANIFEST]
    return pairs


def warnings(manifest: dict[str, Any]) -> list[str]:
    """What the trainer loses: said loudly in the log, the card and the build summary."""
    spec = manifest["export"]
    lines = []
    long = manifest.get("kept_longer_than_max_length", 0)
    lost = _share(manifest.get("trainer_cuts_loss_tokens", 0), manifest.get("loss_tokens", 0))
    if long and spec["long"] == "warn":
        lines.append(
            f"{manifest['dataset']}: {long} of the {manifest['rows']} rows are longer than max_length "
            f"{spec['max_length']}; the trainer cuts them and loses {manifest['trainer_cuts_loss_tokens']} of "
            f"{manifest['loss_tokens']} loss tokens ({lost}). "
            f"Set export.{spec['format']}.long to cut, drop or split to decide here"
        )
    dropped = manifest.get("dropped") or {}
    if dropped:
        reasons = ", ".join(f"{n} {why}" for why, n in dropped.items())
        left_out = sum(dropped.values())
        lines.append(
            f"{manifest['dataset']}: {left_out} sample{'s' * (left_out != 1)} left out ({reasons}), "
            f"{manifest['dropped_loss_tokens']} loss tokens, as the trainer's loader would leave them out"
        )
    return lines


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0%"


def summary(manifest: dict[str, Any], where: Path) -> str:
    """The build summary's line of an export."""
    return formats.get(manifest["format"]).summary(manifest, where)


def card(manifest: dict[str, Any]) -> str:
    fmt = manifest["format"]
    lines = [f"# {manifest['dataset']}", "", f"The `{fmt}` export of `{manifest['exported_from']}` (dflash-build).", ""]
    lines += [f"- files: {len(manifest['files'])} JSONL in `{DATA_DIR}/`, {manifest['rows']} rows"]
    lines += formats.get(fmt).card(manifest)
    lines += [f"- warning: {line}" for line in warnings(manifest)]
    lines += ["", f"export key `{manifest['export_key']}`, scheme {manifest['scheme']}", ""]
    return "\n".join(lines)
