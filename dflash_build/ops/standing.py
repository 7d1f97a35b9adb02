"""A dataset that stands while store shards it was built from are gone: the one story that `plan`,
`verify` and `status` tell of it, the one Snakemake acts on.

Snakemake rebuilds an output only when a trigger fires (profiles/default: mtime, input, params); a missing
input that a job could make again is no trigger while the output that read it is up to date. So with
``dist/NAME`` built and its store shards deleted (lost, or gc'd from another workdir) a build runs nothing:
the dataset stands. The shards come back only when something makes the mix run again: a change to its
inputs (a source's key, the shards it reads) or its params (shares, budget, checks), or ``--forcerun mix``.
Whether the mix would run again is read from what Snakemake recorded of its last run (the mix record's
metadata: its inputs and params), against what this config's plan gives it now.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflash_build.hashing import canonical_json
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.stages import registry as stages
from dflash_build.store import layout

# Snakemake's record of the jobs it ran (persistence: one JSON file per output, named by its path)
METADATA_DIR = Path(".snakemake") / "metadata"


@dataclass(frozen=True)
class Standing:
    """The dataset ``folder`` stands, and of the ``shards`` store shards it was built from (its token
    shards, SOURCE/SHARD) ``missing`` are gone from the store."""

    folder: Path
    shards: int
    missing: tuple[str, ...]

    def line(self, rows: tuple[int, int] | None = None) -> str:
        """What every command says of it; ``rows``: what making the missing shards again generates, and
        what it takes from earlier answers (the row index, the journals)."""
        shown = ", ".join(self.missing[:4]) + (f" and {len(self.missing) - 4} more" if len(self.missing) > 4 else "")
        cost = f": {rows[0]} rows to generate, {rows[1]} reused" if rows else " (`dflash-build plan` counts their rows)"
        return (
            f"dataset {self.folder} stands: {len(self.missing)} of the {self.shards} store shards it was built from "
            f"are missing ({shown}); a build runs nothing for them while it stands. A build that makes the "
            f"dataset again (a change to its sources or mix, or `snakemake --forcerun mix`) makes them first"
            f"{cost}"
        )


def _recorded(workdir: Path, output: Path) -> dict[str, object] | None:
    """What Snakemake recorded of the job that wrote ``output`` (None: no record it can be read from)."""
    rel = os.path.relpath(output, workdir)
    name = base64.urlsafe_b64encode(rel.encode()).decode()
    try:
        record = json.loads((workdir / METADATA_DIR / name).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def standing(plan: Plan, workdir: Path | None = None) -> Standing | None:
    """The dataset of ``plan``'s config, when it stands up to date (a build would not mix it again) and
    some store shard it was built from is missing; None otherwise (nothing missing, or a build would mix
    it again and so make every missing shard first, as ``plan`` then counts)."""
    workdir = Path.cwd() if workdir is None else workdir
    folder = plan.config.dataset_dir
    record_path = release.record_dir(folder)
    manifest_file = folder / layout.MANIFEST
    if not record_path.exists() or not manifest_file.exists():
        return None
    built_from = [
        (name, Path(shard))
        for name, entry in json.loads(manifest_file.read_text())["sources"].items()
        for shard in entry["shards"]
    ]
    missing = tuple(f"{name}/{path.stem}" for name, path in built_from if not (workdir / path).exists())
    if not missing or _mix_record_differs(plan, workdir) is not False:
        return None
    return Standing(folder, len(built_from), missing)


def mixes_again(plan: Plan, workdir: Path | None = None) -> bool:
    """Whether a build would mix the built dataset again (its inputs or params changed since the mix's last
    run): what it then publishes is another version than the one in place. False where no dataset or no
    record of its mix is here (nothing to tell it by)."""
    workdir = Path.cwd() if workdir is None else workdir
    return bool(_mix_record_differs(plan, workdir))


def _mix_record_differs(plan: Plan, workdir: Path) -> bool | None:
    """Whether what Snakemake recorded of the mix's last run differs from the job this config's plan gives
    it now; None without a record."""
    recorded = _recorded(workdir, release.record_dir(plan.config.dataset_dir))
    if recorded is None:
        return None

    def where(paths: object) -> list[str]:  # Snakemake records paths as the rule gave them
        return sorted(os.path.normpath(workdir / str(p)) for p in paths) if isinstance(paths, list) else []

    job = stages.planned(plan, "mix")
    inputs = where([p for paths in job.inputs.values() for p in paths])
    params = [repr(canonical_json(stages.get("mix").params(plan, stages.Of())))]
    return where(recorded.get("input")) != inputs or recorded.get("params") != params
