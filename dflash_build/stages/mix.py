"""Mix stage: token shards → the final dataset at the target category mix, by tokens.

Selection reads only the small columns of every shard, ranks each category's samples by a seeded
hash (deterministic, independent of shard order) and fills each category up to its token target.
Without a budget the dataset is the largest one that meets every share: the scarcest category is
taken whole. With a budget, a category that has too few tokens is taken whole and reported short.
The data is then streamed shard by shard into parquet files, so memory stays bounded.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing, killpoints
from dflash_build.plan import Plan
from dflash_build.publish import release, report
from dflash_build.publish.report import length_stats
from dflash_build.stages import crosssource
from dflash_build.store import atomic, layout
from dflash_build.store import records as R
from dflash_build.versions import MIX_VERSION

log = logging.getLogger(__name__)
_SELECT_COLUMNS = ["prompt_id", "sample_idx", "turn", "source", "category", "language", "n_tokens"]
NOTED_DEVIATION = 0.01  # a share further than this from its target is stated in the manifest (not a check)


class MixError(RuntimeError):
    """The dataset would miss what the config asks for; the message names the cause and the key to change."""


def category_targets(
    shares: dict[str, float],
    available: dict[str, int],
    budget: int | None,
    floors: dict[str, dict[str, float]] | None = None,
    available_by_language: dict[str, Counter[str]] | None = None,
) -> dict[str, float]:
    """Token target per category. Without a budget, the largest total at which every category's share,
    and every language floor within a category (``floors``, met from ``available_by_language``), can be
    taken from what is available."""
    if budget is not None:
        return {c: share * budget for c, share in shares.items()}
    limits = [available.get(c, 0) / share for c, share in shares.items() if available.get(c, 0) > 0]
    for category, by_language in (floors or {}).items():
        supply = (available_by_language or {}).get(category, Counter())
        limits += [supply[lang] / (floor * shares[category]) for lang, floor in by_language.items() if supply[lang]]
    total = min(limits) if limits else 0.0
    return {c: share * total for c, share in shares.items()}


def take_to_target(n_tokens: np.ndarray, target: float) -> np.ndarray:
    """Which samples to take, given their token counts in rank order: a boolean mask.

    A sample is taken whenever it brings the category closer to ``target`` tokens: when it overshoots
    the target by less than the gap it closes, so the error per category stays under half a sample; a
    category whose target is all it has takes everything. A category with a target is never left empty:
    when even its shortest sample is over twice the target, that one sample (the first in rank order of
    the shortest) is the closest the category can come. Vectorised: each round takes the longest run of
    samples that all fit, skips the one that does not, and drops every later sample too long for the
    gap that is left.
    """
    n_tokens = np.asarray(n_tokens, dtype=np.int64)
    taken = np.zeros(len(n_tokens), dtype=bool)
    if target > 0 and len(n_tokens) and 2 * int(n_tokens.min()) > target * (1 + 1e-9):
        taken[int(np.argmin(n_tokens))] = True
        return taken
    limit = target * (1 + 1e-9)
    used = 0
    left = np.arange(len(n_tokens))
    for _ in range(_VECTOR_ROUNDS):
        if not len(left):
            return taken
        left = left[used + n_tokens[left] / 2 <= limit]
        n = n_tokens[left]
        before = used + np.cumsum(n) - n  # tokens used before each sample, if all before it are taken
        fits = before + n / 2 <= limit
        stop = int(np.argmin(fits)) if not fits.all() else len(left)
        taken[left[:stop]] = True
        used += int(n[:stop].sum())
        left = left[stop + 1 :]
    for i in left:  # many samples near the gap's size: one at a time, as defined above
        if used + n_tokens[i] / 2 <= limit:
            taken[i] = True
            used += int(n_tokens[i])
    return taken


_VECTOR_ROUNDS = 64


_SPLITMIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x ^ (x >> np.uint64(30))) * _SPLITMIX[1]
    x = (x ^ (x >> np.uint64(27))) * _SPLITMIX[2]
    return x ^ (x >> np.uint64(31))


def sample_ranks(
    seed: int, prompt_ids: pa.ChunkedArray | pa.Array, sample_idx: np.ndarray, turn: np.ndarray | None = None
) -> np.ndarray:
    """Each sample's seeded rank: a hash of (seed, prompt_id, sample_idx, turn), the same in any shard
    order. A whole row (turn null) and a conversation's turn 0 rank as (seed, prompt_id, sample_idx)."""
    sample = np.asarray(sample_idx, dtype=np.uint64)
    if turn is not None:
        sample = sample + (np.asarray(turn, dtype=np.uint64) << np.uint64(32))
    seeds = np.full(len(sample), seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)  # arrays wrap silently; scalars warn
    salt = _mix64(seeds * _SPLITMIX[0] + sample)
    return _mix64(hashing.hex_to_u64(prompt_ids) ^ salt)


