"""What the mix will take of a build, forecast before any GPU time (``dflash-build plan``).

Every source generated whole (``mix.generate: all``) gives each category its prompts × samples × (prompt +
answer) tokens. The mix's own rule (:func:`dflash_build.stages.common.targets.category_targets`) then sets each
category's target: without a budget the scarcest category relative to its share is taken whole (it
*binds*) and the others' surplus is generated and left out; with ``mix.budget_tokens`` the budget sets
the size. Under ``as_needed`` the forecast adds the shards per source the sizing
(:mod:`dflash_build.stages.size`) would ask for from the same lengths. Lengths come from this source's
shards in the store when it has any, else from this model's other shards, else they are assumed (half of
``max_new_tokens``, no prompt tokens), and the forecast says which. The mix's share check is forecast too:
each category filled by the mix's own rule (:func:`~dflash_build.stages.mix.take_to_target`) from samples
of its sources' mean lengths, then checked as the mix checks it (:func:`~dflash_build.stages.mix.checks.
missed_shares`): a category whose target is under half a sample still takes one, and a small dataset's
shares move by whole samples. Once every token shard the mix would read is built, the forecast is the
mix's own selection and checks on them (:func:`~dflash_build.stages.mix.choose`): what the build will
say, before it runs.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_build.plan import Plan
from dflash_build.stages import size
from dflash_build.stages.common.targets import binds, category_targets
from dflash_build.stages.mix import choose, take_to_target
from dflash_build.stages.mix.checks import MixError, missed_shares
from dflash_build.store import layout
from dflash_build.store import records as R

MEASURED_HERE, MEASURED_MODEL, ASSUMED = "measured", "this model's other shards", "assumed"


@dataclass(frozen=True)
class Lengths:
    """Mean tokens per generated row of a source, and where the numbers come from."""

    prompt: float
    answer: float
    basis: str


@dataclass(frozen=True)
class CategoryForecast:
    category: str
    share: float
    expected_tokens: float  # every source of the category generated whole: prompts and answers
    answer_tokens: float  # of those, the answers (what GPU time is spent on)
    target_tokens: float  # what the mix takes
    binds: bool  # taken whole: its supply sets the dataset's size

    @property
    def left_out_tokens(self) -> float:
        return max(self.expected_tokens - self.target_tokens, 0.0)

    @property
    def left_out_answer_tokens(self) -> float:
        return self.answer_tokens * (self.left_out_tokens / self.expected_tokens) if self.expected_tokens else 0.0


@dataclass(frozen=True)
class Oversampled:
    """What a category's oversampling factor (mix.by_acceptance.CATEGORY.oversample) generates beyond its
    target's need: shards, rows and answer tokens (the GPU time)."""

    factor: float
    shards: int
    rows: float
    answer_tokens: float


