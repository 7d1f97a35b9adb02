"""`dflash-build plan`: what a build would generate, reuse and cost, per source, before it runs."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_build.hashing import canonical_json
from dflash_build.ops import forecast, standing
from dflash_build.ops.window import TurnWindow, turn_windows
from dflash_build.plan import Plan
from dflash_build.spec import TrainerSpec
from dflash_build.stages import generate, prepare, size
from dflash_build.stages import registry as stages
from dflash_build.stages.common import crosssource, neardup
from dflash_build.stages.generate.reuse import reuse, reuse_conversations
from dflash_build.stages.generate.work import ShardPaths
from dflash_build.store import filesystem, layout
from dflash_build.store import records as R
from dflash_build.store.journal import PUBLISHED_DATA, ROWS_FILE, Journal, answers
from dflash_build.store.rowindex import RowIndex

log = logging.getLogger(__name__)
DEFAULT_TOKENS_PER_SECOND = 2000.0  # per GPU, when the store has no measured shard yet


@dataclass
class SourceEstimate:
    source: str
    prompt_rows: int
    prompt_rows_known: bool  # False: prompts not prepared yet, an upper bound
    shards: int
    completions_built: int
    tokens_built: int
    generate_jobs: list[str] = field(default_factory=list)
    rows_in_jobs: int = 0
    rows_journaled: int = 0
    rows_reused: int = 0
    rows_continued: int = 0  # truncated earlier rows the engine extends (part of rows_to_generate)
    rows_to_generate: int = 0
    output_tokens: float = 0.0
    gpu_hours: float = 0.0
    errors: list[str] = field(default_factory=list)  # what would fail the build before any GPU work
    window: WindowEffect | None = None  # with trainer.max_length: its effect on the rows to generate
    cross_source_prompts: int = 0  # prompts another source holds too and keeps: the mix leaves them out
    rows_copies_skipped: int = 0  # of the rows in its jobs, copies of a ranked source's: skipped, never generated
    cross_source_gpu_hours: float = 0.0  # what generating those rows would have cost
    outside_window: TurnWindow | None = None  # prepared prompts trainer.max_length leaves out, by turn position
    variant: str | None = None  # the sampling variant (config variants) the source generates under
    # shards a standing dataset was built from that the store lost (ops.standing): a build makes them
    # only when it makes that dataset again, so they are not among generate_jobs; what they would generate
    held_jobs: list[str] = field(default_factory=list)
    rows_held: int = 0
    rows_held_reused: int = 0
    # the rows prepare leaves out of the source, by reason (its manifest, else its selection run here)
    drops: dict[str, int] = field(default_factory=dict)


WINDOW_SAMPLE_SHARDS = 64  # completion shards of this model read for the window's estimate (bounded time)


@dataclass
class WindowEffect:
    """What trainer.max_length does to the rows a source still has to generate, estimated from the
    prompt and answer lengths of this model's answers in the store that no window cut."""

    sample_rows: int
    output_tokens: float  # with the window
    output_tokens_without: float  # without it: each answer up to max_new_tokens
    past_window_tokens: float  # without it: generated past the window, so cut by the trainer
    dropped_rows: float  # without it: answers at max_new_tokens that `truncated: drop` throws away whole
    skipped_rows: float  # with it: prompts that leave fewer than trainer.min_new_tokens


def window_effect(
    lengths: list[tuple[int, int]], rows: int, max_new_tokens: int, trainer: TrainerSpec, drop: bool
) -> WindowEffect | None:
    """The window's effect on ``rows`` answers drawn like ``lengths`` ((prompt, answer) token counts);
    ``drop``: `truncated: drop`."""
    if trainer.max_length is None or not lengths:
        return None
    scale = rows / len(lengths)
    with_window = without = past = dropped = skipped = 0.0
    for prompt, answer in lengths:
        generated = min(answer, max_new_tokens)
        without += generated
        budget = trainer.budget(max_new_tokens, prompt)
        if answer >= max_new_tokens and drop:
            dropped += 1
        else:
            past += max(0, generated - max(budget, 0))
        if trainer.leaves_too_little(budget):
            skipped += 1
        else:
            with_window += min(generated, budget)
    return WindowEffect(
        len(lengths), with_window * scale, without * scale, past * scale, dropped * scale, skipped * scale
    )


