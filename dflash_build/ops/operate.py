"""Operating the store: plan, explain, gc and verify (the `dflash-build` commands).

Each function takes the build plan of the current config and returns plain data; ``cli`` prints it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dflash_build import hashing, keys
from dflash_build.config import Config, TrainerSpec
from dflash_build.dist import release
from dflash_build.plan import Plan, fingerprint_cache_file
from dflash_build.stages import crosssource, prepare
from dflash_build.store import atomic, layout, rowindex
from dflash_build.store.journal import PUBLISHED_DATA, PUBLISHED_STATS, ROWS_FILE, Journal, parse
from dflash_build.store.rowindex import RowIndex, reuse_key

DEFAULT_TOKENS_PER_SECOND = 2000.0  # per GPU, when the store has no measured shard yet


# -- plan -------------------------------------------------------------------------------------
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
    cross_source_prompts: int = 0  # prompts another source holds too and keeps (dedup.across_sources)
    cross_source_gpu_hours: float = 0.0  # what generating them for this source as well would cost


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
    window = trainer.max_length
    scale = rows / len(lengths)
    with_window = without = past = dropped = skipped = 0.0
    for prompt, answer in lengths:
        generated = min(answer, max_new_tokens)
        without += generated
        room = window - prompt
        if answer >= max_new_tokens and drop:
            dropped += 1
        else:
            past += max(0, generated - max(room, 0))
        if room < trainer.min_new_tokens:
            skipped += 1
        else:
            with_window += min(generated, room)
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
            (r["n_prompt_tokens"], r["n_output_tokens"]) for r in table if r["finish_reason"] in ("stop", "length")
        ]
    return lengths


def _measured(sidecars: list[tuple[Path, dict[str, Any]]]) -> tuple[float | None, float | None]:
    """Mean output tokens per row and output tok/s per job, from these shards."""
    rows = tokens = 0
    rates: list[float] = []
    for _, stats in sidecars:
        generated = stats.get("generated", stats.get("input_rows", 0))
        if generated:
            rows += stats["input_rows"]
            tokens += stats["output_tokens"]
            if stats.get("output_tokens_per_second"):
                rates.append(stats["output_tokens_per_second"])
    return (tokens / rows if rows else None), (sum(rates) / len(rates) if rates else None)


def estimate(plan: Plan, default_tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND) -> list[SourceEstimate]:
    """What a build of the current config would do, per source."""
    sidecars = _model_sidecars(plan)  # read once: rates, mean answer, and the window's sample
    mean_tokens, rate = _measured(sidecars)
    lengths = _answer_lengths(sidecars) if plan.config.trainer.max_length else []
    selected: dict[str, np.ndarray] = {}
    with RowIndex.open(plan.config.store) as index:
        estimates = _estimate(plan, index, mean_tokens, rate, default_tokens_per_second, lengths, selected)
    _cross_source(plan, estimates, selected)
    return estimates


def _cross_source(plan: Plan, estimates: list[SourceEstimate], selected: dict[str, np.ndarray]) -> None:
    """Each source's prompts that another source holds too and keeps, and their GPU-hours: the mix takes
    each once, and the row index serves the second generation when the sampling agrees. Near-copies
    count once every source is prepared (their band keys are written then); before, exact copies only."""
    if not plan.config.dedup.across_sources or len(plan.sources) < 2:
        return
    if plan.config.dedup.near is not None and all(plan.prompt_bands(n).exists() for n in plan.sources):
        cross = crosssource.load(plan)
    else:
        prompts = {}
        for name, sp in plan.sources.items():
            if plan.prompt_manifest(name).exists():
                prompts[name] = crosssource.prompt_ids(plan, name)
            elif name in selected:
                prompts[name] = selected[name]
            elif sp.spec.hf is None or sp.spec.hf.is_local:
                prompts[name] = prepare.select(plan, name).selected
        cross = crosssource.resolve(plan.config.dedup.source_priority(prompts), prompts, None)
    assert cross is not None
    rows = sum(e.rows_to_generate for e in estimates)
    hours_per_row = sum(e.gpu_hours for e in estimates) / rows if rows else 0.0
    for e in estimates:
        e.cross_source_prompts = len(cross.dropped.get(e.source, ()))
        samples = plan.sources[e.source].spec.sampling.samples_per_prompt
        e.cross_source_gpu_hours = e.cross_source_prompts * samples * hours_per_row


def _estimate(
    plan: Plan,
    index: RowIndex,
    mean_tokens: float | None,
    rate: float | None,
    default_tokens_per_second: float,
    lengths: list[tuple[int, int]],
    selected: dict[str, np.ndarray],
) -> list[SourceEstimate]:
    """``selected``: filled with the prompt ids of the sources whose selection ran here."""
    out = []
    for name, sp in plan.sources.items():
        sampling = sp.spec.sampling
        manifest_file = plan.prompt_manifest(name)
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
        est = SourceEstimate(
            source=name,
            prompt_rows=manifest["rows_out"] if manifest else sp.planned_rows,
            prompt_rows_known=manifest is not None,
            shards=sp.n_shards,
            completions_built=sum(p.exists() for p in plan.completion_shards(name)),
            tokens_built=sum(p.exists() for p in plan.token_shards(name)),
        )
        ids_of = _ShardIds(plan, name, est, selected)
        for shard, path in zip(sp.shards, plan.completion_shards(name), strict=True):
            if not path.exists():
                est.generate_jobs.append(f"{name}/{shard}")
                _count_rows(plan, index, name, shard, ids_of(shard), est)
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

    def __init__(self, plan: Plan, source: str, est: SourceEstimate, selected: dict[str, np.ndarray]) -> None:
        self.plan, self.source, self.est, self.selected = plan, source, est, selected
        self.by_shard: dict[str, list[str]] | None = None

    def __call__(self, shard: str) -> list[str] | None:
        plan, sp = self.plan, self.plan.sources[self.source]
        prompt_shard = layout.shard_file(plan.prompt_dir(self.source), shard)
        if prompt_shard.exists():
            return pq.read_table(prompt_shard, columns=["prompt_id"])["prompt_id"].to_pylist()
        if sp.spec.hf is not None and not sp.spec.hf.is_local:
            return None
        if self.by_shard is None:
            selection = prepare.select(plan, self.source)
            self.selected[self.source] = selection.selected
            self.by_shard = selection.shard_prompt_ids()
            self.est.prompt_rows, self.est.prompt_rows_known = selection.rows_out, True
            try:  # the check its prepare job will make: a lost source is found before generation
                prepare.check_losses(sp.spec, selection)
            except prepare.SourceLossError as e:
                self.est.errors.append(str(e))
        return self.by_shard[shard]


def _count_rows(
    plan: Plan, index: RowIndex, source: str, shard: str, ids: list[str] | None, est: SourceEstimate
) -> None:
    """Add one shard's rows to ``est``: journaled, reused from the row index, or to generate."""
    sp = plan.sources[source]
    sampling = sp.spec.sampling
    if ids is None:  # a hub source: the upper bound, every row generated, none reused
        lo, hi = prepare.shard_bounds(sp.planned_rows, sp.n_shards)[int(shard)]
        est.rows_in_jobs += (hi - lo) * sampling.samples_per_prompt
        est.rows_to_generate += (hi - lo) * sampling.samples_per_prompt
        return
    wanted = {(pid, i) for pid in ids for i in range(sampling.samples_per_prompt)}
    est.rows_in_jobs += len(wanted)
    journal_dir = plan.journal_dir(source, shard)
    if (journal_dir / PUBLISHED_DATA).exists():  # published before: the job restores it
        est.rows_journaled += len(wanted)
        return
    journaled = Journal.read(journal_dir / ROWS_FILE)
    if journaled:
        done = {(r["prompt_id"], r["sample_idx"]) for r in journaled}
        est.rows_journaled += len(wanted & done)
        wanted -= done
    if sp.spec.turns == "first":
        found = index.lookup(reuse_key(sp.gen_components), wanted, sampling.max_new_tokens)
        taken = {pair for pair, cand in found.items() if cand.use_for(sampling.max_new_tokens) != "continue"}
        est.rows_reused += len(taken)
        est.rows_continued += len(found) - len(taken)
        wanted -= taken
    est.rows_to_generate += len(wanted)