@dataclass(frozen=True)
class MixForecast:
    categories: list[CategoryForecast]
    bases: dict[str, str]  # source -> where its lengths come from
    tokens_per_second: float
    # mix.generate as_needed: the shards each source would be generated to, of its shards (else empty)
    as_needed: dict[str, tuple[int, int]] = field(default_factory=dict)
    # once every pilot is built, the sizing replayed on the store (stages.size.replay): each source's shards built
    # of those it names, and the rounds estimated (measured on fewer shards than they name)
    replayed_built: dict[str, int] | None = None
    replayed_estimated: tuple[int, ...] = ()
    # degenerate answers tokenize dropped in the token shards built so far: rows read, then by reason
    degenerate: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    # the mix's share check on the forecast's samples: each share it would miss, with what to change
    missed_shares: list[str] = field(default_factory=list)
    share_tolerance: float = 0.0
    checked_on_built: bool = False  # the mix's own checks on the built token shards, not mean lengths
    # mix.by_acceptance's oversample (as_needed): per category, the shards, rows and answer tokens generated
    # beyond what the target alone would ask for
    oversampled: dict[str, Oversampled] = field(default_factory=dict)

    @property
    def expected_tokens(self) -> float:
        return sum(c.expected_tokens for c in self.categories)

    @property
    def left_out_tokens(self) -> float:
        return sum(c.left_out_tokens for c in self.categories)

    @property
    def left_out_gpu_hours(self) -> float:
        return sum(c.left_out_answer_tokens for c in self.categories) / self.tokens_per_second / 3600

    def lines(self) -> list[str]:
        binding = [c.category for c in self.categories if c.binds]
        share = self.left_out_tokens / self.expected_tokens if self.expected_tokens else 0.0
        head = (
            f"mix forecast (every prompt generated): {self.left_out_tokens:.0f} of {self.expected_tokens:.0f} tokens "
            f"({share:.0%}) would be left out by the mix, about {self.left_out_gpu_hours:.2f} GPU-hours of answers; "
            + (f"binding: {', '.join(binding)} (taken whole)" if binding else "binding: mix.budget_tokens")
        )
        out = [head, f"{'category':<16}{'share':>7}{'expected':>12}{'taken':>12}{'left out':>12}{'GPU-h':>8}"]
        for c in self.categories:
            hours = c.left_out_answer_tokens / self.tokens_per_second / 3600
            out.append(
                f"{c.category:<16}{c.share:>7.1%}{c.expected_tokens:>12.0f}{c.target_tokens:>12.0f}"
                f"{c.left_out_tokens:>12.0f}{hours:>8.2f}" + ("  binds" if c.binds else "")
            )
        if self.as_needed and self.replayed_built is None:
            each = ", ".join(f"{s} {k} of {n}" for s, (k, n) in self.as_needed.items())
            out.append(f"as needed (mix.generate): shards per source {each}, sized again on the pilot's measurements")
        elif self.as_needed and self.replayed_built is not None:
            built = self.replayed_built
            each = ", ".join(
                f"{s} {k} of {n}" + (f" (+{k - built[s]} to generate)" if k > built[s] else "")
                for s, (k, n) in self.as_needed.items()
            )
            basis = (
                f"round {', '.join(map(str, self.replayed_estimated))} estimated from the shards built so far"
                if self.replayed_estimated
                else "measured on the shards they read"
            )
            out.append(f"as needed (mix.generate): the size jobs will name {each} ({basis})")
        on = "on the built token shards" if self.checked_on_built else "at these mean lengths"
        if self.missed_shares:
            out.append(f"warning: {on} the mix's checks would fail:")
            out += [f"  - {problem}" for problem in self.missed_shares]
        else:
            out.append(f"mix checks: every category within {self.share_tolerance:.1%} of its share {on}")
        if found := {n: d for n, d in self.degenerate.items() if d[1]}:
            each = "; ".join(
                f"{n} {sum(r.values())} of {rows} ({', '.join(f'{k} {v}' for k, v in r.items())})"
                for n, (rows, r) in found.items()
            )
            out.append(
                f"degenerate answers dropped in the shards built (config degenerate): {each}; the forecast "
                "leaves the same share of each source's rows out"
            )
        for category, o in self.oversampled.items():
            out.append(
                f"oversampling (mix.by_acceptance.{category}.oversample {o.factor:g}): +{o.shards} shards, "
                f"+{o.rows:.0f} rows, +{o.answer_tokens:.0f} answer tokens beyond the target's need, about "
                f"{o.answer_tokens / self.tokens_per_second / 3600:.2f} GPU-hours, for the mix to choose from"
            )
        bases = Counter(self.bases.values())
        out.append("lengths: " + ", ".join(f"{n} sources {basis}" for basis, n in sorted(bases.items())))
        return out


