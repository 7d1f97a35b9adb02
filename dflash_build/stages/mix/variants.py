"""Sampling variants in the mix (config ``variants``): what each variant holds of the dataset, and the
check that a variant's share of prompts is not lost on the way.

A variant's share is counted in prompts: the draw gives each prompt one variant, so the share of the
prompts drawn to a variant (prepare's manifests) is what the dataset should hold of it. What generation
and the mix lose (truncated answers dropped, failed rows, a window that skips long prompts, the mix's
cut) can fall on one variant more than another: thinking answers run out of ``max_new_tokens`` first.
The check compares with the share drawn, not the configured weight, so the draw's own randomness in a
small source never fails a build; the configured share is stated beside it. Variants with ``every: true``
hold every prompt and are reported only.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_build.plan import Plan
from dflash_build.store import records as R


@dataclass
class VariantTally:
    """What the dataset's files hold of each variant, summed as they are written."""

    rows: Counter[str] = field(default_factory=Counter)
    tokens: Counter[str] = field(default_factory=Counter)
    loss_tokens: Counter[str] = field(default_factory=Counter)
    ran_out: Counter[str] = field(default_factory=Counter)  # samples whose answer hit its budget
    tokens_by_category: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, table: pa.Table, variant: str, category: str) -> None:
        tokens = int(table.column("n_tokens").to_numpy().sum(dtype=np.int64))
        self.rows[variant] += table.num_rows
        self.tokens[variant] += tokens
        self.loss_tokens[variant] += int(table.column("n_loss_tokens").to_numpy().sum(dtype=np.int64))
        self.ran_out[variant] += sum(r in R.RAN_OUT for r in table.column("finish_reason").to_pylist())
        self.tokens_by_category[category][variant] += tokens


def has_variants(plan: Plan) -> bool:
    return any(sp.spec.variant is not None for sp in plan.sources.values())


def drawn_prompts(plan: Plan) -> Counter[str]:
    """Prompts each variant source was drawn at prepare (its manifest's rows out)."""
    out: Counter[str] = Counter()
    for name, sp in plan.sources.items():
        if sp.spec.variant is not None:
            out[name] = json.loads(plan.prompt_manifest(name).read_text())[R.PROMPTS_ROWS_OUT]
    return out


def prompts_taken(
    prompt_ids: np.ndarray, source_codes: np.ndarray, chosen: np.ndarray, names: list[str]
) -> Counter[str]:
    """Distinct prompts of each source among the ``chosen`` samples (a prompt's samples and turns once)."""
    out: Counter[str] = Counter()
    for code, name in enumerate(names):
        out[name] = len(np.unique(prompt_ids[chosen & (source_codes == code)]))
    return out


def _drawn_shares(plan: Plan, prompts: Counter[str]) -> dict[str, float]:
    """Each drawn variant's share of ``prompts`` (by source) over every source's drawn variants."""
    by_variant: Counter[str] = Counter()
    for name, sp in plan.sources.items():
        if sp.spec.drawn_share is not None:
            by_variant[str(sp.spec.variant)] += prompts[name]
    total = sum(by_variant.values())
    return {v: n / total if total else 0.0 for v, n in sorted(by_variant.items())}


def _configured_shares(plan: Plan, drawn: Counter[str]) -> dict[str, float]:
    """Each drawn variant's configured share, weighted by its sources' drawn prompts when their tables differ."""
    drawn_sources = [sp.spec for sp in plan.sources.values() if sp.spec.drawn_share is not None]
    parents: Counter[str] = Counter()
    for spec in drawn_sources:
        parents[spec.config_name] += drawn[spec.name]
    weighted: Counter[str] = Counter()
    for spec in drawn_sources:
        weighted[str(spec.variant)] += parents[spec.config_name] * float(spec.drawn_share or 0.0)
    total = sum(parents.values())
    return {v: w / total if total else 0.0 for v, w in sorted(weighted.items())}


def _tolerance(plan: Plan, variant: str) -> float:
    own = [sp.spec.variant_tolerance for sp in plan.sources.values() if sp.spec.variant == variant]
    return next((t for t in own if t is not None), plan.config.checks.share_tolerance)


def missed(plan: Plan, drawn: Counter[str], taken: Counter[str]) -> list[str]:
    """Each drawn variant whose share of the dataset's prompts ends more than its tolerance below the share
    drawn to it, with where it was lost and what to change (none without variants)."""
    want, got = _drawn_shares(plan, drawn), _drawn_shares(plan, taken)
    problems = []
    for variant, share in want.items():
        tolerance = _tolerance(plan, variant)
        if share - got.get(variant, 0.0) <= tolerance:
            continue
        lost = {n: drawn[n] - taken[n] for n, sp in plan.sources.items() if sp.spec.variant == variant}
        problems.append(
            f"variant '{variant}' holds {got.get(variant, 0.0):.1%} of the dataset's prompts, {share:.1%} were drawn "
            f"to it (tolerance {tolerance:.1%}): its sources lost "
            + ", ".join(f"{n} {k} of {drawn[n]}" for n, k in sorted(lost.items()))
            + " prompts to generation (truncation, degenerate answers, failures, the trainer's window) or the mix; "
            "see their generate and tokenize sidecars (a larger max_new_tokens or `truncated: keep` keeps answers "
            f"that run out), or set variants.{variant}.tolerance"
        )
    return problems


def report(plan: Plan, drawn: Counter[str], taken: Counter[str], tally: VariantTally) -> dict[str, Any]:
    """The manifest's ``variants``: per variant, what was drawn, what the dataset holds, and its samples."""
    want, got, configured = _drawn_shares(plan, drawn), _drawn_shares(plan, taken), _configured_shares(plan, drawn)
    by_variant: dict[str, list[str]] = defaultdict(list)
    for name, sp in plan.sources.items():
        if sp.spec.variant is not None:
            by_variant[sp.spec.variant].append(name)
    out = {}
    for variant, sources in sorted(by_variant.items()):
        every = all(plan.sources[s].spec.drawn_share is None for s in sources)
        rows = tally.rows[variant]
        out[variant] = {
            "sources": sources,
            "every": every,
            "configured_share": None if every else round(configured.get(variant, 0.0), 6),
            "drawn_prompts": sum(drawn[s] for s in sources),
            "drawn_share": None if every else round(want.get(variant, 0.0), 6),
            "prompts": sum(taken[s] for s in sources),
            "achieved_share": None if every else round(got.get(variant, 0.0), 6),
            "tolerance": None if every else _tolerance(plan, variant),
            "rows": rows,
            "tokens": tally.tokens[variant],
            "mean_answer_tokens": round(tally.loss_tokens[variant] / rows, 1) if rows else 0.0,
            "ran_out_rows": tally.ran_out[variant],
            "tokens_by_category": dict(sorted((c, n[variant]) for c, n in tally.tokens_by_category.items())),
        }
    return out
