"""How far down each source's shards to generate so the mix gets its targets (``mix.generate: as_needed``).

A source's shards hold contiguous runs of its prompt ids, and a prompt id is a digest: the first k
shards are a random sample of the source, so generating a prefix of them samples it fairly. From the
tokens per sample measured on the shards built so far, each source's whole supply is estimated; the
mix's own rule (:func:`dflash_build.stages.common.targets.category_targets`) sets each category's target from those
supplies (the scarcest category relative to its share is taken whole, or the budget sets the size). A
category that binds is generated whole; another's need (a part of its target) is split among its sources
by ``weight`` (default: in proportion to supply, each capped at its supply, the rest moved to the
others), and each source gets the shards that cover its part. A source never gets fewer shards than it
has built (they cost nothing more).

Two rounds. The first, sized on the pilot (each source's first shard), asks for :data:`FIRST_ROUND` of
each target: one shard a source mis-estimates its tokens per sample, and the binding category's supply,
which the others' targets follow from. The second, sized on every shard of the first (the binding
category's supply known exactly), asks for the target plus :data:`MARGIN`. Overshoot bound: a category
is generated to at most its target × (1 + MARGIN), plus, per source, the part of one shard its need did
not fill, plus what the first round's shards overshot when the pilot underestimated a source by more than
1 / FIRST_ROUND (bench/generate_to_mix.py measures both on the production config's shape). A category
chosen by acceptance (mix.by_acceptance) may ask for ``oversample`` times its target in both rounds, so the
mix has rows to choose from.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build.plan import Plan
from dflash_build.spec import Config
from dflash_build.stages.common.job import Job
from dflash_build.stages.common.targets import binds, category_targets
from dflash_build.store import atomic, layout
from dflash_build.store import records as R

log = logging.getLogger(__name__)

# The first round (sized on one pilot shard a source) asks for this share of a category's target, so a
# pilot that underestimates a source's tokens per sample does not overshoot; the top-up, sized on every
# shard of the first round, asks for the target plus MARGIN. A category that binds (taken whole) is
# generated whole in the first round: the others' targets follow from its supply, known exactly then.
FIRST_ROUND = 0.6
MARGIN = 0.03


@dataclass(frozen=True)
class Supply:
    """One source as the sizing sees it."""

    source: str
    category: str
    shards: int  # the source's shards in all
    built: int  # shards measured so far (a prefix)
    samples_per_shard: float  # samples a shard gives (measured on the built shards, else planned)
    tokens_per_sample: float  # prompt and answer tokens, measured on the built shards
    weight: float | None = None  # sources.NAME.weight; None: in proportion to supply

    @property
    def tokens_per_shard(self) -> float:
        return self.samples_per_shard * self.tokens_per_sample

    @property
    def tokens(self) -> float:
        return self.shards * self.tokens_per_shard


def _split(need: float, members: list[Supply]) -> dict[str, float]:
    """``need`` tokens among ``members`` by weight (default: their supply), none over its supply."""
    parts: dict[str, float] = {}
    left = list(members)
    while left and need > 1e-9:
        weights = {s.source: (s.weight if s.weight is not None else s.tokens) for s in left}
        total = sum(weights.values())
        if total <= 0:
            break
        full = [s for s in left if need * weights[s.source] / total >= s.tokens - parts.get(s.source, 0.0)]
        if not full:
            for s in left:
                parts[s.source] = parts.get(s.source, 0.0) + need * weights[s.source] / total
            return parts
        for s in full:  # taken whole; what they cannot give goes to the others
            need -= s.tokens - parts.get(s.source, 0.0)
            parts[s.source] = s.tokens
            left.remove(s)
    return parts


def shards_needed(
    shares: Mapping[str, float],
    budget: int | None,
    supplies: list[Supply],
    part: float = 1 + MARGIN,
    oversample: Mapping[str, float] | None = None,
) -> tuple[dict[str, int], dict[str, float]]:
    """(shards per source, target tokens per category) for these supplies: ``part`` of each category's
    target (times its ``oversample`` factor, mix.by_acceptance), a binding category whole."""
    available = {c: 0.0 for c in shares}
    for s in supplies:
        available[s.category] = available.get(s.category, 0.0) + s.tokens
    targets = category_targets(dict(shares), {c: int(v) for c, v in available.items()}, budget)
    shards = {}
    for category in shares:
        members = [s for s in supplies if s.category == category]
        whole = binds(targets[category], available[category])
        factor = (oversample or {}).get(category, 1.0)
        need = available[category] if whole else min(targets[category] * part * factor, available[category])
        parts = _split(need, members)
        for s in members:
            # a source whose measured shards gave no sample gets nothing more: more of it would give none either
            wanted = math.ceil(parts.get(s.source, 0.0) / s.tokens_per_shard - 1e-9) if s.tokens_per_shard else 0
            shards[s.source] = min(s.shards, max(s.built, wanted))
    return shards, targets


def measured(plan: Plan, shards: Mapping[str, list[Path]], named: Mapping[str, int] | None = None) -> list[Supply]:
    """Each source's supply, measured on its token shards ``shards`` (their stats sidecars); ``named``: how
    many shards the round names per source, where that is more than those measured (``replay``)."""
    supplies = []
    for name, sp in plan.sources.items():
        samples = tokens = 0
        for path in shards.get(name, []):
            stats = json.loads(layout.sidecar(path).read_text())
            samples += stats[R.STAT_ROWS_OUT]
            tokens += stats[R.STAT_TOKENS]
        built = len(shards.get(name, []))
        supplies.append(
            Supply(
                name,
                sp.spec.category,
                sp.n_shards,
                (named or {}).get(name, built),
                samples / built if built else 0.0,
                tokens / samples if samples else 0.0,
                sp.spec.weight,
            )
        )
    return supplies


def sized_counts(plan: Plan, sizing: str | Path | None) -> dict[str, int]:
    """How many of each source's first shards a sizing file names (none yet: the pilot's, one each)."""
    if sizing is None:
        return dict.fromkeys(plan.sources, 1)
    return dict(json.loads(Path(sizing).read_text())["shards"])


def sized_shards(plan: Plan, sizing: str | Path | None) -> list[str]:
    """The token shards a sizing file names, by source name (:func:`sized_counts`)."""
    counts = sized_counts(plan, sizing)
    return [str(p) for name in sorted(plan.sources) for p in plan.token_shards(name)[: counts[name]]]


def params(cfg: Config) -> dict[str, Any]:
    """What the sizing depends on besides the shards it measures: the size rules' params (a change sizes the
    rounds again, the params trigger), and recorded in each sizing so that a stale one is known as such."""
    return {
        "categories": dict(cfg.mix_categories),
        "budget_tokens": cfg.mix_budget_tokens,
        "weights": {s: spec.weight for s, spec in cfg.sources.items()},
        "rounds": [FIRST_ROUND, MARGIN],
        # only where set: a config without it keeps the sizing it had
        **({"oversample": over} if (over := oversample(cfg)) else {}),
    }


def oversample(cfg: Config) -> dict[str, float]:
    """Each category's oversampling factor (mix.by_acceptance.CATEGORY.oversample), where it is not 1."""
    return {c: rule.oversample for c, rule in cfg.mix_by_acceptance.items() if rule.oversample != 1}


