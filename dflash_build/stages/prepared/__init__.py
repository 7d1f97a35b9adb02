"""The gate between preparing and generating: every source of the config is prepared.

Every generate job waits for this job (its record is an order-only input of theirs,
:func:`dflash_build.snakemake_fixes.order_only`), and it waits for every source's prepare. A source whose
prepare fails (a defect its first rows did not show: the Snakefile checks those at parse time) then stops
the build before any generate job takes a GPU, while Snakemake's keep-going still lets every other failure
(one bad shard of a day-long build) leave the rest running. What the waiting costs: until the slowest
prepare of the build ends, no GPU starts (docs/operations.md "A defect stops the build before GPU time"
estimates it); a build in which no prepare runs does not run this job and waits for nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_build.stages.common.job import Job
from dflash_build.store import atomic

log = logging.getLogger(__name__)


def run(job: Job) -> dict[str, Any]:
    """Record each source's prompt key (its manifest is there: Snakemake ran every prepare first)."""
    plan = job.plan
    record = {"stage": "prepared", "sources": {name: source.prompt_key for name, source in plan.sources.items()}}
    atomic.write_json(job.output("record"), record)
    log.info("%d sources prepared: generation may start", len(record["sources"]))
    return record
