"""Prompts that several sources hold: each is taken once, and generated once where it can be (config
``dedup.across_sources``).

A prompt id several sources hold stays with the source that comes first in ``dedup.prefer``, then by
name; with ``dedup.near``, a prompt whose near-copy (:mod:`dflash_build.stages.common.neardup`) another
source's prompt that comes first (by that source order, then prompt id) holds goes too. The rule depends
on neither the config's nor the shards' order, and a source's copies depend only on the sources before
it. For the sources ``dedup.prefer`` lists it is settled before any GPU time: a source's generate job
skips the prompts of the listed sources before it (:func:`skipped_copies`: each a ``skipped`` row whose
error names the source that keeps it), and their prompt keys are part of its gen key
(``plan.ranked_above``). Sources the list does not name settle nothing between them, so adding one
re-keys no other source; the mix applies the whole rule to what it takes, and its manifest counts every
copy. Copies are settled within a sampling variant (config ``variants``): a prompt two sources hold under
one variant is generated once, and one prompt under two variants is two samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing
from dflash_build.plan import Plan
from dflash_build.stages.common import neardup
from dflash_build.stages.common.job import Job
from dflash_build.store import layout
from dflash_build.store import records as R

CROSS_DUPLICATE = R.CROSS_SOURCE_DUPLICATE
CROSS_NEAR_DUPLICATE = R.CROSS_SOURCE_NEAR_DUPLICATE
EXAMPLES = 5


@dataclass
class CrossSource:
    """What the mix leaves out, by source: prompt ids (uint64) and, for each reason, how many."""

    dropped: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # resolve(explain=): each copy's reason, by prompt id

    def report(self) -> dict[str, Any]:
        return {s: {**self.counts[s], "examples": self.examples.get(s, [])} for s in sorted(self.counts)}


def resolve(
    priority: list[str],
    prompts: dict[str, np.ndarray],
    bands: dict[str, np.ndarray] | None,
    explain: str | None = None,
) -> CrossSource:
    """``prompts``: each source's prompt ids (uint64); ``priority``: the sources, first keeps.
    ``bands``: each source's band keys, row for row with its prompt ids (with dedup.near).
    ``explain``: the source whose every copy gets its reason in ``reasons`` (not only examples)."""
    out = CrossSource()
    rank = {name: i for i, name in enumerate(priority)}
    names = sorted(prompts, key=rank.__getitem__)
    pids = np.concatenate([np.zeros(0, np.uint64), *(prompts[n] for n in names)])
    source = np.concatenate(
        [np.zeros(0, np.int32), *(np.full(len(prompts[n]), i, np.int32) for i, n in enumerate(names))]
    )
    # by (source order, prompt id): a row's position in that order says which copy comes first
    order = np.lexsort((pids, source))
    position = np.empty(len(pids), dtype=np.uint64)
    position[order] = np.arange(len(pids), dtype=np.uint64)
    exact = np.zeros(len(pids), dtype=bool)
    by_pid = np.lexsort((position, pids))
    repeat = np.zeros(len(pids), dtype=bool)
    repeat[1:] = pids[by_pid][1:] == pids[by_pid][:-1]
    exact[by_pid[repeat]] = True
    first_of = _first_of_runs(by_pid, repeat)
    near = np.zeros(len(pids), dtype=bool)
    matched = np.full(len(pids), neardup.NO_MATCH, dtype=np.uint64)
    if bands is not None and len(pids):
        keys = np.concatenate([bands[n] for n in names])
        rest = np.flatnonzero(~exact)
        found = neardup.first_copies(position[rest], keys[rest])
        near[rest] = found != neardup.NO_MATCH
        matched[rest] = found

    def reason(j: int) -> str:
        if exact[j]:
            return f"{CROSS_DUPLICATE}: prompt {int(pids[j]):016x} is {names[source[first_of[j]]]}'s too"
        k = order[int(matched[j])]
        return (
            f"{CROSS_NEAR_DUPLICATE}: prompt {int(pids[j]):016x} is a near-copy of {names[source[k]]}'s "
            f"prompt {int(pids[k]):016x}"
        )

    for i, name in enumerate(names):
        mine = source == i
        out.dropped[name] = pids[mine & (exact | near)]
        out.counts[name] = {CROSS_DUPLICATE: int((mine & exact).sum()), CROSS_NEAR_DUPLICATE: int((mine & near).sum())}
        picked = [*np.flatnonzero(mine & exact)[:EXAMPLES], *np.flatnonzero(mine & near)[:EXAMPLES]]
        out.examples[name] = [reason(int(j)) for j in picked]
        if name == explain:
            out.reasons = {f"{int(pids[j]):016x}": reason(int(j)) for j in np.flatnonzero(mine & (exact | near))}
    return out


def _first_of_runs(by_pid: np.ndarray, repeat: np.ndarray) -> np.ndarray:
    """For each row, the first row (in ``by_pid`` order) of its run of equal prompt ids."""
    starts = np.flatnonzero(~repeat)
    run = np.cumsum(~repeat) - 1
    first = np.empty(len(by_pid), dtype=np.int64)
    first[by_pid] = by_pid[starts[run]]
    return first


def load(plan: Plan) -> CrossSource | None:
    """The cross-source decision for a plan's sources, from their prompt shards' ids and (with
    dedup.near) their band sidecars; None when dedup.across_sources is off."""
    dedup = plan.config.dedup
    if not dedup.across_sources:
        return None
    prompts: dict[str, np.ndarray] = {}
    bands: dict[str, np.ndarray] | None = {} if dedup.near is not None else None
    for name in plan.sources:
        if bands is not None:
            prompts[name], bands[name] = neardup.read_bands(plan.prompt_bands(name))
        else:
            prompts[name] = prompt_ids(plan, name)
    return resolve_within_variants(plan, prompts, bands)


def resolve_within_variants(
    plan: Plan, prompts: dict[str, np.ndarray], bands: dict[str, np.ndarray] | None
) -> CrossSource:
    """:func:`resolve` over ``prompts``' sources, each sampling variant apart (sources without variants
    are one group): one prompt under two variants is two samples by design."""
    out = CrossSource()
    variant_of = {n: plan.sources[n].spec.variant or "" for n in prompts}
    for variant in sorted(set(variant_of.values())):
        group = [n for n in prompts if variant_of[n] == variant]
        part = resolve(
            plan.config.dedup.source_priority(group),
            {n: prompts[n] for n in group},
            None if bands is None else {n: bands[n] for n in group},
        )
        out.dropped.update(part.dropped)
        out.counts.update(part.counts)
        out.examples.update(part.examples)
    return out


def prompt_ids(plan: Plan, source: str) -> np.ndarray:
    """A prepared source's prompt ids (uint64), from its prompt shards."""
    return _ids_of(plan.prompt_shards(source))


