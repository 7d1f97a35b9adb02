"""The next round, named with its cost: for each slice accept names weakest, the prompts of that slice the
dataset does not hold (prepared in the store and left out, or past a source's ``max_samples``), the config
change that would take them, and what `dflash-build plan` says generating them costs under that change.

A category slice (and a source slice, through its category) is a set of prompts a config edit can take:
the change raises the category's weight in ``mix.categories`` until the mix takes the category whole (it
binds), and lifts ``max_samples`` of each of the slice's sources that cut prompts. The cost is the plan's
own estimate of the edited config (:func:`dflash_build.config.edited`, then
:func:`~dflash_build.ops.estimate.estimate_with_disk`), summed over the sources of the category the change
grows (a source slice's change grows its whole category), so applying the change makes `plan` print the
same rows, answer tokens and GPU-hours for those sources. Prompts already generated and left
out by the mix cost nothing; rows tokenize dropped as degenerate are counted apart (no change takes
them). A language, variant, turn or context slice is no set of prompts one edit takes: it is listed
without a change. What the table assumes (that τ rises where the data grows) is not measured, and the
report says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod
from dflash_build import workflow
from dflash_build.ops import estimate, forecast
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import ConfigError
from dflash_build.store import records as R

TAKEN_BY_AN_EDIT = ("category", "source")
OVER_MAX_SAMPLES = "over_max_samples"  # prepare's drop reason (stages.prepare.drops)


@dataclass
class NextRound:
    """One weak slice: its sources' unused prompts, the change that takes them, and what it costs."""

    slice: str
    column: str
    value: str
    sources: list[str] = field(default_factory=list)
    left_out: dict[str, int | None] = field(default_factory=dict)  # prepared, not in the dataset (None: unknown)
    over_max_samples: dict[str, int] = field(default_factory=dict)  # cut by max_samples
    degenerate: dict[str, int] = field(default_factory=dict)  # rows tokenize dropped (config degenerate): never taken
    change: dict[str, Any] = field(default_factory=dict)  # config key -> value
    was: dict[str, Any] = field(default_factory=dict)  # config key -> its value now
    rows: int = 0  # rows to generate under the change, as `plan` counts them
    answer_tokens: float = 0.0
    gpu_hours: float = 0.0
    note: str = ""


def used_prompts(dataset: Path) -> dict[str, int]:
    """Prompts per source the dataset in place holds (distinct prompt ids)."""
    if release.current(dataset) is None and not dataset.is_dir():
        return {}
    files = release.in_place(dataset).files
    if not files:
        return {}
    table = pa.concat_tables([pq.read_table(f, columns=["source", "prompt_id"]) for f in files])
    counted = table.group_by("source").aggregate([("prompt_id", "count_distinct")])
    return dict(zip(counted["source"].to_pylist(), counted["prompt_id_count_distinct"].to_pylist(), strict=True))


def next_round(plan: Plan, weak: list[tuple[str, str]], dataset: Path) -> list[NextRound]:
    """The next round for each weak slice ``(column, value)`` (each once, in order)."""
    used = used_prompts(dataset)
    dropped = forecast.degenerate_drops(plan)
    estimated: Estimated = {}
    out = []
    for column, value in dict.fromkeys(weak):
        entry = NextRound(f"{column}={value}", column, value)
        out.append(entry)
        category = _category(plan, column, value)
        if category is None:
            entry.note = (
                f"not a {column} of the dataset (an eval benchmark's)"
                if column in TAKEN_BY_AN_EDIT
                else f"a {column} slice is no set of prompts one config edit takes: see its sources' categories"
            )
            continue
        entry.sources = [value] if column == "source" else _members(plan, category)
        for name in entry.sources:
            manifest = _manifest(plan, name)
            rows = manifest.get(R.PROMPTS_ROWS_OUT) if manifest else None
            entry.left_out[name] = None if rows is None else max(rows - used.get(name, 0), 0)
            if over := (manifest or {}).get(R.PROMPTS_DROPS, {}).get(OVER_MAX_SAMPLES, 0):
                entry.over_max_samples[name] = over
            if degenerate := sum(dropped[name][1].values()):
                entry.degenerate[name] = degenerate
        _cost(plan, entry, category, estimated)
    return out


Estimated = dict[tuple[tuple[str, Any], ...], tuple[Plan, list[estimate.SourceEstimate], forecast.MixForecast]]


def _estimate(
    plan: Plan, edits: dict[str, Any], estimated: Estimated
) -> tuple[Plan, list[estimate.SourceEstimate], forecast.MixForecast]:
    """The plan of ``plan``'s config with ``edits`` and `plan`'s estimate of it, each distinct edit once (a
    category slice and its sources' slices often ask for the same change)."""
    key = tuple(sorted(edits.items()))
    if key not in estimated:
        changed = plan_mod.build(config_mod.edited(plan.config, edits)) if edits else plan
        estimates, _, mix = estimate.estimate_with_disk(changed)
        estimated[key] = (changed, estimates, mix)
    return estimated[key]