def _model_sidecars(plan: Plan) -> list[tuple[Path, dict[str, Any]]]:
    """The completion sidecars in the store of this config's model, with their paths."""
    found = []
    for stats_file in layout.store_sidecars(plan.config.store, layout.COMPLETIONS):
        stats = json.loads(stats_file.read_text())
        if stats.get("components", {}).get("model") == plan.model_fingerprint["digest"]:
            found.append((stats_file, stats))
    return found


def _answer_lengths(sidecars: list[tuple[Path, dict[str, Any]]]) -> list[tuple[int, int]]:
    """(prompt, answer) token counts of these shards' answers that no trainer window cut."""
    lengths: list[tuple[int, int]] = []
    for stats_file, _ in sidecars[:WINDOW_SAMPLE_SHARDS]:
        data = layout.data_of(stats_file)
        if not data.exists():
            continue
        table = pq.read_table(data, columns=["n_prompt_tokens", "n_output_tokens", "finish_reason"]).to_pylist()
        lengths += [
            (r["n_prompt_tokens"], r["n_output_tokens"])
            for r in table
            if r["finish_reason"] in (R.FINISH_STOP, R.FINISH_LENGTH)
        ]
    return lengths


def _measured(sidecars: list[tuple[Path, dict[str, Any]]]) -> tuple[float | None, float | None]:
    """Mean output tokens per row and output tok/s per job, from these shards."""
    rows = tokens = 0
    rates: list[float] = []
    for _, stats in sidecars:
        generated = stats.get(R.STAT_GENERATED, stats.get(R.STAT_INPUT_ROWS, 0))
        if generated:
            rows += stats[R.STAT_INPUT_ROWS]
            tokens += stats[R.STAT_OUTPUT_TOKENS]
            if stats.get(R.STAT_OUTPUT_TOK_PER_S):
                rates.append(stats[R.STAT_OUTPUT_TOK_PER_S])
    return (tokens / rows if rows else None), (sum(rates) / len(rates) if rates else None)


def preflight_speed(plan: Plan) -> dict[str, Any] | None:
    """The last preflight's output tok/s per GPU for this config (at the build's own batch where its speed
    source generated; else over the whole pilot), when it passed: `plan`'s speed until a shard is measured."""
    path = Path(layout.preflight_summary(plan.config.logs, plan.config.dataset_name))
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pilot = summary.get("pilot") or {}
    rate = pilot.get("speed_tokens_per_second") or pilot.get("tokens_per_second_per_gpu")
    if summary.get("verdict") != "PASS" or not rate:
        return None
    return {"tokens_per_second": float(rate), "at": summary.get("at"), "path": str(path), "gpus": pilot.get("gpus")}


def _variant_means(sidecars: list[tuple[Path, dict[str, Any]]]) -> dict[str | None, float | None]:
    """Mean output tokens per row under each sampling variant whose shards are in the store (a thinking
    variant's answers run longer than the model's mean)."""
    by_variant: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, stats in sidecars:
        if stats.get("variant") is not None:
            by_variant.setdefault(stats["variant"], []).append((path, stats))
    return {variant: _measured(found)[0] for variant, found in by_variant.items()}


# Bytes the store gains per generated output token (its journal line, completion and token shards, the
# prompt ids in them included) before any shard is measured; measured on the demo (short answers, so
# prompts weigh more than in production, where this overestimates).
ASSUMED_BYTES_PER_OUTPUT_TOKEN = 40.0
# Files a shard's generate and tokenize jobs add (journal rows and lock, completion and token shards with
# their sidecars, two logs): each takes at least one filesystem block, which small shards feel.
FILES_PER_SHARD = 8


