"""Prompts that several sources hold: the mix takes each once (config ``dedup.across_sources``).

Each source keeps its own prompts, keys and shards: adding or removing a source changes no other
source's key, so nothing of the others regenerates, and the generation of a prompt a second source
holds is served from the row index when the sampling agrees (the same reuse key). Only the mix
decides, by a rule that depends on neither the config's nor the shards' order: a prompt id several
sources hold stays with the source that comes first in ``dedup.prefer``, then by name; with
``dedup.near``, a prompt whose near-copy (:mod:`dflash_build.stages.neardup`) another source's prompt that
comes first (by that source order, then prompt id) holds goes too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dflash_build import hashing
from dflash_build.plan import Plan
from dflash_build.stages import neardup

CROSS_DUPLICATE = "cross_source_duplicate"
CROSS_NEAR_DUPLICATE = "cross_source_near_duplicate"
EXAMPLES = 5


@dataclass
class CrossSource:
    """What the mix leaves out, by source: prompt ids (uint64) and, for each reason, how many."""

    dropped: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return {s: {**self.counts[s], "examples": self.examples.get(s, [])} for s in sorted(self.counts)}


def resolve(priority: list[str], prompts: dict[str, np.ndarray], bands: dict[str, np.ndarray] | None) -> CrossSource:
    """``prompts``: each source's prompt ids (uint64); ``priority``: the sources, first keeps.
    ``bands``: each source's band keys, row for row with its prompt ids (with dedup.near)."""
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
    for i, name in enumerate(names):
        mine = source == i
        out.dropped[name] = pids[mine & (exact | near)]
        out.counts[name] = {CROSS_DUPLICATE: int((mine & exact).sum()), CROSS_NEAR_DUPLICATE: int((mine & near).sum())}
        examples = []
        for j in np.flatnonzero(mine & exact)[:EXAMPLES]:
            keeper = names[source[first_of[j]]]
            examples.append(f"{CROSS_DUPLICATE}: prompt {int(pids[j]):016x} is {keeper}'s too")
        for j in np.flatnonzero(mine & near)[:EXAMPLES]:
            k = order[int(matched[j])]
            examples.append(
                f"{CROSS_NEAR_DUPLICATE}: prompt {int(pids[j]):016x} is a near-copy of {names[source[k]]}'s "
                f"prompt {int(pids[k]):016x}"
            )
        out.examples[name] = examples
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
    return resolve(dedup.source_priority(plan.sources), prompts, bands)


def prompt_ids(plan: Plan, source: str) -> np.ndarray:
    """A prepared source's prompt ids (uint64), from its prompt shards."""
    ids = [
        hashing.hex_to_u64(pq.read_table(p, columns=["prompt_id"]).column("prompt_id"))
        for p in plan.prompt_shards(source)
    ]
    return np.concatenate(ids) if ids else np.zeros(0, np.uint64)
