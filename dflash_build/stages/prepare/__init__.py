"""Prepare stage: raw rows of one source → deduplicated, selected, sharded prompt records.

Every row that does not become a prompt is counted by reason (``DROP_*``, :mod:`.drops`) in the prompt
manifest, with a few example locations, so nothing disappears silently. The result does not depend on
the order of the input rows or files: duplicates keep the smallest prompt id, ``max_samples`` keeps the
rows with the smallest seeded hash, and shards take contiguous runs of prompt ids.

One module per concern: :mod:`.read` (a source's rows in batches), :mod:`.formats` (one function per
input format from row to conversation) with :mod:`.columnar` (the same conversion on Arrow columns),
:mod:`.identity` (prompt ids, dedup keys, ranks), :mod:`.selection` (dedup, languages, filters,
max_samples, over :mod:`.spill`), :mod:`.write` (the shards) and :mod:`.checks` (a source that loses too
much fails loudly).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from dflash_build.stages.common import neardup
from dflash_build.stages.common.job import Job
from dflash_build.stages.prepare.checks import SourceLossError as SourceLossError
from dflash_build.stages.prepare.checks import check_losses
from dflash_build.stages.prepare.identity import shard_bounds as shard_bounds
from dflash_build.stages.prepare.selection import Selection as Selection
from dflash_build.stages.prepare.selection import scan
from dflash_build.stages.prepare.selection import select as select
from dflash_build.stages.prepare.spill import Spill, bucket_count
from dflash_build.stages.prepare.write import write_shards
from dflash_build.store import atomic, layout
from dflash_build.store import records as R

log = logging.getLogger(__name__)


def run(job: Job) -> dict[str, Any]:
    """Build every prompt shard and then the manifest of the job's source (its declared output); returns
    the manifest. Nothing is published unless the source passes :func:`check_losses`."""
    plan, source = job.plan, job.source
    assert source is not None
    sp = plan.sources[source]
    manifest_path = job.output("manifest")
    out_dir = manifest_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    # named like every temporary of the store: `gc` removes the spill of a killed prepare (stray_temporaries)
    with tempfile.TemporaryDirectory(prefix=".spill-", suffix=".tmp", dir=out_dir) as spill_dir:
        spill = Spill(Path(spill_dir), bucket_count(sp.raw_rows or sp.planned_rows))
        selection = scan(plan, source, spill)
        check_losses(sp.spec, selection)
        shard_files = write_shards(selection, spill, out_dir)
    if selection.bands is not None:
        neardup.write_bands(job.output("bands"), selection.selected, selection.bands)
    if selection.held_out_bands is not None:  # the mix leaves out near-copies of them too
        neardup.write_bands(out_dir / layout.HELD_OUT_BANDS, selection.held_out, selection.held_out_bands)
    drops = selection.drops
    manifest = {
        "stage": "prepare",
        "source": source,
        "prompt_key": sp.prompt_key,
        "components": sp.prompt_components,
        R.PROMPTS_ROWS_IN: selection.rows_in,
        R.PROMPTS_ROWS_OUT: selection.rows_out,
        R.PROMPTS_DROPS: dict(sorted(drops.counts.items())),
        R.PROMPTS_DROP_EXAMPLES: dict(sorted((r, e) for r, e in drops.examples.items() if e)),
        R.PROMPTS_SHARDS: shard_files,
    }
    if selection.references is not None:
        manifest[R.PROMPTS_REFERENCES] = selection.references
    atomic.write_json(manifest_path, manifest)
    log.info(
        "%s: %d rows in, %d prompts in %d shards, drops %s",
        source,
        selection.rows_in,
        selection.rows_out,
        sp.n_shards,
        dict(drops.counts),
    )
    return manifest