@dataclass(frozen=True)
class DiskNeed:
    """What the remaining work writes to the store, against its filesystem's free space."""

    store: Path
    bytes: float
    per_token: float
    measured: bool  # per_token from this model's shards in the store (else the assumption)
    free: int
    min_free_gb: float

    def line(self) -> str:
        how = "measured on this model's shards" if self.measured else "assumed: no shard measured yet"
        return (
            f"disk: the remaining work writes about {filesystem.size_text(self.bytes)} to {self.store} "
            f"({self.per_token:.0f} bytes per output token, {how}); {filesystem.describe(self.store)}"
        )

    def problems(self) -> tuple[list[str], list[str]]:
        """(warnings, errors): the estimate over the free space; the free space under checks.min_free_gb."""
        warnings, errors = [], []
        if self.bytes > self.free:
            warnings.append(
                f"the store's filesystem has {filesystem.size_text(self.free)} free, less than the "
                f"{filesystem.size_text(self.bytes)} the remaining work is estimated to write: free space (or "
                "move `store:`) before the disk fills mid-run"
            )
        if (why := filesystem.below_floor(self.store, self.free, self.min_free_gb)) is not None:
            errors.append(f"{why}: a build refuses to start")
        return warnings, errors


def _bytes_per_output_token(plan: Plan, sidecars: list[tuple[Path, dict[str, Any]]]) -> float | None:
    """What this model's shards in the store take per output token: completion shard, journal, token shard."""
    store, nbytes, tokens = plan.config.store, 0, 0
    for stats_file, stats in sidecars[:WINDOW_SAMPLE_SHARDS]:
        data, shard = layout.data_of(stats_file), layout.shard_of(stats_file)
        source = stats_file.parent.parent.name
        parts = [data, layout.journal_dir(store, stats_file.parent.name, shard) / ROWS_FILE]
        parts += layout.shard_files(store, layout.TOKENS, source, shard)
        nbytes += sum(p.stat().st_size for p in parts if p.exists())
        tokens += stats.get(R.STAT_OUTPUT_TOKENS, 0)
    return nbytes / tokens if tokens else None


def disk_need(plan: Plan, estimates: list[SourceEstimate], sidecars: list[tuple[Path, dict[str, Any]]]) -> DiskNeed:
    measured = _bytes_per_output_token(plan, sidecars)
    per_token = measured if measured is not None else ASSUMED_BYTES_PER_OUTPUT_TOKEN
    free, _ = filesystem.free_bytes(plan.config.store)
    jobs = sum(len(e.generate_jobs) for e in estimates)
    need = per_token * sum(e.output_tokens for e in estimates) + jobs * FILES_PER_SHARD * filesystem.block_size(
        plan.config.store
    )
    return DiskNeed(plan.config.store, need, per_token, measured is not None, free, plan.config.checks.min_free_gb)


def disk_at_start(plan: Plan) -> DiskNeed:
    """The build's start: the same comparison from shard counts alone (every missing shard's rows generated,
    none reused), so that it costs no selection and no index lookup."""
    sidecars = _model_sidecars(plan)
    mean_tokens, _ = _measured(sidecars)
    estimates = []
    for name, sp in plan.sources.items():
        sampling = sp.spec.sampling
        missing = [s for s, p in zip(sp.shards, plan.completion_shards(name), strict=True) if not p.exists()]
        per_row = min(mean_tokens or sampling.max_new_tokens / 2, sampling.max_new_tokens)
        rows = sp.planned_rows * len(missing) / sp.n_shards * sampling.samples_per_prompt
        est = SourceEstimate(name, sp.planned_rows, False, sp.n_shards, 0, 0, missing, output_tokens=rows * per_row)
        estimates.append(est)
    return disk_need(plan, estimates, sidecars)