# -- explain ----------------------------------------------------------------------------------
def _components_in(stage_dir: Path, stage: str) -> dict[str, Any] | None:
    if stage == layout.PROMPTS.folder:
        manifest = stage_dir / layout.MANIFEST
        return json.loads(manifest.read_text())["components"] if manifest.exists() else None
    for stats_file in layout.sidecars(stage_dir):
        return json.loads(stats_file.read_text())["components"]
    return None


def _current(plan: Plan, stage: str, source: str) -> tuple[str, dict[str, Any]]:
    sp = plan.sources[source]
    key = layout.STAGES[stage].key  # prompt_key, and prompt_components beside it
    return getattr(sp, key), getattr(sp, key.removesuffix("_key") + "_components")


def explain(plan: Plan, stage: str, source: str, shard: str | None = None) -> list[str]:
    """Key components of a target, and for a missing one what differs from the nearest built key."""
    if source not in plan.sources:
        raise KeyError(f"source '{source}' is not in the config (sources: {', '.join(plan.sources)})")
    key, components = _current(plan, stage, source)
    folder = layout.stage_dir(plan.config.store, layout.STAGES[stage], source, key)
    target = layout.shard_file(folder, shard) if shard else folder
    lines = [f"{target} ({layout.STAGES[stage].rule}, key {key})"]
    lines += [f"  {k} = {json.dumps(v)}" for k, v in sorted(keys.flatten(components).items())]
    if target.exists():
        lines.append("built: nothing to do")
        return lines
    lines.append("missing: it will be built")
    lines += _nearest(plan, stage, source, key, components)
    return lines


