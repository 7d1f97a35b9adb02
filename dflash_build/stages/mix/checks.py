"""The mix's checks, before anything is written: a share missed by more than ``checks.share_tolerance``,
a source with no samples, a language floor missed; and the plain statements of every smaller miss."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_build.plan import Plan
from dflash_build.spec import DEGENERATE_REASONS
from dflash_build.stages.common import crosssource
from dflash_build.stages.common.job import StageFailure
from dflash_build.stages.prepare.drops import DROP_OTHER_VARIANT
from dflash_build.store import layout
from dflash_build.store import records as R

NOTED_DEVIATION = 0.01  # a share further than this from its target is stated in the manifest (not a check)


class MixError(StageFailure):
    """The dataset would miss what the config asks for; the message names the cause and the key to change."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("the mix misses the configured dataset:\n" + "\n".join(f"  - {p}" for p in problems))
        self.problems = problems


def missed_floors(plan: Plan, reached: dict[str, dict[str, dict[str, Any]]], targets: dict[str, float]) -> list[str]:
    """Each language floor of ``mix.languages`` missed by more than the tolerance, with what to change."""
    checks = plan.config.checks
    problems = []
    for category, by_language in reached.items():
        for lang, got in by_language.items():
            short = got["floor"] - got["achieved_share"]
            # a floor with nothing of its language fails whatever the tolerance: no mix can meet it
            within = short <= checks.share_tolerance and got["available_tokens"] > 0
            if short <= 0 or within or category in checks.allow_shortfall:
                continue
            needed = round(got["floor"] * targets[category])
            problems.append(
                f"category '{category}': language '{lang}' reaches {got['achieved_share']:.1%} of its tokens, floor "
                f"{got['floor']:.1%} (tolerance {checks.share_tolerance:.1%}): its '{lang}' samples hold "
                f"{got['available_tokens']} tokens, about {needed} are needed; add '{lang}' prompts to "
                f"'{category}', lower mix.languages.{category}.{lang}, or allow it with "
                f"checks.allow_shortfall: [{category}]"
            )
    return problems


