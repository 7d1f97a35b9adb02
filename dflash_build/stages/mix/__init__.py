"""Mix stage: token shards → the final dataset at the target category mix, by tokens.

Selection reads only the small columns of every shard, ranks each category's samples by a seeded
hash (deterministic, independent of shard order) and fills each category up to its token target.
Without a budget the dataset is the largest one that meets every share: the scarcest category is
taken whole. With a budget, a category that has too few tokens is taken whole and reported short.
The data is then streamed shard by shard into parquet files, so memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing, killpoints
from dflash_build.plan import Plan
from dflash_build.publish import plots, release, report
from dflash_build.publish.card import dataset_card, summary
from dflash_build.publish.files import RollingWriter
from dflash_build.publish.report import length_stats
from dflash_build.spec import Config
from dflash_build.stages.common import crosssource, neardup
from dflash_build.stages.common.job import Job
from dflash_build.stages.common.targets import category_targets
from dflash_build.stages.mix import acceptance as by_acceptance
from dflash_build.stages.mix import variants
from dflash_build.stages.mix.checks import MixError as MixError
from dflash_build.stages.mix.checks import check, deviations, floor_shortfalls, missed_floors
from dflash_build.stages.mix.checks import missed_shares as missed_shares
from dflash_build.stages.mix.drafting import DraftTally
from dflash_build.store import atomic, layout
from dflash_build.store import records as R
from dflash_build.versions import MIX_VERSION

log = logging.getLogger(__name__)
_SELECT_COLUMNS = ["prompt_id", "sample_idx", "turn", "source", "category", "language", "n_tokens"]


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


def sample_ranks(
    seed: int, prompt_ids: pa.ChunkedArray | pa.Array, sample_idx: np.ndarray, turn: np.ndarray | None = None
) -> np.ndarray:
    """Each sample's seeded rank: a hash of (seed, prompt_id, sample_idx, turn), the same in any shard
    order. A whole row (turn null) and a conversation's turn 0 rank as (seed, prompt_id, sample_idx)."""
    sample = np.asarray(sample_idx, dtype=np.uint64)
    if turn is not None:
        sample = sample + (np.asarray(turn, dtype=np.uint64) << np.uint64(32))
    seeds = np.full(len(sample), seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)  # arrays wrap silently; scalars warn
    salt = hashing.splitmix64(seeds * np.uint64(hashing.SPLITMIX_GAMMA) + sample)
    return hashing.splitmix64(hashing.hex_to_u64(prompt_ids) ^ salt)


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


def held_out_ids(plan: Plan) -> np.ndarray:
    """Every prompt id the training set must not hold (config key `eval`): those a source holds out, and
    with dedup.near every prompt of any source that shares a band key with one of them (a near-copy).
    Read beside the manifests (the mix's declared inputs)."""
    if plan.config.held_out is None:
        return np.zeros(0, dtype=np.uint64)
    ids = [hashing.hex_to_u64(pq.read_table(plan.held_out_file(s), columns=["prompt_id"]).column("prompt_id"))
           for s in plan.sources]  # fmt: skip
    if plan.config.dedup.near is not None:
        keys = np.concatenate([neardup.read_bands(plan.held_out_bands_file(s))[1] for s in plan.sources])
        for source in plan.sources:
            pids, bands = neardup.read_bands(plan.prompt_bands(source))
            near = np.zeros(len(pids), dtype=bool)
            for band in range(keys.shape[1]):
                near |= np.isin(bands[:, band], keys[:, band])
            ids.append(np.asarray(pids, dtype=np.uint64)[near])
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, dtype=np.uint64)


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