def _nearest(plan: Plan, stage: str, source: str, key: str, components: dict[str, Any], depth: int = 0) -> list[str]:
    indent = "  " * (depth + 1)
    best: tuple[int, str, list[str]] | None = None
    for other in layout.source_keys(plan.config.store, layout.STAGES[stage], source):
        if other.name == key:
            continue
        old = _components_in(other, stage)
        if old is None:
            continue
        changes = keys.diff(old, components)
        if best is None or len(changes) < best[0]:
            best = (len(changes), other.name, changes)
    if best is None:
        return [f"{indent}no earlier {layout.STAGES[stage].rule} output of '{source}' in the store to compare with"]
    _, other_key, changes = best
    lines = [f"{indent}differs from {stage}/{source}/{other_key} in:"]
    for change in changes:
        lines.append(f"{indent}  {change}")
    order = list(layout.STAGES)
    upstream = order[order.index(stage) - 1] if order.index(stage) else None
    if upstream and any(c.startswith(layout.STAGES[upstream].key + ":") for c in changes):
        up_key, up_components = _current(plan, upstream, source)
        lines.append(f"{indent}{layout.STAGES[upstream].key} changed because:")
        lines += _nearest(plan, upstream, source, up_key, up_components, depth + 1)
    return lines


def parse_target(plan: Plan, target: str) -> tuple[str, str, str | None]:
    """(stage, source, shard) of a store path such as store/completions/SRC/KEY/00000.parquet."""
    parts = Path(target).parts
    store_parts = plan.config.store.parts
    rest = parts[len(store_parts) :] if parts[: len(store_parts)] == store_parts else parts
    if len(rest) < 2 or rest[0] not in layout.STAGES:
        raise ValueError(
            f"'{target}' is not a store path like "
            f"{layout.shard_file(layout.stage_dir(plan.config.store, layout.COMPLETIONS, 'SOURCE', 'KEY'), 'SHARD')}"
        )
    shard = layout.shard_of(Path(rest[3])) if len(rest) > 3 else None
    return rest[0], rest[1], shard


