"""Generate stage: one prompt shard → one completion shard, through any engine backend.

The driver renders every prompt with the target's chat template, builds one request per
(prompt, sample) with its own seed, streams results from the backend into a journal, accounts for
every row and publishes the shard and its stats sidecar atomically into the journal's folder, then
links them to the outputs (see journal). A rerun after a crash or kill skips every journaled row, and a
job whose outputs were deleted after they were published (``--rerun-incomplete`` after a killed
Snakemake) restores them without the engine. One job at a time holds a shard (a lock in the store).
SIGTERM and SIGINT stop a job cleanly (:class:`SignalStop`): only the rows in flight are lost.

Rows that cannot be generated are recorded with their reason instead of failing the shard: a
conversation the template refuses (``error``), a prompt longer than the context minus max_new_tokens
(``skipped``, before any engine call), an engine abort (``abort``).

``turns: all`` regenerates every assistant turn of a conversation on top of the regenerated history,
in one of two forms (``turn_samples``; ``auto`` picks per conversation):

- one sequence: turn k+1's prompt is turn k's ids + the generated ids + the stop token + the ids of
  what the template writes between them, so no generated text is ever re-tokenized. That needs a
  template that writes history as a prefix of the next prompt.
- one sample per turn, for a template that rewrites earlier turns (Qwen3's drops their reasoning):
  turn k+1's prompt is the template's own render of the conversation so far, its earlier answers
  written as the template writes history. Only that history text is re-tokenized, and each turn
  records it (``history_retokenized``). Under ``auto``, turns generated before the template first
  rewrote history keep the ids the engine saw as their prompts.

A turn that does not end with its stop token (truncated, aborted) ends its conversation; so does a
later turn the template refuses or that no longer fits the context (the row keeps its finished turns
and says why in ``error``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import engines, hashing, killpoints, loops
from dflash_build.engines import Request, Result, SamplingParams, gpus, registry
from dflash_build.engines import host as engine_host
from dflash_build.plan import Plan
from dflash_build.stages.common import chat, crosssource
from dflash_build.stages.common.job import Job
from dflash_build.stages.generate import gate
from dflash_build.stages.generate.accounting import ShardFailedError as ShardFailedError
from dflash_build.stages.generate.accounting import check_failures, shard_stats, turn_counts
from dflash_build.stages.generate.control import Interrupted as Interrupted
from dflash_build.stages.generate.control import Progress as Progress
from dflash_build.stages.generate.control import SignalStop, StallStop
from dflash_build.stages.generate.conversation import Conversation as Conversation
from dflash_build.stages.generate.conversation import HistoryRewritten, Turn
from dflash_build.stages.generate.conversation import Renderer as Renderer
from dflash_build.stages.generate.reuse import reuse, reuse_conversations
from dflash_build.stages.generate.work import SEED_BITS as SEED_BITS
from dflash_build.stages.generate.work import (
    EngineRun,
    ShardPaths,
    ShardWork,
    completion_row,
    fits_context,
    journal_row,
    result_of,
    row_seed,
)
from dflash_build.store import atomic
from dflash_build.store import records as R
from dflash_build.store.journal import REJECTED, Journal
from dflash_build.store.rowindex import RowIndex

log = logging.getLogger(__name__)


def run(job: Job) -> dict[str, Any]:
    """Generate every (prompt, sample) of the job's shard; returns the stats written beside it.

    The pipeline, under the shard's lock: restore a shard published before (:func:`restore`), else
    rows to do (:func:`open_shard`) → resume from the journal (:func:`replay`) → reuse earlier
    completions (:func:`reuse`) → the engine for the rest (:func:`generate_rest`) → :func:`publish`.
    """
    plan, source, shard = job.plan, job.source, job.shard
    assert source is not None and shard is not None
    cfg = plan.config
    gate.require(plan)  # engine.drafter: its parity guard passed on this engine, or preflight.skip_parity
    paths = ShardPaths.of(job)
    journal = Journal(paths.journal, cfg.engine.journal_flush_rows, cfg.engine.journal_flush_seconds)
    with journal.locked(f"{source}/{shard}"):
        restored = restore(plan, source, shard, paths, journal)
        if restored is not None:
            return restored
        needs_gpu = engines.uses_gpu(cfg.engine)
        with gpus.pinned(cfg.engine) if needs_gpu else contextlib.nullcontext() as lease:
            started = time.time()
            work = open_shard(plan, source, shard, paths)
            skip_copies(work, crosssource.skipped_copies(job, sorted({c.prompt_id for c in work.convs.values()})))
            resumed = replay(work, journal)
            if work.spec.turns == "first":
                reuse(work, journal)
            else:
                reuse_conversations(work, journal)
            engine_run = generate_rest(work, journal, lease)
            killpoints.die_at("publish")
            return publish(work, journal, lease, resumed, engine_run, time.time() - started)


def restore(plan: Plan, source: str, shard: str, paths: ShardPaths, journal: Journal) -> dict[str, Any] | None:
    """Republish the shard this journal already published, if it is intact; None if there is none.

    No tokenizer, no engine: the data file is the one published before (same bytes), and the sidecar
    keeps the numbers of the run that generated it (they are facts of that run) plus a ``restored``
    record of this one; the journal's own copy of the sidecar is left as that run wrote it.
    """
    found = journal.published()
    if found is None:
        return _kept_in_place(plan, source, shard, paths)
    data, old = found
    sp = plan.sources[source]
    expected = old.get(R.STAT_DATA) or {}
    if (
        old.get("gen_key") != sp.gen_key
        or old.get("shard") != shard
        or expected.get("sha256") != hashing.sha256_file(data)
    ):
        log.warning("%s/%s: the published copy in %s is damaged; generating the shard", source, shard, journal.folder)
        journal.discard_published()
        return None
    rows = pq.read_table(data, columns=list(_INDEXED_COLUMNS)).to_pylist()
    stats = {**old, R.STAT_RESTORED: {"from": str(journal.folder), "at": round(time.time(), 3)}}
    atomic.link(journal.published_data, paths.data)
    atomic.write_json(paths.stats, stats)  # a file of its own: the journal's copy stays the generation's
    _index_shard(plan, source, paths.data, rows)
    journal.retire()
    log.info("%s/%s: restored the shard published before from %s; nothing generated", source, shard, journal.folder)
    return stats


def _kept_in_place(plan: Plan, source: str, shard: str, paths: ShardPaths) -> dict[str, Any] | None:
    """The shard already at its output paths, intact and of this key, when its journal is gone; else None.

    Snakemake reruns a job whose rule changed its inputs or params (an upgrade; outputs are update(),
    so they stay): with no journal to restore from, the published shard itself is kept as it is.
    """
    if not (paths.data.exists() and paths.stats.exists()):
        return None
    try:
        stats = json.loads(paths.stats.read_text())
    except (OSError, ValueError):
        return None
    expected = stats.get(R.STAT_DATA) or {}
    if (
        stats.get("gen_key") != plan.sources[source].gen_key
        or stats.get("shard") != shard
        or expected.get("sha256") != hashing.sha256_file(paths.data)
    ):
        return None
    rows = pq.read_table(paths.data, columns=list(_INDEXED_COLUMNS)).to_pylist()
    _index_shard(plan, source, paths.data, rows)
    log.info("%s/%s: the published shard %s is intact; nothing generated", source, shard, paths.data)
    return stats


def open_shard(plan: Plan, source: str, shard: str, paths: ShardPaths) -> ShardWork:
    """Load the prompt shard and the tokenizer; one conversation per (prompt, sample)."""
    sp = plan.sources[source]
    sampling = sp.spec.sampling
    template_kwargs = dict(sp.gen_components["chat_template_kwargs"])
    prompts = pq.read_table(paths.prompts).to_pylist()
    tokenizer = chat.load_tokenizer(plan.config.model, plan.tokenizer_cache())
    if any(p["tools"] for p in prompts):
        chat.check_renders_tools(tokenizer, template_kwargs)
    params = SamplingParams.of(sampling)
    convs: dict[tuple[str, int], Conversation] = {}
    for p in prompts:
        messages = json.loads(p["messages"])
        slots = chat.answer_slots(messages, sp.spec.turns)
        tools = json.loads(p["tools"]) if p["tools"] else None
        row_kwargs = json.loads(p["template_kwargs"]) if p.get("template_kwargs") else None
        for idx in range(sampling.samples_per_prompt):
            conv = Conversation(p["prompt_id"], idx, messages, tools, slots, template_kwargs=row_kwargs)
            # history: source: each turn follows the dataset's history, never the sequence before it
            conv.per_turn = (sp.spec.turn_samples == "per_turn" or sp.spec.history == "source") and len(slots) > 1
            convs[conv.key] = conv
    parser = plan.config.model.tool_call_parser if sp.spec.turns == "all" else None
    renderer = Renderer(tokenizer, template_kwargs, sp.spec.turn_samples, parser, sp.spec.tool_match, sp.spec.history)
    return ShardWork(
        plan, source, shard, paths, tokenizer, renderer, chat.context_length(plan.config.model), params, convs
    )


def skip_copies(work: ShardWork, copies: dict[str, str]) -> None:
    """Finish, before any engine call, the conversations of prompts a source ranked above keeps: each
    is a ``skipped`` row whose error names that source (a selection, never a failure)."""
    for conv in work.convs.values():
        if conv.prompt_id in copies:
            conv.finish(R.FINISH_SKIPPED, copies[conv.prompt_id])
    if copies:
        log.info("%s: %d prompts another source keeps are skipped", work.label, len(copies))


_JOURNAL_FIELDS = ("prompt_id", "sample_idx", "turn", "output_ids", "finish_reason", "stop_token_id", "error")


def replay(work: ShardWork, journal: Journal) -> int:
    """Apply every journaled turn, in order (each turn's context derives from the ones before).

    A row that does not fit (a repeated turn, a turn after a gap, a prompt not in this shard, missing
    fields: damage, or two writers before shards had locks) is skipped with a warning and its turn is
    generated again; the first copy of a turn wins. An answer journaled as rejected (degenerate policy
    regenerate) only moves its row on to the next attempt. A turn the engine refused or aborted has no answer
    to resume: it is asked again, so that a rerun after the cause is fixed (the server's options, a
    passing fault) heals the shard instead of failing on the same rows.
    """
    applied, skipped, failed, rejected = 0, 0, 0, 0
    for row in journal.load():
        conv = work.convs.get((row.get("prompt_id"), row.get("sample_idx")))  # type: ignore[arg-type]
        if conv is None or any(k not in row for k in _JOURNAL_FIELDS) or row["turn"] != len(conv.turns):
            skipped += 1
            continue
        if conv.finish_reason is not None:
            skipped += 1
            continue
        if row.get(REJECTED):  # an attempt the degenerate policy asked again: resume from the next one
            conv.attempt = row.get("attempt", 0) + 1
            rejected += 1
            continue
        if row["finish_reason"] in R.NO_ANSWER:
            failed += 1
            continue
        conv.attempt = row.get("attempt", 0)  # the journaled answer is that attempt's
        turn = work.apply(conv, work.renderer.next_context(conv), result_of(row))
        turn.reused_from, turn.continued = row.get("reused_from"), row.get("continued", False)
        turn.across = row.get("across", False)
        applied += 1
    if skipped:
        log.warning("%s: %d journal rows in %s do not fit the shard and are skipped", work.label, skipped, journal.path)
    if failed:
        log.info("%s: %d journaled turns failed (refused or aborted) and are asked again", work.label, failed)
    if rejected:
        log.info("%s: %d degenerate attempts journaled: their rows go on from the next attempt", work.label, rejected)
    if applied:
        log.info("%s: resuming, %d turns already journaled", work.label, applied)
    return applied


def next_requests(
    work: ShardWork, progress: Progress
) -> tuple[list[Request], dict[tuple[str, int], tuple[list[int], int]]]:
    """One request per unfinished conversation's next turn, and the context ids each one added with its
    budget (:meth:`ShardWork.budget`).

    Conversations the template refuses, prompts that leave no room for their budget in the context, and
    prompts that leave fewer than trainer.min_new_tokens in the trainer's window are finished here,
    before any engine call.
    """
    sampling = work.spec.sampling
    requests, contexts = [], {}
    for conv in work.pending():
        try:
            ids = work.renderer.next_context(conv)
        except Exception as e:  # a template may refuse one conversation; the shard goes on
            message = f"chat template failed: {type(e).__name__}: {e}"
            if conv.turns and not isinstance(e, HistoryRewritten):  # it ends with the turns it has
                conv.finish(conv.turns[-1].finish_reason, message)
            else:
                conv.finish(R.FINISH_ERROR, message)
            progress.update(Result(conv.prompt_id, conv.sample_idx, [], conv.finish_reason), True)
            continue
        prompt_ids = conv.request_ids(ids)
        budget = work.budget(len(prompt_ids))
        reason = None
        if not fits_context(len(prompt_ids), budget, work.context):
            reason = (
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {budget} exceeds the context of {work.context}"
            )
        elif work.plan.config.trainer.leaves_too_little(budget):
            window = work.plan.config.trainer
            reason = (
                f"{R.OUTSIDE_WINDOW} prompt of {len(prompt_ids)} tokens leaves {max(budget, 0)} new tokens in "
                f"trainer.max_length {window.max_length} (trainer.min_new_tokens {window.min_new_tokens})"
            )
        if reason is not None:
            if conv.turns:  # later turns: the conversation ends with what it has
                conv.finish(conv.turns[-1].finish_reason, reason)
            else:
                conv.finish(R.FINISH_SKIPPED, reason)
            progress.update(Result(conv.prompt_id, conv.sample_idx, [], conv.finish_reason), True)
            continue
        seed = row_seed(sampling.seed, conv.prompt_id, conv.sample_idx, len(conv.turns), conv.attempt)
        # continue an earlier truncated answer with what is left of the budget
        params = dataclasses.replace(work.params, max_new_tokens=budget - len(conv.prefix))
        prompt_ids = prompt_ids + conv.prefix
        requests.append(Request(conv.prompt_id, conv.sample_idx, prompt_ids, params, seed, work.stop_loops))
        contexts[conv.key] = (ids, budget)
    return requests, contexts


def take_result(work: ShardWork, generated: Result, context: tuple[list[int], int]) -> Turn:
    """Record one engine answer on its conversation (a continued answer keeps its old prefix); an
    answer that ran out of a budget the trainer's window shortened ended at the window."""
    conv = work.convs[(generated.prompt_id, generated.sample_idx)]
    context_ids, budget = context
    result = generated
    if result.finish_reason == R.FINISH_LENGTH:
        result = dataclasses.replace(result, finish_reason=work.ran_out(budget))
    if conv.prefix:  # the answer is the old prefix + what the engine added (its count too)
        counted = generated.engine_output_tokens
        result = dataclasses.replace(
            result,
            output_ids=conv.prefix + list(generated.output_ids),
            engine_output_tokens=None if counted is None else counted + len(conv.prefix),
        )
        # the engine saw the prefix as prompt: a loop that began in it is found on the whole answer
        end = loops.loop_end(result.output_ids, work.stop_loops) if work.stop_loops is not None else None
        if end is not None:
            result = dataclasses.replace(
                result, output_ids=result.output_ids[:end], finish_reason=R.FINISH_LOOP, stop_token_id=None
            )
    turn = work.apply(conv, context_ids, result)
    if conv.prefix_from is not None:
        turn.reused_from, turn.continued, turn.across = conv.prefix_from, True, conv.prefix_across
        conv.prefix, conv.prefix_from = [], None
    return turn


def start_engine(work: ShardWork, lease: gpus.GpuLease | None) -> engines.Engine:
    """The job's own engine, or (``engine.shared``, or a server backend) a client of the long-lived
    engine servers this config's jobs share (see engine_host)."""
    cfg = work.plan.config
    stop_ids = work.stop_ids
    if engine_host.through_server(cfg.engine):
        fingerprint = work.plan.model_fingerprint
        return engine_host.open_engine(cfg, stop_ids, lease, work.tokenizer, fingerprint, work.context)
    return engines.load(registry.for_generation(cfg.engine), cfg.model, stop_ids, lease, work.tokenizer)


def engine_name(engine: engines.Engine, backend: str, lease: gpus.GpuLease | None) -> str:
    """How a warning names the engine: a server's own name (slot, URLs), else the backend and its GPU."""
    name = getattr(engine, "name", None)
    if name:
        return str(name)
    return f"the in-process {backend} engine" + (f" on GPU {lease.gpu}" if lease is not None else "")


def watch_engine(
    engine: engines.Engine,
    work: ShardWork,
    lease: gpus.GpuLease | None,
    journal: Journal,
    progress: Progress,
    counts: EngineRun,
) -> StallStop | None:
    """Start the shard's heartbeat for ``engine``; for an in-process engine that counts its steps, the
    stop it makes when the engine stalls."""
    stall_timeout = work.plan.config.engine.stall_timeout

    def name() -> str:
        return engine_name(engine, work.plan.config.engine.backend, lease)

    if isinstance(engine, engine_host.ServedEngine) or registry.get(work.plan.config.engine.backend).remote:
        then = "its health check decides: a stalled server leaves the pool (a shared engine is replaced)"
        progress.watch(lambda: counts.in_flight, name, stall_timeout, then)
        return None
    if getattr(engine, "steps", None) is None:  # its scheduler is out of sight: warn only
        then = "the job waits for it; stopping the job keeps every finished row, and a rerun generates the rest"
        progress.watch(lambda: counts.in_flight, name, stall_timeout, then)
        return None
    stall = StallStop(engine, journal)
    steps = lambda: int(engine.steps)  # type: ignore[attr-defined]  # noqa: E731
    progress.watch(lambda: counts.in_flight, name, stall_timeout, "the job stops", steps, stall)
    return stall


def generate_rest(work: ShardWork, journal: Journal, lease: gpus.GpuLease | None) -> EngineRun:
    """Round after round (one turn each), send what is left to the engine and journal every answer.

    The engine starts only when a round has requests, so a shard that is all reused never loads it.
    """
    kill_kind, kill_rows = killpoints.kill_point()
    counts = EngineRun()
    done = sum(c.finish_reason is not None for c in work.convs.values())
    progress = Progress(len(work.convs), done, work.label)
    engine = stall = None
    try:
        with SignalStop() as stop:
            while stop.signum is None:
                requests, contexts = next_requests(work, progress)
                if not requests:
                    break
                if engine is None:
                    engine = stop.engine = start_engine(work, lease)
                    counts.engine_identity = getattr(engine, "identity", None)
                    stall = watch_engine(engine, work, lease, journal, progress, counts)
                    if kill_kind == "rows" and kill_rows == 0:
                        killpoints.die()
                    if stop.signum is not None:  # it came while the engine loaded
                        break
                counts.in_flight = len(requests)
                for generated in engine.generate(requests):
                    counts.in_flight -= 1
                    counts.engine_tokens += len(generated.output_ids)
                    turn = take_result(work, generated, contexts.pop((generated.prompt_id, generated.sample_idx)))
                    conv = work.convs[(generated.prompt_id, generated.sample_idx)]
                    row = journal_row(conv, turn)  # before retry moves the conversation to its next attempt
                    if rejected := work.retry(conv):  # degenerate: asked again next round with the next seed
                        # journaled as rejected: a resumed job goes on from the next attempt, never asking
                        # this one again (the GPU time it cost is spent once)
                        journal.append({**row, REJECTED: rejected})
                        counts.regenerated += 1
                        continue
                    journal.append(row)
                    counts.journaled += 1
                    progress.update(
                        dataclasses.replace(generated, finish_reason=turn.finish_reason), conv.finish_reason is not None
                    )
                    killpoints.after_rows(counts.journaled, journal.sync)
                counts.in_flight = 0
                if stall is not None:
                    stall.check()
                if contexts and stop.signum is None:
                    missing = list(contexts)[:3]
                    raise RuntimeError(f"engine returned no result for {len(contexts)} requests, e.g. {missing}")
            stop.check(work.label, counts.journaled, journal)
        journal.sync()
    finally:
        progress.close()
        if engine is not None:
            engine.close()
        journal.close()
    return counts


def publish(
    work: ShardWork,
    journal: Journal,
    lease: gpus.GpuLease | None,
    resumed: int,
    engine_run: EngineRun,
    wall: float,
) -> dict[str, Any]:
    """Account for every row, refuse a mostly failed shard, then write shard and sidecar atomically.

    Only then is the shard indexed for reuse and the journal's rows file removed.
    """
    sampling = work.plan.sources[work.source].spec.sampling
    convs = work.convs.values()
    rows = [{**completion_row(conv, work.renderer, sampling.seed), "variant": work.spec.variant} for conv in convs]
    stats = shard_stats(work.plan, work.source, work.shard, rows, resumed, lease, wall, engine_run.engine_tokens)
    turns = [t for conv in convs for t in conv.turns]
    retokenized = sum(t.retokenized for t in turns)
    stats[R.STAT_RETOKENIZED_TURNS] = retokenized
    stats[R.STAT_RETOKENIZE_DRIFT] = round(sum(t.drifted for t in turns) / retokenized, 6) if retokenized else 0.0
    reused_from: dict[str, int] = {}
    continued = across = 0
    for conv in convs:
        if conv.turns and conv.turns[0].reused_from:
            reused_from[conv.turns[0].reused_from] = reused_from.get(conv.turns[0].reused_from, 0) + 1
            continued += conv.turns[0].continued
            across += conv.turns[0].across
    stats[R.STAT_REUSED] = sum(reused_from.values()) - continued
    stats[R.STAT_CONTINUED] = continued
    stats[R.STAT_REUSED_ACROSS] = across  # of those, from another generation's settings (same requests)
    stats[R.STAT_REUSED_FROM] = reused_from
    stats[R.STAT_GENERATED] = engine_run.journaled
    # degenerate policy regenerate: rows whose answer is a later attempt's, and the answers asked again
    stats[R.STAT_REGENERATED_ROWS] = sum(conv.attempt > 0 for conv in convs)
    stats[R.STAT_REGENERATED] = engine_run.regenerated
    if engine_run.engine_identity is not None:
        stats["engine"]["served"] = engine_run.engine_identity
    if work.spec.turns == "all":
        stats[R.STAT_TURNS] = turn_counts(list(convs), work.renderer.parser is not None)
    check_failures(stats, work.plan.config.checks.max_failed_fraction, journal.path)
    table = pa.Table.from_pylist(rows, schema=R.COMPLETION_SCHEMA)
    # Written into the journal's folder first: the outputs are links to these (see journal).
    stats[R.STAT_DATA] = atomic.write_parquet(journal.published_data, table)
    atomic.write_json(journal.published_stats, stats)
    _link_outputs(journal, work.paths)
    _index_shard(work.plan, work.source, work.paths.data, rows)
    journal.retire()
    counts = (R.STAT_OK, R.STAT_TRUNCATED, R.STAT_ERROR, R.STAT_SKIPPED, R.STAT_GENERATED, R.STAT_RESUMED_TURNS)
    log.info("%s: published %s", work.label, {k: stats[k] for k in counts})
    return stats


# What the row index needs of a completion shard (restore reads only these).
_INDEXED_COLUMNS = ("prompt_id", "sample_idx", "finish_reason", "n_output_tokens", "n_prompt_tokens", "turns")


def _link_outputs(journal: Journal, paths: ShardPaths) -> None:
    atomic.link(journal.published_data, paths.data)
    atomic.link(journal.published_stats, paths.stats)


def _index_shard(plan: Plan, source: str, data: Path, rows: list[dict[str, Any]]) -> None:
    sp = plan.sources[source]
    with RowIndex.open(plan.config.store, sync=False) as index:
        index.add_shard(sp.gen_key, sp.gen_components, data, rows)