def _eligible(
    cand: _Candidates, names: list[str], cross: crosssource.CrossSource | None, held: np.ndarray
) -> np.ndarray:
    """The samples the mix may take: all but those of prompts another source keeps, and those ``held``
    marks, of prompts any source holds out for the eval split (a copy another source trains on, where its
    cap stopped the draw)."""
    eligible = ~held
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
    generated: dict[str, Counter[str]]  # tokens of every sample that reached the mix, by category and by source
    cross: crosssource.CrossSource | None
    floors: dict[str, dict[str, dict[str, Any]]]  # mix.languages: category -> language -> what it got
    drawn: Counter[str]  # variant sources: prompts drawn to each that reached the mix (variants)
    taken: Counter[str]  # variant sources: distinct prompts the dataset takes of each
    held_out_samples: int = 0  # samples of held-out prompts (config eval) another source generated
    by_acceptance: dict[str, Any] = field(default_factory=dict)  # mix.by_acceptance: what each part chose


def choose(plan: Plan, shards: Mapping[str, list[Path]]) -> _Choice:
    """Select the samples (about 30 bytes each in memory) of the token ``shards`` (by source) and check
    the result, before anything is written."""
    cfg = plan.config
    # by source name and shard: the dataset's row order does not depend on the config's source order
    names = sorted(plan.sources)
    inputs = [(source, path) for source in names for path in shards[source]]
    shares = dict(cfg.mix_categories)
    categories = list(shares)
    cand = _candidates(cfg.mix_seed, [(names.index(s), p) for s, p in inputs], categories)
    cross = crosssource.load(plan)
    held = np.isin(cand.prompt_id, held_out_ids(plan))
    eligible = _eligible(cand, names, cross, held)
    available = cand.available(cand.category, categories, eligible)
    floors = {c: dict(f) for c, f in cfg.mix_languages.items()}
    by_language = cand.by_language(categories, eligible) if floors else {}  # only floors need it
    targets = category_targets(shares, dict(available), cfg.mix_budget_tokens, floors, by_language)
    chosen = np.zeros(len(cand.rank), dtype=bool)
    chosen_tokens: Counter[str] = Counter()
    rules = cfg.mix_by_acceptance
    taus = by_acceptance.tau([p for _, p in inputs], len(cand.rank)) if rules else np.zeros(0)
    drawn: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # mix.by_acceptance: each category's members, hard part
    for code, category in enumerate(categories):
        members = np.flatnonzero((cand.category == code) & eligible)
        if category in rules:
            by_rank, hard = by_acceptance.order(
                members, cand.rank, cand.n_tokens, taus, targets[category], rules[category]
            )
            drawn[category] = (members, hard)
        else:
            by_rank = members[np.argsort(cand.rank[members], kind="stable")]
        take = _fill(cand, by_rank, targets[category], floors.get(category))
        chosen[take] = True
        chosen_tokens[category] += int(cand.n_tokens[take].sum(dtype=np.int64))
    chose = {c: by_acceptance.report(rules[c], hard, members, chosen, taus, cand.n_tokens)
             for c, (members, hard) in drawn.items()}  # fmt: skip
    reached = {}
    if floors:
        reached = _floors_reached(floors, cand.by_language(categories, chosen), chosen_tokens, by_language)
    by_source = cand.available(cand.source, names, eligible)
    every = np.ones(len(cand.rank), dtype=bool)
    generated = {
        "category": cand.available(cand.category, categories, every),
        "source": cand.available(cand.source, names, every),
    }
    prompts_drawn, taken = Counter[str](), Counter[str]()
    if variants.has_variants(plan):
        prompts_drawn = variants.drawn_prompts(plan)
        prompts_drawn.subtract({n: len(cross.dropped.get(n, ())) for n in prompts_drawn} if cross is not None else {})
        taken = variants.prompts_taken(cand.prompt_id, cand.source, chosen, names)
    missed = missed_floors(plan, reached, targets) + variants.missed(plan, prompts_drawn, taken)
    check(plan, shards, shares, targets, chosen_tokens, available, by_source, cross, missed)
    copies = int(held.sum())
    return _Choice(
        inputs, chosen, cand.offsets, shares, targets, available, generated, cross, reached, prompts_drawn, taken,
        copies, chose,
    )  # fmt: skip


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
    variants: variants.VariantTally = field(default_factory=variants.VariantTally)
    drafting: DraftTally = field(default_factory=DraftTally)
    files: list[dict[str, Any]] = field(default_factory=list)

    def add(self, table: pa.Table, source: str, category: str, variant: str | None) -> None:
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
        if variant is not None:
            self.variants.add(table, variant, category)
        self.drafting.add(table, source, category, variant)