# -- configs sharing the store -------------------------------------------------------------
def referenced(plan: Plan) -> set[Path]:
    refs = set()
    for name in plan.sources:
        refs |= {plan.prompt_dir(name), plan.completion_dir(name), plan.token_dir(name)}
        refs.add(layout.journal_dir(plan.config.store, plan.sources[name].gen_key))
    return refs


def registration_id(plan: Plan) -> str:
    """One registration per dataset folder: a config that builds that folder replaces the one before."""
    return hashing.digest({"dataset": os.path.abspath(plan.config.dataset_dir)})[:16]


def register(plan: Plan) -> Path:
    """Record in the store what this config references, so `gc` from any other config keeps it.

    Called at the start of every build (the Snakefile's onstart); never by a command, since an edited
    config that is not built yet uses nothing.
    """
    store = plan.config.store
    entry = {
        "dataset": os.path.abspath(plan.config.dataset_dir),
        "workdir": os.getcwd(),
        "host": platform.node(),
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "references": sorted(os.path.relpath(p, store) for p in referenced(plan)),
    }
    path = layout.registration(store, registration_id(plan))
    atomic.write_json(path, entry)
    return path


def registrations(store: Path) -> dict[str, dict[str, Any]]:
    """Every config registered on the store, by id; an unreadable registration is reported, not skipped."""
    out = {}
    for path in sorted(layout.registration(store).glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            entry["references"] = list(entry["references"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"registration {path} is unreadable ({e}): fix it, or delete it with "
                f"`dflash-build configs --forget {path.stem}` if that config is retired"
            ) from e
        out[path.stem] = entry
    return out


def forget(store: Path, ident: str) -> Path:
    path = layout.registration(store, ident)
    if not path.exists():
        raise KeyError(f"no config {ident} is registered on {store} (see `dflash-build configs`)")
    path.unlink()
    return path


# -- gc ---------------------------------------------------------------------------------------
TMP_AGE_SECONDS = 3600.0  # a temporary file or folder untouched this long belongs to a dead process
DATASET_BROKEN = "dataset built from deleted entries"


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    kept: bool  # unreferenced but kept (journals, unless asked)
    why: str = "unreferenced"


def _size(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes under ``path``; a file with several names (a shard and its journal's copy) counts once."""
    seen = set() if seen is None else seen
    total = 0
    for p in [path] if path.is_file() else path.rglob("*"):
        st = p.lstat()
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def _last_change(path: Path) -> float:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_mtime
    return max([path.lstat().st_mtime, *(p.lstat().st_mtime for p in path.rglob("*"))])


def all_references(plan: Plan) -> tuple[set[Path], dict[Path, list[str]]]:
    """What this config and every registered one reference; for each entry only others keep, which.

    Every registration counts, also the one of this config's own dataset folder: it names what that
    folder's last build used, which an edited, unbuilt config (this one) may no longer reference.
    """
    store = plan.config.store
    mine = referenced(plan)
    others: dict[Path, list[str]] = {}
    for ident, entry in registrations(store).items():
        for rel in entry["references"]:
            path = store / rel
            if path not in mine:
                others.setdefault(path, []).append(f"{entry['dataset']} ({ident})")
    return mine | set(others), others


def dataset_references(plan: Plan) -> dict[Path, list[str]]:
    """The store entries each built dataset folder was made from (its manifest), by entry: which folders.

    The folders are this config's and every registered config's; a dataset records its keys whatever
    config is current, so what it was built from is known even when its config was edited since.
    """
    store = plan.config.store
    used: dict[Path, list[str]] = {}
    for folder in sorted(_dataset_folders(plan)):
        try:
            manifest = json.loads((folder / layout.MANIFEST).read_text())
            sources = manifest["sources"]
        except (OSError, ValueError, KeyError):
            continue  # not built (yet), or not a dataset of ours
        for name, source in sources.items():
            entries = [layout.stage_dir(store, stage, name, source[stage.key]) for stage in layout.STAGES.values()]
            for entry in [*entries, layout.journal_dir(store, source["gen_key"])]:
                used.setdefault(entry, []).append(os.path.relpath(folder))
    return used


def _dataset_folders(plan: Plan) -> set[Path]:
    """This config's dist folders and every registered config's dataset folder, relative to the working
    directory (a packed folder's manifest names no sources: only the dataset's say what it uses)."""
    named = [*plan.config.dist_folders, *(Path(e["dataset"]) for e in registrations(plan.config.store).values())]
    return {Path(os.path.relpath(os.path.abspath(f))) for f in named}


def stray_temporaries(plan: Plan, older_than: float = TMP_AGE_SECONDS) -> list[Path]:
    """Temporary files and folders of atomic writes whose writer died (untouched for ``older_than`` s)."""
    now = time.time()
    found = {*plan.config.store.rglob(".*.tmp"), *plan.config.store.rglob(".*.old")}
    for dist in plan.config.dist_folders:
        found |= {*dist.parent.glob(f".{dist.name}.*.tmp"), *dist.parent.glob(f".{dist.name}.*.old")}
        versions = release.versions_dir(dist)
        found |= {*versions.glob(".*.tmp"), *versions.glob(".*.old")}
    out = []
    for path in sorted(found):
        if any(parent in found for parent in path.parents):
            continue  # inside a stray folder: goes with it
        try:
            if now - _last_change(path) >= older_than:
                out.append(path)
        except FileNotFoundError:  # its writer finished meanwhile
            continue
    return out


def garbage(
    plan: Plan, journals: bool = False, tmp_age: float = TMP_AGE_SECONDS, break_datasets: bool = False
) -> list[Entry]:
    """Store entries no registered config references, and stray temporaries of dead writers.

    An entry a built dataset folder was made from is kept (``why`` names the folder) unless
    ``break_datasets``; then it is deleted, and ``why`` names the folder it breaks.
    """
    store = plan.config.store
    refs, _ = all_references(plan)
    used = dataset_references(plan)
    seen: set[tuple[int, int]] = set()
    out = []

    def consider(entry: Path, kept: bool = False) -> None:
        if entry in used:
            folders = ", ".join(used[entry])
            why = f"breaks dataset {folders}" if break_datasets else f"used by dataset {folders}"
            out.append(Entry(entry, _size(entry, seen), kept=kept or not break_datasets, why=why))
        else:
            out.append(Entry(entry, _size(entry, seen), kept=kept))

    for stage in layout.STAGES.values():
        for entry in layout.stage_entries(store, stage):
            if entry not in refs:
                consider(entry)
    for entry in layout.journal_entries(store):
        if entry not in refs:
            consider(entry, kept=any(entry.rglob(ROWS_FILE)) and not journals)
    # A dataset whose store entries go goes with them (its versions and record, and its packed folders):
    # left in place, Snakemake would call it up to date while plan and verify find its shards gone.
    broken = sorted({Path(folder) for e in out if e.why.startswith("breaks") for folder in used[e.path]})
    for folder in broken:
        for dist in [folder, *sorted(folder.parent.glob(f"{folder.name}-packed-*"))]:
            for path in (dist, release.versions_dir(dist)):
                if path.exists() or path.is_symlink():
                    out.append(Entry(path, _size(path, seen), kept=False, why=DATASET_BROKEN))
    # versions no dataset folder links to any more: this config's folders, and every registered one's
    folders = _dataset_folders(plan)
    folders |= {p for f in list(folders) for p in f.parent.glob(f"{f.name}-packed-*") if p.is_symlink()}
    for dist in sorted(folders):
        why = f"superseded version of {os.path.relpath(dist)}"
        out += [Entry(p, _size(p, seen), kept=False, why=why) for p in release.superseded(dist)]
    out += [Entry(p, _size(p, seen), kept=False, why="stray temporary") for p in stray_temporaries(plan, tmp_age)]
    return out


def protected(plan: Plan) -> dict[Path, list[str]]:
    """Store entries this config does not reference but another registered config does."""
    store = plan.config.store
    _, others = all_references(plan)
    return {p: who for p, who in others.items() if p.exists() and p.is_relative_to(store)}


def collect(plan: Plan, entries: list[Entry]) -> int:
    """Delete the entries that are not kept; returns bytes freed."""
    refs, _ = all_references(plan)
    freed = 0
    with RowIndex.open(plan.config.store) as index:
        for entry in entries:
            if entry.kept:
                continue
            if entry.path in refs:
                raise RuntimeError(f"refusing to delete {entry.path}: a registered config references it")
            for shard in entry.path.glob(f"*{layout.DATA}") if entry.path.is_dir() else ():
                index.remove_shard(shard)
            if entry.path.is_symlink():
                entry.path.unlink()
            elif entry.why == DATASET_BROKEN:
                atomic.remove_dir(entry.path)  # never half a dataset under its own name
            elif entry.path.is_dir():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink(missing_ok=True)
            freed += entry.bytes
    return freed


# -- verify -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    path: Path
    reason: str
    remove: tuple[Path, ...]  # what --repair deletes so the next build rebuilds exactly this
    heal: Callable[[], object] | None = None  # what --repair does instead, for derived state


def _count_lines(path: Path) -> int:
    """Rows of a JSONL file (an export's): its lines."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _check(path: Path, expected: dict[str, Any] | None) -> str | None:
    if expected is None:
        return "no manifest entry or stats sidecar describes it"
    try:
        rows = _count_lines(path) if path.suffix == ".jsonl" else pq.read_metadata(path).num_rows
    except Exception as e:
        return f"unreadable parquet footer ({type(e).__name__}: {e})"
    if rows != expected["rows"]:
        return f"{rows} rows, manifest says {expected['rows']}"
    digest = hashing.sha256_file(path)
    if digest != expected["sha256"]:
        return f"content hash {digest[:16]} differs from the manifest's {expected['sha256'][:16]}"
    return None


def _store_files(plan: Plan) -> Iterator[tuple[Path, dict[str, Any] | None, tuple[Path, ...]]]:
    """(file, what its manifest says, what --repair removes): the file, its sidecar, what derives from it.

    Derived files go too, or Snakemake would never need the repaired file again: a completion shard
    takes its token shard, the dataset and its journal's published copy (the same file, linked) with
    it. A prompt shard takes its source's manifest, the one output of prepare (rules/prepare.smk), so
    that prepare runs again; its completions stay valid (generate depends on the manifest as ancient).
    A shard the manifest lists but the store lacks is reported missing.
    """
    dists = plan.config.dist_folders  # the packed folder derives from the dataset
    # --repair removes a dataset's build record, so that Snakemake builds the folder again; the folder
    # itself (a link to its last good version) stays until the new version replaces it
    records = tuple(release.record_dir(d) for d in dists)

    def with_sidecar(path: Path) -> tuple[Path, Path]:
        return path, layout.sidecar(path)

    def expected(path: Path) -> dict[str, Any] | None:
        sidecar = with_sidecar(path)[1]
        return json.loads(sidecar.read_text()).get("data") if sidecar.exists() else None

    for name, sp in plan.sources.items():
        manifest_file = plan.prompt_manifest(name)
        # without its manifest (prepare's one output) a source's prompt shards are not published yet
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {"shards": {}}
        for shard, path in zip(sp.shards, plan.prompt_shards(name), strict=True):
            if shard in manifest["shards"]:
                yield path, manifest["shards"][shard], (path, manifest_file)
        built = zip(sp.shards, plan.completion_shards(name), plan.token_shards(name), strict=True)
        for shard, completion, tokens in built:
            published = plan.journal_dir(name, shard)
            copy = (published / PUBLISHED_DATA, published / PUBLISHED_STATS)
            if completion.exists():
                derived = (*with_sidecar(completion), *copy, *with_sidecar(tokens), *records)
                yield completion, expected(completion), derived
            if tokens.exists():
                yield tokens, expected(tokens), (*with_sidecar(tokens), *records)
    for folder in dists:
        manifest_file = folder / layout.MANIFEST
        if manifest_file.exists():
            for info in json.loads(manifest_file.read_text())["files"]:
                yield folder / info["path"], info, records[dists.index(folder) :]


def _journal_problems(store: Path) -> Iterator[Problem]:
    """Damaged journal lines, and published copies that no longer match their sidecar."""
    for rows_file in layout.journal_files(store, ROWS_FILE):
        data = rows_file.read_bytes()
        _, bad = parse(data[: data.rfind(b"\n") + 1])
        if bad:

            def drop_bad_lines(path: Path = rows_file) -> None:
                raw = path.read_bytes()
                good = [line for line in raw[: raw.rfind(b"\n") + 1].splitlines() if parse(line)[0]]
                atomic.write_text(path, "".join(line.decode() + "\n" for line in good))

            reason = f"{len(bad)} damaged lines (first: line {bad[0]}); their rows would be generated again"
            yield Problem(rows_file, reason, (), drop_bad_lines)
    for data in layout.journal_files(store, PUBLISHED_DATA):
        stats_file = data.with_name(PUBLISHED_STATS)
        try:
            expected = json.loads(stats_file.read_text()).get("data")
        except (OSError, ValueError):
            expected = None
        if (reason := _check(data, expected)) is not None:
            yield Problem(data, f"published copy: {reason}", (data, stats_file))


def _derived_problems(plan: Plan) -> Iterator[Problem]:
    """The row index: damaged, or out of step with the store."""
    store = plan.config.store
    index_file = store / rowindex.INDEX_FILE
    reason = RowIndex.problem(store)
    if reason is None and index_file.exists():
        index = RowIndex(store)
        try:
            missing, gone = index.differences()
        finally:
            index.close()
        if missing or gone:
            reason = (
                f"out of step with the store: {len(missing)} published shards missing or incomplete, "
                f"{len(gone)} entries for shards that are gone"
            )
    elif reason is None and rowindex.published_shards(store):
        reason = "missing while the store has published shards"
    if reason is not None:
        yield Problem(index_file, reason, (), functools.partial(rowindex.rebuild, store))


def cache_problems(config: Config) -> list[Problem]:
    """The fingerprint cache, checked before a plan is built (building one heals it, with a warning)."""
    cache_file = fingerprint_cache_file(config)
    if cache_file.exists() and (reason := hashing.cache_problem(cache_file)) is not None:
        return [Problem(cache_file, reason + " (only a cache: rebuilt as this command plans)", (cache_file,))]
    return []


def verify(plan: Plan) -> tuple[int, list[Problem]]:
    """Re-read every store and dist file the config references, every journal and the index."""
    checked, problems = 0, []
    for path, expected, remove in _store_files(plan):
        checked += 1
        if not path.exists():
            problems.append(Problem(path, "missing", remove))
        elif (reason := _check(path, expected)) is not None:
            problems.append(Problem(path, reason, remove))
    store = plan.config.store
    checked += sum(len(layout.journal_files(store, name)) for name in (ROWS_FILE, PUBLISHED_DATA))
    problems += _journal_problems(store)
    checked += 1
    problems += _derived_problems(plan)
    for folder in plan.config.dist_folders:
        checked += 1
        if release.recorded_but_missing(folder):
            record = release.record_dir(folder)
            problems.append(Problem(folder, f"missing, although {record} records it as built", (record,)))
    return checked, problems


def repair(plan: Plan, problems: list[Problem]) -> list[Path]:
    """Remove what each problem names, and its index entries; the next build regenerates exactly that.

    Derived state (journal lines, the index) is healed in place instead.
    """
    removed = []
    with RowIndex.open(plan.config.store) as index:
        for problem in problems:
            if problem.heal is not None:
                continue
            for path in problem.remove:
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
                else:
                    continue
                if layout.is_completion_shard(path):
                    index.remove_shard(path)
                removed.append(path)
    for problem in problems:
        if problem.heal is not None:
            problem.heal()
            removed.append(problem.path)
    return removed