def warn_at_start(plan: Plan) -> None:
    """At the build's start: say so when the remaining work may not fit on the store's filesystem."""
    need = disk_at_start(plan)
    for warning in need.problems()[0]:
        log.warning("%s (%s)", warning, need.line())


def estimate_with_disk(
    plan: Plan, default_tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND
) -> tuple[list[SourceEstimate], DiskNeed, forecast.MixForecast]:
    """What a build of the current config would do, per source, what it writes to the store, and what
    the mix will take of it (the forecast, from this config's prompts: prepared counts where known)."""
    # read once: rates, mean answer, the window's sample, bytes per token, each source's lengths
    sidecars = _model_sidecars(plan)
    mean_tokens, rate = _measured(sidecars)
    if rate is None and (measured := preflight_speed(plan)) is not None:
        rate = measured["tokens_per_second"]
    lengths = _answer_lengths(sidecars) if plan.config.trainer.max_length else []
    windows = {w.source: w for w in turn_windows(plan)}
    selections: dict[str, prepare.Selection] = {}
    cross, copies = _cross_source(plan, selections)
    lost = standing.standing(plan)
    held = frozenset(lost.missing) if lost is not None else frozenset()
    as_needed = plan.config.mix_generate == "as_needed"
    replayed = size.replay(plan) if as_needed else None  # once: it reads every sized shard's sidecar
    sized = _wanted(plan, replayed) if as_needed else {}
    with RowIndex.open(plan.config.store, readonly=True) as index:  # inspection writes nothing
        means = {None: mean_tokens, **_variant_means(sidecars)}
        estimates = _estimate(
            plan, index, means, rate, default_tokens_per_second, lengths, selections, copies, sized, held
        )
    _cross_source_cost(estimates, cross)
    for e in estimates:
        e.outside_window = windows.get(e.source)
    # a prompt the window skips at its first turn gives the mix nothing
    prompt_rows = {
        e.source: e.prompt_rows - round(e.outside_window.scaled(0) if e.outside_window else 0) for e in estimates
    }
    source_lengths = forecast.source_lengths(plan, sidecars)
    mix = forecast.forecast(plan, prompt_rows, source_lengths, rate or default_tokens_per_second)
    if replayed is not None:
        counts = replayed.shards
        mix = dataclasses.replace(
            mix,
            as_needed={n: (counts[n], sp.n_shards) for n, sp in plan.sources.items()},
            replayed_built={n: sum(p.exists() for p in plan.completion_shards(n)[: counts[n]]) for n in plan.sources},
            replayed_estimated=tuple(replayed.estimated),
        )
    return estimates, disk_need(plan, estimates, sidecars), mix


def wanted_shards(plan: Plan) -> dict[str, int]:
    """Under mix.generate as_needed, how many of each source's shards the build will generate as the store
    stands: the sizing its size jobs will run, replayed on what they will measure (a changed share, budget
    or weight sizes again, as the size jobs' params trigger makes them), the pilot's alone while a pilot is
    not built; empty under all."""
    if plan.config.mix_generate != "as_needed":
        return {}
    return _wanted(plan, size.replay(plan))


def _wanted(plan: Plan, replayed: size.Replayed | None) -> dict[str, int]:
    """The shards per source of the replayed sizing, the pilot's while there is none (as_needed)."""
    return replayed.shards if replayed is not None else size.sized_counts(plan, None)