def source_lengths(plan: Plan, sidecars: list[tuple[Path, dict[str, Any]]]) -> dict[str, Lengths]:
    """Each source's mean prompt and answer tokens per row: its own shards of this model, else the
    model's other shards, else the assumption."""
    by_source: dict[str, list[int]] = {}
    for stats_file, stats in sidecars:
        rows = stats.get(R.STAT_INPUT_ROWS, 0) - stats.get(R.STAT_SKIPPED, 0)
        if rows > 0:
            got = by_source.setdefault(stats_file.parent.parent.name, [0, 0, 0])
            got[0] += rows
            got[1] += stats.get(R.STAT_PROMPT_TOKENS, 0)
            got[2] += stats.get(R.STAT_OUTPUT_TOKENS, 0)
    everything = [sum(v[i] for v in by_source.values()) for i in range(3)]
    out = {}
    for name, sp in plan.sources.items():
        if (own := by_source.get(name)) is not None:
            out[name] = Lengths(own[1] / own[0], own[2] / own[0], MEASURED_HERE)
        elif everything[0]:
            out[name] = Lengths(everything[1] / everything[0], everything[2] / everything[0], MEASURED_MODEL)
        else:
            out[name] = Lengths(0.0, sp.spec.sampling.max_new_tokens / 2, ASSUMED)
    return out


def _supply(
    plan: Plan,
    prompt_rows: dict[str, int],
    lengths: dict[str, Lengths],
    degenerate: dict[str, tuple[int, dict[str, int]]],
) -> tuple[dict[str, float], dict[str, float], Counter[str], Counter[str]]:
    """Per source its samples and tokens per sample; per category the tokens expected and of those answers."""
    expected: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    samples, per_sample = {}, {}
    for name, sp in plan.sources.items():
        rows, dropped = degenerate[name]
        kept = 1 - sum(dropped.values()) / rows if rows else 1.0
        samples[name] = prompt_rows[name] * sp.spec.sampling.samples_per_prompt * kept
        answer = min(lengths[name].answer, sp.spec.sampling.max_new_tokens)
        per_sample[name] = lengths[name].prompt + answer
        expected[sp.spec.category] += samples[name] * per_sample[name]
        answers[sp.spec.category] += samples[name] * answer
    return samples, per_sample, expected, answers


def degenerate_drops(plan: Plan) -> dict[str, tuple[int, dict[str, int]]]:
    """Per source, the rows its built token shards read and the degenerate ones tokenize dropped, by reason."""
    policy = plan.config.degenerate
    out = {}
    for name in plan.sources:
        rows, dropped = 0, Counter[str]()
        for path in plan.token_shards(name):
            stats_file = layout.sidecar(path)
            if stats_file.exists():
                stats = json.loads(stats_file.read_text())
                rows += stats.get(R.STAT_INPUT_ROWS, 0)
                for reason, by_language in (stats.get(R.STAT_DEGENERATE) or {}).items():
                    if policy.policy(reason) != "keep":
                        dropped[reason] += sum(by_language.values())
        out[name] = (rows, dict(dropped))
    return out