def _category(plan: Plan, column: str, value: str) -> str | None:
    if column == "category" and value in plan.config.mix_categories:
        return value
    if column == "source" and value in plan.sources:
        return plan.sources[value].spec.category
    return None


def _members(plan: Plan, category: str) -> list[str]:
    return [n for n, sp in plan.sources.items() if sp.spec.category == category]


def _manifest(plan: Plan, source: str) -> dict[str, Any] | None:
    path = plan.prompt_manifest(source)
    return json.loads(path.read_text()) if path.exists() else None


def _cost(plan: Plan, entry: NextRound, category: str, estimated: Estimated) -> None:
    """The change that takes the slice's category whole (and its sources' prompts past max_samples), and
    the plan's estimate of the edited config for the sources of the category it grows."""
    cfg = plan.config
    edits: dict[str, Any] = {}
    for name in entry.over_max_samples:
        spec_name = plan.sources[name].spec.parent or name  # a variant's max_samples is its parent's
        edits[f"sources.{spec_name}.max_samples"] = None
    try:
        _, _, widened = _estimate(plan, edits, estimated)
        weights = {str(c): float(w) for c, w in cfg.raw["mix"]["categories"].items()}  # as written: weights
        supply = {c.category: c.expected_tokens for c in widened.categories}
        weight = _whole(weights, cfg.mix_budget_tokens, supply, category)
        if weight is None:
            entry.note = f"mix.budget_tokens {cfg.mix_budget_tokens} is below {category}'s supply: raise it first"
            return
        if weight > weights[category]:
            edits[f"mix.categories.{category}"] = weight
        changed, estimates, after = _estimate(plan, edits, estimated)
    except ConfigError as e:
        entry.note = f"the change does not load: {e}"
        return
    entry.change = edits
    entry.was = {key: config_mod.value_at(cfg.raw, key) for key in edits}
    if not next(c for c in after.categories if c.category == category).binds:
        entry.note = f"the forecast under the change still leaves part of {category} out"
    grown = set(_members(changed, category))  # the change grows its whole category: every source of it costs
    for e in estimates:
        if e.source in grown:
            entry.rows += e.rows_to_generate
            entry.answer_tokens += e.output_tokens
            entry.gpu_hours += e.gpu_hours


def _whole(weights: dict[str, float], budget: int | None, supply: dict[str, float], category: str) -> float | None:
    """The weight of ``category`` among ``weights`` (mix.categories as written) at which the mix takes its
    whole ``supply`` (tokens per category with every prompt generated), at least its weight now; None where
    the budget cannot hold it."""
    others = {c: w for c, w in weights.items() if c != category}
    if budget is not None:
        share = supply[category] / budget
        if share >= 1:
            return None
        need = share / (1 - share) * sum(others.values())
    else:
        # without a budget the scarcest category (supply over weight) sets the size: the category binds
        # once its own supply over weight is no more than every other's
        # whole tokens, as the mix's targets count a category's supply (stages.common.targets.category_targets)
        ratios = [int(supply[c]) / w for c, w in others.items() if int(supply.get(c, 0)) > 0]
        if not ratios:
            return weights[category]
        need = supply[category] / min(ratios)
    return max(weights[category], _round_up(need * 1.001))


def _round_up(value: float, digits: int = 3) -> float:
    """Up to ``digits`` significant digits, rounded up: a weight a user would write."""
    if value <= 0:
        return value
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale) / scale


def rows(rounds: list[NextRound]) -> list[dict[str, Any]]:
    """The table as the report keeps it (JSON)."""
    return [
        {
            "slice": r.slice,
            "sources": r.sources,
            "left_out_prompts": r.left_out,
            "over_max_samples": r.over_max_samples,
            "degenerate_rows": r.degenerate,
            "change": {k: {"from": r.was.get(k), "to": v} for k, v in r.change.items()},
            "rows_to_generate": r.rows,
            "answer_tokens": round(r.answer_tokens),
            "gpu_hours": round(r.gpu_hours, 4),
            "note": r.note,
        }
        for r in rounds
    ]


def table(plan: Plan, weak: list[tuple[str, str]], dataset: Path) -> list[dict[str, Any]]:
    """The next round of ``weak`` slices as the acceptance report keeps it."""
    return rows(next_round(plan, weak, dataset))


def accept_job(smk: Any) -> None:
    """The accept job (rules/scripts/accept.py): the report's next round is this table, `plan`'s own
    estimate, which the stage is given (a stage imports no ops)."""
    workflow.run_rule(smk, "accept", next_round=table)