def unlisted_by_dry_run(plan: Plan) -> list[str] | None:
    """Under mix.generate as_needed: the generate jobs (SOURCE/SHARD) a build will run that ``snakemake -n``
    cannot list, since they come after a size checkpoint that will run again (its sizing missing or stale,
    or its shards still to build); None while a pilot is not built (the size jobs decide everything after
    it); empty under all, or when the dry run lists every job."""
    cfg = plan.config
    if cfg.mix_generate != "as_needed":
        return []
    replayed = size.replay(plan)
    if replayed is None:
        return None
    listed = size.sized_counts(plan, None)  # the pilot's jobs are always listed
    params = json.loads(canonical_json(stages.get("size").params(plan, stages.Of())))  # what its rule triggers on
    for round_ in layout.SIZING_ROUNDS:
        path = Path(layout.sizing_file(cfg.logs, cfg.dataset_name, round_))
        reads = [p for n in plan.sources for p in plan.token_shards(n)[: listed[n]]]
        record = json.loads(path.read_text()) if path.exists() else None
        if record is None or record.get("params") != params:
            break
        if not all(layout.sidecar(p).exists() for p in reads):
            break
        listed = size.sized_counts(plan, path)
    wanted = replayed.shards
    return [
        f"{name}/{shard}"
        for name, sp in plan.sources.items()
        for shard, path in list(zip(sp.shards, plan.completion_shards(name), strict=True))[listed[name] : wanted[name]]
        if not path.exists()
    ]


def dry_run_note(plan: Plan) -> str | None:
    """Under mix.generate as_needed, what a dry run cannot list: the generate jobs after a size checkpoint
    that runs again (Snakemake decides them only once it has run); None when it lists every job."""
    unlisted = unlisted_by_dry_run(plan)
    if unlisted is None:
        return (
            "dflash-build: mix.generate is as_needed: this dry run lists the pilot (each source's first shard); "
            "the size checkpoints decide the shards after it once the pilot is built (`dflash-build plan` "
            "forecasts them)"
        )
    if not unlisted:
        return None
    shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
    return (
        f"dflash-build: {len(unlisted)} generate jobs not listed below will run too: they come after a size "
        f"checkpoint that runs again (mix.generate: as_needed), which a dry run cannot run: {shown}; "
        "`dflash-build plan --jobs` lists them with their rows"
    )


def _cross_source(
    plan: Plan, selections: dict[str, prepare.Selection]
) -> tuple[crosssource.CrossSource | None, dict[str, set[str]]]:
    """(what the mix will leave out across sources, each source's prompts that its generate jobs skip:
    those a source dedup.prefer ranks above it keeps). Near-copies count once every source is prepared
    (their band keys are written then); before, exact copies only. ``selections``: filled with the
    selections run here (CPU only) for the estimate."""
    if not plan.config.dedup.across_sources or len(plan.sources) < 2:
        return None, {}
    bands: dict[str, Any] | None = None
    if plan.config.dedup.near is not None and all(plan.prompt_bands(n).exists() for n in plan.sources):
        bands = {}
    prompts: dict[str, Any] = {}
    for name, sp in plan.sources.items():
        if bands is not None:
            prompts[name], bands[name] = neardup.read_bands(plan.prompt_bands(name))
        elif plan.prompt_manifest(name).exists():
            prompts[name] = crosssource.prompt_ids(plan, name)
        elif sp.spec.hf is None or sp.spec.hf.is_local:
            selections[name] = selections.get(name) or prepare.select(plan, name)
            prompts[name] = selections[name].selected
    copies = {}
    for name, sp in plan.sources.items():
        if name in prompts and any(a in prompts for a in sp.above):
            skipped = crosssource.against_ranked(plan, name, prompts, bands).dropped[name]
            copies[name] = {f"{int(i):016x}" for i in skipped}
    return crosssource.resolve_within_variants(plan, prompts, bands), copies


def _cross_source_cost(estimates: list[SourceEstimate], cross: crosssource.CrossSource | None) -> None:
    """Each source's copies the mix leaves out, and the GPU-hours its skipped rows save."""
    rows = sum(e.rows_to_generate for e in estimates)
    hours_per_row = sum(e.gpu_hours for e in estimates) / rows if rows else 0.0
    for e in estimates:
        e.cross_source_prompts = len(cross.dropped.get(e.source, ())) if cross is not None else 0
        e.cross_source_gpu_hours = e.rows_copies_skipped * hours_per_row