def skipped_copies(job: Job, shard_ids: list[str]) -> dict[str, str]:
    """The prompts of a generate job's shard that a source ranked above its own keeps: prompt id → the
    reason its row is skipped with. Read from what the job declares (``copies_of``: those sources'
    manifests, beside which their prompt shards lie, and with dedup.near their band keys and its own)."""
    plan, name = job.plan, job.source
    assert name is not None
    above = plan.sources[name].above
    if not above or not shard_ids:
        return {}
    declared = job.by_source("copies_of")
    prompts: dict[str, np.ndarray] = {}
    bands: dict[str, np.ndarray] | None = None
    if plan.config.dedup.near is not None:  # near-copies: every row of each, its own source's too
        bands = {}
        for source in [*above, name]:
            band_file = next(p for p in declared[source] if p.name == layout.BANDS)
            prompts[source], bands[source] = neardup.read_bands(band_file)
    else:  # exact copies: a source's own rows are never copies of each other (prepare keeps one)
        for source in above:
            manifest = next(p for p in declared[source] if p.name == layout.MANIFEST)
            shards = [layout.shard_file(manifest.parent, s) for s in plan.sources[source].shards]
            prompts[source] = _ids_of(shards)
        prompts[name] = hashing.hex_to_u64(pa.array(sorted(shard_ids)))
    cross = against_ranked(plan, name, prompts, bands, explain=True)
    return {pid: cross.reasons[pid] for pid in shard_ids if pid in cross.reasons}


def against_ranked(
    plan: Plan,
    name: str,
    prompts: dict[str, np.ndarray],
    bands: dict[str, np.ndarray] | None,
    explain: bool = False,
) -> CrossSource:
    """The rule for one source against the sources listed before it (``plan.ranked_above``): its
    ``dropped`` are the prompts its generate jobs skip. ``prompts`` and ``bands`` may hold more sources;
    a ranked source missing from them (not known yet) is left out. ``explain``: each copy's reason."""
    group = [n for n in (*plan.sources[name].above, name) if n in prompts]
    return resolve(
        plan.config.dedup.source_priority(group),
        {n: prompts[n] for n in group},
        None if bands is None else {n: bands[n] for n in group},
        explain=name if explain else None,
    )


def _ids_of(shards: list[Path]) -> np.ndarray:
    ids = [hashing.hex_to_u64(pq.read_table(p, columns=["prompt_id"]).column("prompt_id")) for p in shards]
    return np.concatenate(ids) if ids else np.zeros(0, np.uint64)