def _drafter(cfg: Config) -> dict[str, Any] | None:
    if cfg.engine.drafter is None:
        return None
    skipped = {"parity_skipped": True} if cfg.preflight.skip_parity else {}  # the card says so
    return {**dataclasses.asdict(cfg.engine.drafter), **skipped}


def params(cfg: Config) -> dict[str, Any]:
    """What the mix depends on besides its input shards: the mix rule's params, so that a mix edit (shares,
    budget, seed) or a changed check (a tightened tolerance is checked again, nothing regenerated) reruns
    it through the params trigger; ``ops.standing`` compares them with those Snakemake recorded."""
    checks = cfg.checks
    return {
        "categories": dict(cfg.mix_categories),
        "budget_tokens": cfg.mix_budget_tokens,
        "seed": cfg.mix_seed,
        "languages": {c: dict(f) for c, f in cfg.mix_languages.items()},
        # only where set: a config without it keeps the params (and the dataset) it had
        **(
            {"by_acceptance": {c: r.mix_params() for c, r in rules.items()}} if (rules := cfg.mix_by_acceptance) else {}
        ),
        "rows_per_file": cfg.rows_per_file,
        "dedup": {"across_sources": cfg.dedup.across_sources, "priority": cfg.dedup.source_priority(cfg.sources)},
        "checks": {"share_tolerance": checks.share_tolerance, "allow_shortfall": sorted(checks.allow_shortfall)},
        "scheme": MIX_VERSION,
    }


def run(job: Job) -> dict[str, Any]:
    """Select the samples of the job's token shards and write the dataset, in memory that grows only with
    the number of samples, never with their size.

    The dataset is a new version of ``dataset.out/NAME``, swapped in only once it is whole and passed its
    checks (:mod:`dflash_build.publish.release`); the job's output is the build record.
    """
    plan = job.plan
    cfg = plan.config
    shards = job.by_source("tokens")
    choice = choose(plan, shards)
    with release.publish(job.published("record"), job.output("record")) as tmp:
        written = _write(plan, choice, tmp / "data")
        killpoints.die_at("mix")
        manifest = _manifest(plan, choice, written, shards, job.inputs["manifests"])
        report.write_tables(tmp, manifest)
        manifest["tables"] = list(report.TABLES)
        manifest["plots"] = plots.write_plots(tmp, manifest, written.tally)
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
        # shards tokenized before a column was added read it as nulls: one schema for every file
        table = R.conform(pq.read_table(path).take(pa.array(rows, type=pa.int64())), R.SAMPLE_SCHEMA)
        spec = plan.sources[source].spec
        written.add(table, source, spec.category, spec.variant)
        writer.write(table)
        del table
    written.files = writer.close()
    return written


def _evaluation(cfg: Config, choice: _Choice) -> dict[str, Any]:
    """Config eval: the split held out of the dataset, beside it, and where `accept` reports on it (the
    manifest's ``evaluation``); nothing without eval."""
    if cfg.held_out is None:
        return {}
    where = {"split": cfg.eval_dir.name, "acceptance": cfg.acceptance_dir.name}
    return {"evaluation": {**where, "held_out_samples_left_out": choice.held_out_samples}}