def _estimate(
    plan: Plan,
    index: RowIndex,
    means: dict[str | None, float | None],
    rate: float | None,
    default_tokens_per_second: float,
    lengths: list[tuple[int, int]],
    selections: dict[str, prepare.Selection],
    copies: dict[str, set[str]],
    sized: dict[str, int],
    held: frozenset[str],
) -> list[SourceEstimate]:
    """``selections``: prepare's selection of sources not prepared yet, run once (shared with the
    cross-source count); ``copies``: each source's prompts a source ranked above keeps (skipped);
    ``means``: output tokens per row, the model's (None) and under each sampling variant measured;
    ``sized``: the shards per source the build generates (mix.generate as_needed; empty: all of them);
    ``held``: the missing shards (SOURCE/SHARD) a standing dataset holds, counted apart."""
    out = []
    for name, sp in plan.sources.items():
        sampling = sp.spec.sampling
        manifest_file = plan.prompt_manifest(name)
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
        est = SourceEstimate(
            source=name,
            prompt_rows=manifest[R.PROMPTS_ROWS_OUT] if manifest else sp.planned_rows,
            prompt_rows_known=manifest is not None,
            shards=sp.n_shards,
            completions_built=sum(p.exists() for p in plan.completion_shards(name)),
            tokens_built=sum(p.exists() for p in plan.token_shards(name)),
            variant=sp.spec.variant,
            drops=dict(manifest.get(R.PROMPTS_DROPS, {})) if manifest else {},
        )
        ids_of = _ShardIds(plan, name, est, selections)
        wanted = sized.get(name, sp.n_shards)
        apart = SourceEstimate(name, 0, True, 0, 0, 0)  # the held shards, counted as jobs are
        for shard, path in zip(sp.shards[:wanted], plan.completion_shards(name)[:wanted], strict=True):
            if not path.exists():
                into = apart if f"{name}/{shard}" in held else est
                into.generate_jobs.append(f"{name}/{shard}")
                _count_rows(plan, index, name, shard, ids_of(shard), into, copies.get(name, set()))
        est.held_jobs, est.rows_held = apart.generate_jobs, apart.rows_to_generate
        est.rows_held_reused = apart.rows_reused + apart.rows_journaled
        mean_tokens = means.get(sp.spec.variant) or means[None]
        per_row = mean_tokens if mean_tokens is not None else sampling.max_new_tokens / 2
        est.output_tokens = est.rows_to_generate * min(per_row, sampling.max_new_tokens)
        drop = plan.config.truncated == "drop"
        est.window = window_effect(lengths, est.rows_to_generate, sampling.max_new_tokens, plan.config.trainer, drop)
        if est.window is not None:
            est.output_tokens = est.window.output_tokens
        est.gpu_hours = est.output_tokens / (rate or default_tokens_per_second) / 3600
        out.append(est)
    return out


class _ShardIds:
    """A shard's prompt ids: from its prompt shard, else from prepare's selection run in memory (once a
    source, CPU only), or None for a hub source (never loaded to plan)."""

    def __init__(self, plan: Plan, source: str, est: SourceEstimate, selections: dict[str, prepare.Selection]) -> None:
        self.plan, self.source, self.est, self.selections = plan, source, est, selections
        self.by_shard: dict[str, list[str]] | None = None

    def __call__(self, shard: str) -> list[str] | None:
        plan, sp = self.plan, self.plan.sources[self.source]
        prompt_shard = layout.shard_file(plan.prompt_dir(self.source), shard)
        if prompt_shard.exists():
            return pq.read_table(prompt_shard, columns=["prompt_id"])["prompt_id"].to_pylist()
        if sp.spec.hf is not None and not sp.spec.hf.is_local:
            return None
        if self.by_shard is None:
            selection = self.selections.get(self.source) or prepare.select(plan, self.source)
            self.selections[self.source] = selection
            self.by_shard = selection.shard_prompt_ids()
            self.est.prompt_rows, self.est.prompt_rows_known = selection.rows_out, True
            self.est.drops = dict(sorted(selection.drops.counts.items()))
            try:  # the check its prepare job will make: a lost source is found before generation
                prepare.check_losses(sp.spec, selection)
            except prepare.SourceLossError as e:
                self.est.errors.append(str(e))
        return self.by_shard[shard]