def sizing(plan: Plan, supplies: list[Supply], round_: int) -> dict[str, Any]:
    """Round ``round_``'s sizing record: the shards per source it names for these supplies."""
    cfg = plan.config
    part = FIRST_ROUND if round_ == layout.SIZING_ROUNDS[0] else 1 + MARGIN
    shards, targets = shards_needed(cfg.mix_categories, cfg.mix_budget_tokens, supplies, part, oversample(cfg))
    return {
        "stage": "size",
        "round": round_,
        "part_of_target": part,
        "params": params(cfg),
        "shards": dict(sorted(shards.items())),
        "targets": {c: round(t) for c, t in targets.items()},
        "measured": {
            s.source: {
                "shards": s.built,
                "of": s.shards,
                "samples_per_shard": round(s.samples_per_shard, 3),
                "tokens_per_sample": round(s.tokens_per_sample, 3),
                "expected_tokens": round(s.tokens),
            }
            for s in supplies
        },
    }


def run(job: Job) -> dict[str, Any]:
    """Size the next round from the token shards the job declares (the pilot's, or the first round's)."""
    record = sizing(job.plan, measured(job.plan, job.by_source("tokens")), layout.sizing_round(job.output("sizing")))
    atomic.write_json(job.output("sizing"), record)
    log.info("round %d: shards per source %s for targets %s", record["round"], record["shards"], record["targets"])
    return record


@dataclass(frozen=True)
class Replayed:
    """What a build's size jobs will name, replayed from the store: each round's shards per source, and
    the rounds measured on fewer shards than they name (those not built yet; estimated from the rest)."""

    rounds: list[dict[str, int]]
    estimated: list[int]

    @property
    def shards(self) -> dict[str, int]:
        return self.rounds[-1]


def replay(plan: Plan) -> Replayed | None:
    """The rounds of sizing a build of this config will run (the size jobs' own function on what they will
    measure: the pilot's shards, then the shards the first round names), as the store stands; a round's
    shards not built yet are estimated from those that are. None while a source's pilot is not built."""
    named = dict.fromkeys(plan.sources, 1)  # the pilot: each source's first shard
    rounds: list[dict[str, int]] = []
    estimated: list[int] = []
    for round_ in layout.SIZING_ROUNDS:
        paths = {name: plan.token_shards(name)[: named[name]] for name in plan.sources}
        built = {name: [p for p in found if layout.sidecar(p).exists()] for name, found in paths.items()}
        if not all(built.values()):
            return None if not rounds else Replayed(rounds, estimated)
        if any(len(built[name]) < len(paths[name]) for name in plan.sources):
            estimated.append(round_)
        named = sizing(plan, measured(plan, built, {n: len(p) for n, p in paths.items()}), round_)["shards"]
        rounds.append(dict(named))
    return Replayed(rounds, estimated)