def _category_entries(choice: _Choice, written: _Written) -> dict[str, dict[str, Any]]:
    tokens = written.tokens_by["category"]
    total = sum(tokens.values())
    return {
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


def _manifest(
    plan: Plan, choice: _Choice, written: _Written, shards: Mapping[str, list[Path]], manifests: Sequence[Path]
) -> dict[str, Any]:
    cfg = plan.config
    tokens = written.tokens_by["category"]
    total = sum(tokens.values())
    all_lengths = np.concatenate(written.lengths) if written.lengths else np.zeros(0, dtype=np.int32)
    below, above = deviations(choice.shares, choice.targets, tokens, choice.available, cfg.mix_budget_tokens)
    below += floor_shortfalls(choice.floors)
    categories = _category_entries(choice, written)
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
        "use": _use(choice, written, _built_unread(plan, shards)),
        # sampling variants (config variants): drawn, held, and their samples; absent without variants
        **(
            {"variants": variants.report(plan, choice.drawn, choice.taken, written.variants)}
            if variants.has_variants(plan)
            else {}
        ),
        "cross_source": choice.cross.report() if choice.cross is not None else None,
        # mix.by_acceptance: the rows each part of the rule chose, τ chosen against left out (absent otherwise)
        **({"by_acceptance": choice.by_acceptance} if choice.by_acceptance else {}),
        # where engine.drafter served generation: τ per slice of the dataset's own rows (absent otherwise)
        **({"drafting": drafted} if (drafted := written.drafting.report(_drafter(cfg))) is not None else {}),
        **_evaluation(cfg, choice),
        "prompts": _prompt_summaries(manifests),
        "shortfalls": below,  # where the dataset ends below its configured mix
        "overshoots": above,
        "sources": {name: _source_entry(plan, name, written, shards[name]) for name in plan.sources},
        "model": {"path": cfg.model.path, "revision": cfg.model.revision},
        "model_fingerprint": plan.model_fingerprint,
        "template_fingerprint": plan.template_fingerprint,
        "finish_reasons": dict(sorted(written.finish.items())),
        "degenerate": report.degenerate_counts(plan, shards),
        "length": length_stats(all_lengths),
        "report": report.tables(plan, written.tally),
    }


def _built_unread(plan: Plan, shards: Mapping[str, list[Path]]) -> dict[str, dict[str, int]]:
    """Token shards of this config built earlier that the mix does not read (mix.generate as_needed: past
    what the current sizing names), per source: their shards and tokens, from their stats sidecars. Only
    counted for the card (the GPU time they cost is spent; a grown need uses them), never mixed."""
    read = {Path(p) for paths in shards.values() for p in paths}
    out: dict[str, dict[str, int]] = {}
    for name in plan.sources:
        for path in plan.token_shards(name):
            if path not in read and (stats_file := layout.sidecar(path)).exists():
                got = out.setdefault(name, {"shards": 0, "tokens": 0})
                got["shards"] += 1
                got["tokens"] += int(json.loads(stats_file.read_text())[R.STAT_TOKENS])
    return out


def _use(choice: _Choice, written: _Written, unread: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Generated against used: the tokens (prompts and answers) of every sample that reached the mix,
    and those the dataset took, by category and by source; the share is the headline of what the GPU
    time bought. ``unread``: what was generated earlier for shards the mix does not read (as_needed)."""
    generated = sum(choice.generated["category"].values())
    used = sum(written.tokens_by["category"].values())
    return {
        "generated_tokens": generated,
        "used_tokens": used,
        "used_share": round(used / generated, 6) if generated else 0.0,
        "unread": unread,
        **{
            f"by_{col}": {
                name: {"generated_tokens": n, "used_tokens": written.tokens_by[col][name]}
                for name, n in choice.generated[col].items()
            }
            for col in ("category", "source")
        },
    }


def _source_entry(plan: Plan, name: str, written: _Written, shards: list[Path]) -> dict[str, Any]:
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
        "shards": [str(p) for p in shards],
    }


def _prompt_summaries(manifests: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Prepare's accounting of each source, from its prompt manifest: rows in and out, drops, examples."""
    keys = (R.PROMPTS_ROWS_IN, R.PROMPTS_ROWS_OUT, R.PROMPTS_DROPS, R.PROMPTS_DROP_EXAMPLES, R.PROMPTS_REFERENCES)
    read = [json.loads(path.read_text()) for path in manifests]
    return {m["source"]: {k: m[k] for k in keys if k in m} for m in sorted(read, key=lambda m: m["source"])}