@dataclass
class _Candidates:
    """Every sample of the token shards, as flat arrays (26 bytes a sample), in input order."""

    rank: np.ndarray  # uint64
    n_tokens: np.ndarray  # int32
    category: np.ndarray  # int16: index into the categories
    offsets: np.ndarray  # int64: where each input shard's rows start
    prompt_id: np.ndarray  # uint64
    source: np.ndarray  # int16: index into the sources
    language: np.ndarray  # int16: index into ``languages``
    languages: list[str]

    def available(self, codes: np.ndarray, names: list[str], eligible: np.ndarray) -> Counter[str]:
        """Tokens of the eligible samples by ``codes`` (category or source) named by ``names``."""
        counted = eligible & (codes >= 0)
        sums = np.zeros(len(names), dtype=np.int64)
        np.add.at(sums, codes[counted], self.n_tokens[counted].astype(np.int64))
        return Counter({name: int(total) for name, total in zip(names, sums, strict=True) if total})

    def by_language(self, categories: list[str], eligible: np.ndarray) -> dict[str, Counter[str]]:
        """Tokens of the eligible samples by category, then language."""
        return {
            category: self.available(self.language, self.languages, eligible & (self.category == code))
            for code, category in enumerate(categories)
        }


def _candidates(seed: int, inputs: list[tuple[int, Path]], categories: list[str]) -> _Candidates:
    """Read only the columns selection needs (``inputs``: each token shard with its source's index)."""
    import pyarrow.compute as pc

    known = pa.array(categories, type=pa.string())
    ranks, tokens, codes, ids, sources, languages, sizes = [], [], [], [], [], [], [0]
    language_names: dict[str, int] = {}
    for source, path in inputs:
        table = pq.read_table(path, columns=_SELECT_COLUMNS)
        turn = pc.fill_null(table.column("turn"), 0).to_numpy()
        ranks.append(sample_ranks(seed, table.column("prompt_id"), table.column("sample_idx").to_numpy(), turn))
        tokens.append(table.column("n_tokens").to_numpy().astype(np.int32))
        codes.append(
            pc.fill_null(pc.index_in(table.column("category"), value_set=known), -1).to_numpy().astype(np.int16)
        )
        ids.append(hashing.hex_to_u64(table.column("prompt_id")))
        sources.append(np.full(table.num_rows, source, dtype=np.int16))
        encoded = table.column("language").dictionary_encode().combine_chunks()
        index = np.array(
            [language_names.setdefault(str(code), len(language_names)) for code in encoded.dictionary.to_pylist()]
            + [-1],
            dtype=np.int16,
        )
        languages.append(index[pc.fill_null(encoded.indices, len(encoded.dictionary)).to_numpy()])
        sizes.append(table.num_rows)

    def joined(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    return _Candidates(
        joined(ranks, np.uint64),
        joined(tokens, np.int32),
        joined(codes, np.int16),
        np.cumsum(sizes),
        joined(ids, np.uint64),
        joined(sources, np.int16),
        joined(languages, np.int16),
        list(language_names),
    )


def _eligible(cand: _Candidates, names: list[str], cross: crosssource.CrossSource | None) -> np.ndarray:
    """The samples the mix may take: all but those of prompts another source keeps."""
    eligible = np.ones(len(cand.rank), dtype=bool)
    if cross is not None:
        for code, name in enumerate(names):
            mine = np.flatnonzero(cand.source == code)
            eligible[mine[np.isin(cand.prompt_id[mine], cross.dropped.get(name, []))]] = False
    return eligible


@dataclass
class _Choice:
    """What the mix takes: each token shard's chosen rows, and the numbers its checks and manifest use."""

    inputs: list[tuple[str, Path]]  # (source, token shard), by source name and shard
    chosen: np.ndarray  # bool per sample of every input, in input order
    offsets: np.ndarray  # where each input's samples start
    shares: dict[str, float]
    targets: dict[str, float]
    available: Counter[str]  # tokens by category the mix may take
    cross: crosssource.CrossSource | None
    floors: dict[str, dict[str, dict[str, Any]]]  # mix.languages: category -> language -> what it got


def choose(plan: Plan) -> _Choice:
    """Select the samples (about 30 bytes each in memory) and check the result, before anything is written."""
    cfg = plan.config
    # by source name and shard: the dataset's row order does not depend on the config's source order
    names = sorted(plan.sources)
    inputs = [(source, path) for source in names for path in plan.token_shards(source)]
    shares = dict(cfg.mix_categories)
    categories = list(shares)
    cand = _candidates(cfg.mix_seed, [(names.index(s), p) for s, p in inputs], categories)
    cross = crosssource.load(plan)
    eligible = _eligible(cand, names, cross)
    available = cand.available(cand.category, categories, eligible)
    floors = {c: dict(f) for c, f in cfg.mix_languages.items()}
    by_language = cand.by_language(categories, eligible) if floors else {}  # only floors need it
    targets = category_targets(shares, dict(available), cfg.mix_budget_tokens, floors, by_language)
    chosen = np.zeros(len(cand.rank), dtype=bool)
    chosen_tokens: Counter[str] = Counter()
    for code, category in enumerate(categories):
        members = np.flatnonzero((cand.category == code) & eligible)
        by_rank = members[np.argsort(cand.rank[members], kind="stable")]
        take = _fill(cand, by_rank, targets[category], floors.get(category))
        chosen[take] = True
        chosen_tokens[category] += int(cand.n_tokens[take].sum(dtype=np.int64))
    reached = {}
    if floors:
        reached = _floors_reached(floors, cand.by_language(categories, chosen), chosen_tokens, by_language)
    by_source = cand.available(cand.source, names, eligible)
    check(plan, shares, targets, chosen_tokens, available, by_source, cross, missed_floors(plan, reached, targets))
    return _Choice(inputs, chosen, cand.offsets, shares, targets, available, cross, reached)


def _fill(cand: _Candidates, by_rank: np.ndarray, target: float, floors: dict[str, float] | None) -> np.ndarray:
    """A category's samples (in rank order) to take for ``target`` tokens: first each floor language's
    share of the target from that language's samples, then the rest from every language, each part in
    rank order (:func:`take_to_target`)."""
    taken = np.zeros(len(by_rank), dtype=bool)
    used = 0
    for lang, floor in (floors or {}).items():
        if lang not in cand.languages:
            continue
        mine = np.flatnonzero(cand.language[by_rank] == cand.languages.index(lang))
        part = mine[take_to_target(cand.n_tokens[by_rank[mine]], floor * target)]
        taken[part] = True
        used += int(cand.n_tokens[by_rank[part]].sum(dtype=np.int64))
    rest = np.flatnonzero(~taken)
    taken[rest[take_to_target(cand.n_tokens[by_rank[rest]], target - used)]] = True
    return by_rank[taken]


def _floors_reached(
    floors: dict[str, dict[str, float]],
    chosen: dict[str, Counter[str]],
    chosen_tokens: Counter[str],
    available: dict[str, Counter[str]],
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each language floor with the share of its category's tokens the selection gives it."""
    return {
        category: {
            lang: {
                "floor": floor,
                "achieved_share": round(chosen[category][lang] / chosen_tokens[category], 6)
                if chosen_tokens[category]
                else 0.0,
                "tokens": chosen[category][lang],
                "available_tokens": available[category][lang],
            }
            for lang, floor in by_language.items()
        }
        for category, by_language in floors.items()
    }


def missed_floors(plan: Plan, reached: dict[str, dict[str, dict[str, Any]]], targets: dict[str, float]) -> list[str]:
    """Each language floor of ``mix.languages`` missed by more than the tolerance, with what to change."""
    checks = plan.config.checks
    problems = []
    for category, by_language in reached.items():
        for lang, got in by_language.items():
            if got["floor"] - got["achieved_share"] <= checks.share_tolerance or category in checks.allow_shortfall:
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


@dataclass
class _Written:
    """What the dataset's files hold, summed as they are written."""

    rows_by: dict[str, Counter[str]] = field(default_factory=lambda: {"source": Counter(), "category": Counter()})
    tokens_by: dict[str, Counter[str]] = field(default_factory=lambda: {"source": Counter(), "category": Counter()})
    finish: Counter[str] = field(default_factory=Counter)
    lengths: list[np.ndarray] = field(default_factory=list)
    loss_tokens: int = 0
    per_turn_samples: Counter[str] = field(default_factory=Counter)  # by source
    # tokens by language, per source and per category
    languages: dict[str, dict[str, Counter[str]]] = field(
        default_factory=lambda: {"source": defaultdict(Counter), "category": defaultdict(Counter)}
    )
    tally: report.Tally = field(default_factory=report.Tally)
    files: list[dict[str, Any]] = field(default_factory=list)

    def add(self, table: pa.Table, source: str, category: str) -> None:
        n_tokens = table.column("n_tokens").to_numpy()
        n_loss = table.column("n_loss_tokens").to_numpy()
        reasons = Counter(table.column("finish_reason").to_pylist())
        for col, name in (("source", source), ("category", category)):
            self.rows_by[col][name] += table.num_rows
            self.tokens_by[col][name] += int(n_tokens.sum(dtype=np.int64))
        self.finish.update(reasons)
        self.lengths.append(n_tokens.astype(np.int32))
        self.loss_tokens += int(n_loss.sum(dtype=np.int64))
        self.per_turn_samples[source] += table.num_rows - table.column("turn").null_count
        sums = table.group_by("language").aggregate([("n_tokens", "sum")])
        by_language = dict(zip(sums["language"].to_pylist(), sums["n_tokens_sum"].to_pylist(), strict=True))
        for col, name in (("source", source), ("category", category)):
            self.languages[col][name].update(by_language)
        self.tally.add_rows(source, category, n_tokens, n_loss, reasons)


def run(plan: Plan, record: str | Path) -> dict[str, Any]:
    """Select the samples of every token shard and write the dataset, in memory that grows only with the
    number of samples, never with their size.

    The dataset is a new version of ``dataset.out/NAME``, swapped in only once it is whole and passed its
    checks (:mod:`dflash_build.publish.release`); ``record`` is the build record, the rule's output.
    """
    cfg = plan.config
    choice = choose(plan)
    with release.publish(cfg.dataset_dir, Path(record)) as tmp:
        written = _write(plan, choice, tmp / "data")
        killpoints.die_at("mix")
        manifest = _manifest(plan, choice, written)
        report.write_tables(tmp, manifest)
        manifest["tables"] = list(report.TABLES)
        manifest["plots"] = report.write_plots(tmp, manifest, written.tally)
        atomic.write_json(tmp / layout.MANIFEST, manifest)
        atomic.write_text(tmp / "README.md", dataset_card(manifest))
    log.info("%s", summary(manifest, cfg.dataset_dir))
    return manifest


def _write(plan: Plan, choice: _Choice, folder: Path) -> _Written:
    """The chosen rows, one token shard at a time, into the dataset's files."""
    written = _Written()
    writer = RollingWriter(folder, plan.config.rows_per_file)
    for index, (source, path) in enumerate(choice.inputs):
        rows = np.flatnonzero(choice.chosen[choice.offsets[index] : choice.offsets[index + 1]])
        if not len(rows):
            continue
        table = pq.read_table(path).take(pa.array(rows, type=pa.int64()))
        written.add(table, source, plan.sources[source].spec.category)
        writer.write(table)
        del table
    written.files = writer.close()
    return written


def _manifest(plan: Plan, choice: _Choice, written: _Written) -> dict[str, Any]:
    cfg = plan.config
    tokens = written.tokens_by["category"]
    total = sum(tokens.values())
    all_lengths = np.concatenate(written.lengths) if written.lengths else np.zeros(0, dtype=np.int32)
    categories = {
        c: {
            "target_share": share,
            "achieved_share": round(tokens[c] / total, 6) if total else 0.0,
            "target_tokens": round(choice.targets[c]),
            "tokens": tokens[c],
            "available_tokens": choice.available[c],
            "rows": written.rows_by["category"][c],
        }
        for c, share in choice.shares.items()
    }
    return {
        "stage": "mix",
        "scheme": MIX_VERSION,
        "dataset": cfg.dataset_name,
        "files": written.files,
        "rows": len(all_lengths),
        "tokens": total,
        "loss_tokens": written.loss_tokens,
        "per_turn_samples": sum(written.per_turn_samples.values()),  # one turn of a conversation each
        "mix": {
            "seed": cfg.mix_seed,
            "budget_tokens": cfg.mix_budget_tokens,
            "categories": categories,
            "languages": choice.floors,
        },
        # tokens by language (the prompt's, dflash_build.language), per category and per source
        "languages": {
            f"by_{col}": {name: dict(counts.most_common()) for name, counts in sorted(written.languages[col].items())}
            for col in ("category", "source")
        },
        "cross_source": choice.cross.report() if choice.cross is not None else None,
        "prompts": {name: _prompt_summary(plan, name) for name in sorted(plan.sources)},
        "shortfalls": _shortfalls(choice.shares, choice.targets, tokens, choice.available, cfg.mix_budget_tokens),
        "sources": {name: _source_entry(plan, name, written) for name in plan.sources},
        "model": {"path": cfg.model.path, "revision": cfg.model.revision},
        "model_fingerprint": plan.model_fingerprint,
        "template_fingerprint": plan.template_fingerprint,
        "finish_reasons": dict(sorted(written.finish.items())),
        "length": length_stats(all_lengths),
        "report": report.tables(plan, written.tally),
    }


def _source_entry(plan: Plan, name: str, written: _Written) -> dict[str, Any]:
    sp = plan.sources[name]
    return {
        "category": sp.spec.category,
        "rows": written.rows_by["source"][name],
        "per_turn_samples": written.per_turn_samples[name],
        "tokens": written.tokens_by["source"][name],
        "prompt_key": sp.prompt_key,
        "gen_key": sp.gen_key,
        "tok_key": sp.tok_key,
        "components": {"prompt": sp.prompt_components, "gen": sp.gen_components, "tok": sp.tok_components},
        "shards": [str(p) for p in plan.token_shards(name)],
    }


def check(
    plan: Plan,
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
            problems.append(
                f"source '{name}' reaches the mix with no samples ({_token_drops(plan, name)}); "
                f"see its generate and tokenize logs under {plan.config.logs}/; `truncated: keep` keeps "
                f"answers that hit max_new_tokens; or allow it with checks.allow_shortfall: [{sp.spec.category}]"
            )
    total = sum(chosen.values())
    if total == 0:
        problems.insert(0, "the dataset would be empty: no token shard has a usable sample")
    else:
        for category, share in shares.items():
            achieved = chosen[category] / total
            if share - achieved > checks.share_tolerance and category not in checks.allow_shortfall:
                problems.append(_missed_share(category, share, chosen, available, targets, checks.share_tolerance))
    problems += missed or []
    if problems:
        raise MixError("the mix misses the configured dataset:\n" + "\n".join(f"  - {p}" for p in problems))


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


def _prompt_summary(plan: Plan, source: str) -> dict[str, Any]:
    """Prepare's accounting of a source, from its prompt manifest: rows in and out, drops, examples."""
    manifest = json.loads(plan.prompt_manifest(source).read_text())
    keys = ("rows_in", "rows_out", "drops", "drop_examples", "references")
    return {k: manifest[k] for k in keys if k in manifest}


def _token_drops(plan: Plan, source: str) -> str:
    """Why a source's rows did not become samples, summed over its tokenize stats sidecars."""
    dropped: Counter[str] = Counter()
    rows = 0
    for path in plan.token_shards(source):
        stats_file = layout.sidecar(path)
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            rows += stats.get(R.STAT_INPUT_ROWS, 0)
            dropped.update(stats.get(R.STAT_DROPPED, {}))
    reasons = ", ".join(f"{k}: {v}" for k, v in dropped.most_common()) or "none"
    return f"{rows} completions, tokenize dropped {reasons}"


def _shortfalls(
    shares: dict[str, float], targets: dict[str, float], got: Counter[str], available: Counter[str], budget: int | None
) -> list[str]:
    """Plain statements of every way the dataset misses its configured mix."""
    notes = []
    total = sum(got.values())
    for category, share in shares.items():
        achieved = got[category] / total if total else 0.0
        if available[category] == 0:
            notes.append(f"category '{category}' has no samples: its target share {share:.1%} is not met")
        elif budget is not None and available[category] < targets[category]:
            notes.append(
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
            notes.append(f"category '{category}' reaches {achieved:.1%} instead of {share:.1%}: {why}")
    return notes


class RollingWriter:
    """Writes tables into data/train-XXXXX.parquet files of at most ``rows_per_file`` rows."""

    def __init__(self, folder: Path, rows_per_file: int, schema: pa.Schema = R.SAMPLE_SCHEMA) -> None:
        self.folder, self.rows_per_file, self.schema = folder, rows_per_file, schema
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.files: list[tuple[Path, dict[str, Any]]] = []

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            take = min(table.num_rows, self.rows_per_file - self.pending_rows)
            self.pending.append(table.slice(0, take))
            self.pending_rows += take
            table = table.slice(take)
            if self.pending_rows == self.rows_per_file:
                self._flush()

    def _flush(self) -> None:
        path = self.folder / f"part-{len(self.files):05d}.parquet"
        data = pa.concat_tables(self.pending) if self.pending else self.schema.empty_table()
        self.files.append((path, atomic.write_parquet(path, data)))
        self.pending, self.pending_rows = [], 0

    def close(self) -> list[dict[str, Any]]:
        if self.pending_rows or not self.files:
            self._flush()
        # Hugging Face's naming lets `datasets` see one train split. The content digest in the name
        # makes a rebuilt dataset new files: `datasets` caches a local folder by its file names.
        n = len(self.files)
        content = hashing.digest([info["sha256"] for _, info in self.files])[:12]
        files = []
        for i, (path, info) in enumerate(self.files):
            final = path.with_name(f"train-{i:05d}-of-{n:05d}-{content}.parquet")
            path.rename(final)
            files.append({"path": str(Path("data") / final.name), **info})
        atomic.fsync_dir(self.folder)
        return files


def summary(manifest: dict[str, Any], where: Path, sources: bool = False) -> str:
    """The mix achieved against its targets; with ``sources``, the report's per-source table too."""
    counts = f"{manifest['rows']} rows, {manifest['tokens']} tokens, {manifest['loss_tokens']} loss tokens"
    lines = [f"dataset: {where} ({counts})"]
    lines.append(f"{'category':<16}{'target':>8}{'achieved':>10}{'tokens':>12}{'rows':>8}")
    for category, c in manifest["mix"]["categories"].items():
        lines.append(
            f"{category:<16}{c['target_share']:>8.1%}{c['achieved_share']:>10.1%}{c['tokens']:>12}{c['rows']:>8}"
        )
    length = manifest["length"]
    lines.append(f"length: mean {length['mean']}, p50 {length['p50']}, p90 {length['p90']}, max {length['max']}")
    if "languages" in manifest:
        shares = report.language_shares(dict(report.language_totals(manifest)))
        named = list(shares.items())[: report.NAMED_LANGUAGES]
        lines.append("languages: " + ", ".join(f"{lang} {share:.1%}" for lang, share in named))
    lines.extend(f"note: {s}" for s in manifest["shortfalls"])
    if sources and "report" in manifest:
        lines += ["", report.plain(manifest["report"]), f"card, plots and tables: {where}/README.md"]
    return "\n".join(lines)


def card_header(manifest: dict[str, Any]) -> str:
    """A dataset card's YAML header (so the folder loads with `datasets`) and its title.

    The exact file names, not a glob: `datasets` keys its cache of a local folder by the card's
    data_files, so a glob would serve the previous build's rows after a rebuild.
    """
    data_files = "\n".join(f"    - {f['path']}" for f in manifest["files"])
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path:
{data_files}
---
# {manifest["dataset"]}
"""


def dataset_card(manifest: dict[str, Any]) -> str:
    sources = "\n".join(
        f"| {name} | {s['category']} | {s['rows']} | {s['tokens']} | `{s['gen_key']}` |"
        for name, s in manifest["sources"].items()
    )
    shortfalls = "\n".join(f"- {s}" for s in manifest["shortfalls"]) or "- none"
    return f"""{card_header(manifest)}
Built by dflash-build. Each row is one training sample: `input_ids` are the prompt as the target model's
chat template rendered it, followed by the model's own answer; `loss_mask` is 1 on the generated tokens
only. Content keys of every input shard are in `{layout.MANIFEST}`.

```
{summary(manifest, Path("."))}
```

| source | category | rows | tokens | gen_key |
|---|---|---|---|---|
{sources}

Shortfalls:
{shortfalls}

Finish reasons: {json.dumps(manifest["finish_reasons"])}

{report.recipe(manifest)}
{report.card_body(manifest)}"""