def floor_shortfalls(reached: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Every language floor the dataset misses (within the tolerance, or allowed): stated, never silent."""
    return [
        f"category '{category}': language '{lang}' reaches {got['achieved_share']:.1%} of its tokens, floor "
        f"{got['floor']:.1%} ({got['tokens']} tokens of it, {got['available_tokens']} available)"
        for category, by_language in reached.items()
        for lang, got in by_language.items()
        if got["floor"] - got["achieved_share"] > 0
    ]


def check(
    plan: Plan,
    shards: Mapping[str, list[Path]],
    shares: dict[str, float],
    targets: dict[str, float],
    chosen: Counter[str],
    available: Counter[str],
    available_by_source: Counter[str],
    cross: crosssource.CrossSource | None = None,
    missed: list[str] | None = None,
) -> None:
    """Fail before writing when the dataset is empty, a source yields nothing, a share is missed, or
    ``missed`` (the language floors' problems) is not empty.

    A category listed in ``checks.allow_shortfall`` may fall short (its sources may be empty too);
    the shortfall is still stated in the manifest.
    """
    checks = plan.config.checks
    problems: list[str] = []
    for name, sp in plan.sources.items():
        taken_by_others = cross.counts.get(name, {}) if cross is not None else {}
        if available_by_source[name] == 0 and drawn_empty(plan, name):
            continue  # its draw gave this variant no prompt: a selection, stated on the card's variants table
        if (
            available_by_source[name] == 0
            and sp.spec.category not in checks.allow_shortfall
            and any(taken_by_others.values())
        ):
            steps = ", ".join(f"{reason} {n}" for reason, n in taken_by_others.items() if n)
            problems.append(
                f"source '{name}' reaches the mix with no samples: other sources hold all of its prompts "
                f"({steps}; dedup.across_sources gives each prompt to the first of dedup.prefer, then by "
                f"name); list '{name}' first in dedup.prefer, remove the source, or set "
                "dedup.across_sources: false"
            )
        elif available_by_source[name] == 0 and sp.spec.category not in checks.allow_shortfall:
            drops, why = _token_drops(shards.get(name, []))
            advice = _empty_source_advice(plan, drops)
            problems.append(
                f"source '{name}' reaches the mix with no samples ({why}); {advice}; or allow it with "
                f"checks.allow_shortfall: [{sp.spec.category}]"
            )
    if sum(chosen.values()) == 0:
        problems.insert(0, "the dataset would be empty: no token shard has a usable sample")
    problems += missed_shares(plan, shares, targets, chosen, available)
    problems += missed or []
    if problems:
        raise MixError(problems)


def missed_shares(
    plan: Plan, shares: dict[str, float], targets: dict[str, float], chosen: Counter[str], available: Counter[str]
) -> list[str]:
    """Each category share the chosen tokens miss by more than ``checks.share_tolerance`` (and not allowed),
    with what to change: the check the mix runs, and the one `plan` forecasts."""
    checks = plan.config.checks
    total = sum(chosen.values())
    if total == 0:
        return []
    return [
        _missed_share(category, share, chosen, available, targets, checks.share_tolerance)
        for category, share in shares.items()
        if share - chosen[category] / total > checks.share_tolerance and category not in checks.allow_shortfall
    ]


def _empty_source_advice(plan: Plan, drops: Counter[str]) -> str:
    """What to change for a source whose rows all failed to become samples, by why tokenize dropped them."""
    degenerate = [r for r in DEGENERATE_REASONS if drops.get(r)]
    if drops.get(R.STAT_OUTSIDE_WINDOW):
        window = plan.config.trainer.max_length
        return f"its prompts leave too little of trainer.max_length {window}: raise it or drop the source"
    if degenerate:
        return (
            f"its answers are degenerate ({', '.join(degenerate)}): see docs/configuration.md#degenerate-answers; "
            f"degenerate.{degenerate[0]}.policy: keep keeps them, regenerate asks again"
        )
    return (
        f"see its generate and tokenize logs under {plan.config.logs}/; `truncated: keep` keeps answers that hit "
        "max_new_tokens"
    )


def drawn_empty(plan: Plan, name: str) -> bool:
    """Whether source ``name`` is a sampling variant its draw gave no prompt (its siblings hold them all)."""
    manifest_file = plan.prompt_manifest(name)
    if plan.sources[name].spec.variant is None or not manifest_file.exists():
        return False
    manifest = json.loads(manifest_file.read_text())
    return manifest[R.PROMPTS_ROWS_OUT] == 0 and bool(manifest[R.PROMPTS_DROPS].get(DROP_OTHER_VARIANT))


def _missed_share(
    category: str,
    share: float,
    chosen: Counter[str],
    available: Counter[str],
    targets: dict[str, float],
    tolerance: float,
) -> str:
    """Why ``category`` ends below its share, in terms that agree with each other, and by how much."""
    total = sum(chosen.values())
    achieved = chosen[category] / total
    head = f"category '{category}' reaches {achieved:.1%} of tokens, target {share:.1%} (tolerance {tolerance:.1%})"
    tolerance_needed = math.ceil((share - achieved) * 1000) / 1000
    allow = f"or allow it with checks.share_tolerance: {tolerance_needed:g} or checks.allow_shortfall: [{category}]"
    if chosen[category] >= available[category]:
        # every sample is used: the others overshoot their targets by part of a sample each, which only
        # more samples of this category can balance
        others = total - chosen[category]
        floor = share - tolerance
        needed = math.ceil(floor / (1 - floor) * others) - available[category]
        return (
            f"{head}: all {available[category]} of its tokens are used and the other categories' samples "
            f"overshoot their targets; the dataset is too small for this mix: it needs {needed} more tokens "
            f"of '{category}' for the share at this size; add sources to it, lower mix.budget_tokens, {allow}"
        )
    return (
        f"{head}: {chosen[category]} of its {available[category]} tokens are taken for a target of "
        f"{round(targets[category])}, since its next samples would overshoot by more than they close; "
        f"add shorter samples to it, {allow}"
    )


def _token_drops(shards: list[Path]) -> tuple[Counter[str], str]:
    """Why a source's rows did not become samples, summed over its token shards' stats sidecars."""
    dropped: Counter[str] = Counter()
    rows = 0
    for path in shards:
        stats_file = layout.sidecar(path)
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            rows += stats.get(R.STAT_INPUT_ROWS, 0)
            dropped.update(stats.get(R.STAT_DROPPED, {}))
    reasons = ", ".join(f"{k}: {v}" for k, v in dropped.most_common()) or "none"
    return dropped, f"{rows} completions, tokenize dropped {reasons}"


def shortfalls(
    shares: dict[str, float], targets: dict[str, float], got: Counter[str], available: Counter[str], budget: int | None
) -> list[str]:
    """Plain statements of every way the dataset falls below its configured mix."""
    return deviations(shares, targets, got, available, budget)[0]


def deviations(
    shares: dict[str, float], targets: dict[str, float], got: Counter[str], available: Counter[str], budget: int | None
) -> tuple[list[str], list[str]]:
    """Plain statements of every way the dataset misses its configured mix: (below it, above it)."""
    below: list[str] = []
    above: list[str] = []
    total = sum(got.values())
    for category, share in shares.items():
        achieved = got[category] / total if total else 0.0
        if available[category] == 0:
            below.append(f"category '{category}' has no samples: its target share {share:.1%} is not met")
        elif budget is not None and available[category] < targets[category]:
            below.append(
                f"category '{category}' falls short: {available[category]} tokens available, "
                f"{round(targets[category])} targeted; all of them are used"
            )
        elif abs(achieved - share) > NOTED_DEVIATION:
            target = round(targets[category])
            if achieved < share and got[category] >= available[category]:
                why = "every one of its samples is used; others overshoot their targets by part of a sample"
            elif (achieved > share) == (got[category] <= target):
                # its own target is met; the total it is a share of is not the planned one
                why = f"it meets its target of {target} tokens; the other categories' misses move its share"
            else:
                why = f"its samples are too long to hit a target of {target} tokens closely (it has {got[category]})"
            (above if achieved > share else below).append(
                f"category '{category}' reaches {achieved:.1%} instead of {share:.1%}: {why}"
            )
    return below, above