def forecast(
    plan: Plan, prompt_rows: dict[str, int], lengths: dict[str, Lengths], tokens_per_second: float
) -> MixForecast:
    """The mix's forecast for these prompt counts (per source) and lengths; a source's degenerate answers
    leave out the share of its rows they took in its built shards."""
    cfg = plan.config
    degenerate = degenerate_drops(plan)
    samples, per_sample, expected, answers = _supply(plan, prompt_rows, lengths, degenerate)
    shares = dict(cfg.mix_categories)
    targets = category_targets(shares, {c: int(expected[c]) for c in shares}, cfg.mix_budget_tokens)
    categories = [
        CategoryForecast(
            c,
            share,
            expected[c],
            answers[c],
            min(targets[c], expected[c]),
            binds(targets[c], expected[c]),
        )
        for c, share in shares.items()
    ]
    sized: dict[str, tuple[int, int]] = {}
    oversampled: dict[str, Oversampled] = {}
    if cfg.mix_generate == "as_needed":
        supplies = [
            size.Supply(
                name,
                sp.spec.category,
                sp.n_shards,
                0,
                samples[name] / sp.n_shards,
                per_sample[name],
                sp.spec.weight,
            )
            for name, sp in plan.sources.items()
        ]
        shards, _ = size.shards_needed(shares, cfg.mix_budget_tokens, supplies, oversample=size.oversample(cfg))
        sized = {name: (max(1, shards[name]), plan.sources[name].n_shards) for name in plan.sources}
        oversampled = _oversampled(plan, supplies, shards, samples, lengths)
    generated = {
        name: samples[name] * (sized[name][0] / sized[name][1] if name in sized else 1.0) for name in plan.sources
    }
    built = _built_mix_checks(plan, sized)
    missed = built if built is not None else _share_check(plan, shares, generated, per_sample)
    return MixForecast(
        categories,
        {n: v.basis for n, v in lengths.items()},
        tokens_per_second,
        sized,
        missed_shares=missed,
        share_tolerance=cfg.checks.share_tolerance,
        checked_on_built=built is not None,
        degenerate=degenerate,
        oversampled=oversampled,
    )


def _oversampled(
    plan: Plan,
    supplies: list[size.Supply],
    shards: dict[str, int],
    samples: dict[str, float],
    lengths: dict[str, Lengths],
) -> dict[str, Oversampled]:
    """Per oversampled category, what the sizing asks for beyond the same sizing without the factor."""
    cfg = plan.config
    factors = size.oversample(cfg)
    if not factors:
        return {}
    plain, _ = size.shards_needed(dict(cfg.mix_categories), cfg.mix_budget_tokens, supplies)
    out = {}
    for category, factor in factors.items():
        extra = {
            s.source: max(1, shards[s.source]) - max(1, plain[s.source]) for s in supplies if s.category == category
        }
        rows = {n: samples[n] / plan.sources[n].n_shards * k for n, k in extra.items()}
        answer = {n: min(lengths[n].answer, plan.sources[n].spec.sampling.max_new_tokens) for n in extra}
        out[category] = Oversampled(
            factor, sum(extra.values()), sum(rows.values()), sum(rows[n] * answer[n] for n in rows)
        )
    return out


def _built_mix_checks(plan: Plan, sized: dict[str, tuple[int, int]]) -> list[str] | None:
    """The mix's problems with the token shards it would read (``sized``: as_needed's shards per source),
    from its own selection; None while any of them is not built."""
    shards = {name: plan.token_shards(name)[: sized[name][0] if name in sized else None] for name in plan.sources}
    if not all(p.exists() for paths in shards.values() for p in paths):
        return None
    try:
        choose(plan, shards)
    except MixError as e:
        return e.problems
    return []


def _share_check(
    plan: Plan, shares: dict[str, float], samples: dict[str, float], per_sample: dict[str, float]
) -> list[str]:
    """The mix's share check on samples of each source's mean length: each category's samples in an
    interleaved order (the mix's rank is a hash, so sources mix evenly), filled to the mix's targets."""
    by_category: dict[str, list[tuple[float, int]]] = {c: [] for c in shares}
    for name, sp in plan.sources.items():
        n = round(samples[name])
        tokens = max(1, round(per_sample[name]))
        by_category.setdefault(sp.spec.category, []).extend(((i + 0.5) / n, tokens) for i in range(n))
    available = Counter({c: sum(t for _, t in rows) for c, rows in by_category.items() if c in shares})
    targets = category_targets(shares, dict(available), plan.config.mix_budget_tokens)
    chosen: Counter[str] = Counter()
    for category in shares:
        lengths = np.array([t for _, t in sorted(by_category[category])], dtype=np.int64)
        chosen[category] = int(lengths[take_to_target(lengths, targets[category])].sum())
    return missed_shares(plan, shares, targets, chosen, available)