def _count_rows(
    plan: Plan,
    index: RowIndex,
    source: str,
    shard: str,
    ids: list[str] | None,
    est: SourceEstimate,
    copies: set[str],
) -> None:
    """Add one shard's rows to ``est``: journaled, reused from the row index, skipped as copies another
    source keeps, or to generate."""
    sp = plan.sources[source]
    sampling = sp.spec.sampling
    if ids is None:  # a hub source: the upper bound, every row generated, none reused
        lo, hi = prepare.shard_bounds(sp.planned_rows, sp.n_shards)[int(shard)]
        est.rows_in_jobs += (hi - lo) * sampling.samples_per_prompt
        est.rows_to_generate += (hi - lo) * sampling.samples_per_prompt
        return
    wanted = {(pid, i) for pid in ids for i in range(sampling.samples_per_prompt)}
    est.rows_in_jobs += len(wanted)
    skipped = {(pid, i) for pid, i in wanted if pid in copies}
    est.rows_copies_skipped += len(skipped)
    wanted -= skipped
    journal_dir = plan.journal_dir(source, shard)
    if (journal_dir / PUBLISHED_DATA).exists():  # published before: the job restores it
        est.rows_journaled += len(wanted)
        return
    journaled = answers(Journal.read(journal_dir / ROWS_FILE))  # a rejected attempt's row is asked again
    if journaled:
        done = {(r["prompt_id"], r["sample_idx"]) for r in journaled}
        est.rows_journaled += len(wanted & done)
        wanted -= done
    taken, continued = _reused(plan, index, source, shard, wanted)
    est.rows_reused += len(taken)
    est.rows_continued += len(continued)
    est.rows_to_generate += len(wanted - taken)


def _reused(
    plan: Plan, index: RowIndex, source: str, shard: str, wanted: set[tuple[str, int]]
) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """(rows the job takes from earlier completions, truncated ones the engine continues) of ``wanted``.
    Single-turn rows generated with this source's settings are taken as their index entry says; where
    some come from other settings (a template edit, a scheme bump), and for conversations (whose turns'
    budgets are checked one by one), the shard's requests are rendered and checked as the job checks
    them (stages.generate.reuse), so the count is the job's."""
    sp = plan.sources[source]
    key = sp.reuse_key if sp.spec.turns == "first" else sp.conversation_reuse_key
    found = index.lookup(key, wanted, sp.spec.sampling.max_new_tokens)
    other_settings = any(c.generation_key != sp.generation_key for cands in found.values() for c in cands)
    if found and (other_settings or sp.spec.turns != "first"):  # a conversation's budgets are per turn
        work = generate.open_shard(plan, source, shard, ShardPaths.of(stages.planned(plan, "generate", source, shard)))
        work.convs = {k: conv for k, conv in work.convs.items() if k in wanted}
        if sp.spec.turns == "first":
            reuse(work, None, index)
        else:
            reuse_conversations(work, None, index)
        done = {k for k, conv in work.convs.items() if conv.turns and conv.finish_reason is not None}
        return done, {k for k, conv in work.convs.items() if conv.prefix}
    limit = sp.spec.sampling.max_new_tokens
    taken = {pair for pair, cands in found.items() if cands[0].use_for(limit) != "continue"}
    return taken, set(found) - taken
