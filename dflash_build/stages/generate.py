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
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import engines, hashing, killpoints
from dflash_build.config import SourceSpec
from dflash_build.engines import Request, Result, SamplingParams, gpus, registry
from dflash_build.engines import host as engine_host
from dflash_build.plan import Plan
from dflash_build.stages import chat
from dflash_build.store import atomic, layout
from dflash_build.store import records as R
from dflash_build.store.journal import Journal
from dflash_build.store.rowindex import RowIndex, reuse_key

log = logging.getLogger(__name__)
PROGRESS_EVERY_SECONDS = 30.0


# Row seeds are 31-bit, so every engine takes them as they are: SGLang 0.5.5 built its seed tensor as
# int32 (a larger seed overflowed and killed the engine), llama.cpp's server keeps a uint32 and vLLM,
# SGLang 0.5.23 and the transformers backend take anything up to int64.
SEED_BITS = 31


def row_seed(base_seed: int, prompt_id: str, sample_idx: int, turn: int = 0) -> int:
    """The seed of one (prompt, sample, turn): independent of batch, shard and order; in [0, 2**31)."""
    parts: dict[str, Any] = {"seed": base_seed, "prompt_id": prompt_id, "sample_idx": sample_idx}
    if turn:
        parts["turn"] = turn
    return int(hashing.digest(parts)[:16], 16) >> (64 - SEED_BITS)


def fits_context(prompt_tokens: int, max_new_tokens: int, context: int | None) -> bool:
    """Whether a prompt leaves room for ``max_new_tokens`` in the context: SGLang's own rule (it refuses
    ``prompt + max_new_tokens > context``), applied before any engine call so no backend sees a refusal."""
    return context is None or prompt_tokens + max_new_tokens <= context


class Interrupted(RuntimeError):
    """A signal stopped the job: what finished is journaled, the rest is generated on the next run."""


class SignalStop:
    """The driver owns SIGTERM and SIGINT while it generates (Snakemake's shutdown, SLURM preemption).

    On the first signal it stops sending requests and lets the engine abort what is in flight; the
    driver then syncs the journal and fails the job, so only the in-flight rows are lost. A second
    signal stops at once (the journal is synced on every flush and tolerates a torn last line).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.engine: engines.Engine | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._saved = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise Interrupted(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum
        log.warning("%s: finishing what is journaled, then stopping", signal.Signals(signum).name)
        if self.engine is not None:
            self.engine.interrupt()

    def check(self, label: str, journaled: int, journal: Journal) -> None:
        """Fail the job if a signal came, once the journal holds what finished."""
        if self.signum is None:
            return
        journal.sync()
        raise Interrupted(
            f"{label}: stopped by {signal.Signals(self.signum).name}; the {journaled} rows finished in this run "
            f"are kept in {journal.path}, the rest is generated when the job runs again"
        )


class Progress:
    """Rows done/total, output tok/s, ETA and truncation rate: a bar on a terminal, else log lines.

    While the engine works, a heartbeat (:meth:`watch`) writes the line every ``PROGRESS_EVERY_SECONDS``
    whether or not a row finished, and warns, naming the engine, when no answer has come back for
    ``engine.stall_timeout`` seconds while requests are in flight: a stopped or wedged engine is seen
    in minutes, not at the per-request deadline.
    """

    def __init__(self, total: int, already: int, label: str, every: float = PROGRESS_EVERY_SECONDS) -> None:
        self.total, self.label, self.every = total, label, every
        self.done, self.truncated, self.output_tokens = already, 0, 0
        self.new = 0
        self.start = self.last = self.last_answer = time.monotonic()
        self.stalls = 0  # warnings given (each names the engine)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=already, desc=label, unit="row")

    def update(self, result: Result, row_finished: bool) -> None:
        with self._lock:
            self.last_answer = time.monotonic()
            self.output_tokens += len(result.output_ids)
            if not row_finished:
                return
            self.done += 1
            self.new += 1
            self.truncated += result.finish_reason == R.FINISH_LENGTH
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(self.rates())
            return
        if self.done == self.total:
            self._line()

    def watch(
        self,
        in_flight: Callable[[], int],
        engine: str | Callable[[], str],
        stall_timeout: float,
        then: str,
        steps: Callable[[], int] | None = None,
        on_stall: Callable[[str], None] | None = None,
    ) -> None:
        """Start the heartbeat: ``in_flight()`` says how many requests the engine holds now; ``steps()``
        (an in-process engine's decoding steps) counts as progress too; ``then`` says in the warning what
        happens next. With ``on_stall``, an engine that made no progress for ``stall_timeout`` while it
        holds requests is handed to it, once."""
        tick = max(0.2, min(self.every, stall_timeout) / 4)

        def beat() -> None:
            warned_for = None  # the progress time the last warning was about
            seen, stepped_at = (steps() if steps else 0), time.monotonic()
            while not self._stop.wait(tick):
                now = time.monotonic()
                if self.bar is None and now - self.last >= self.every:
                    self._line()
                if steps is not None and steps() != seen:
                    seen, stepped_at = steps(), now
                progressed = max(self.last_answer, stepped_at)
                waiting, silent = in_flight(), now - progressed
                if not (waiting and silent >= stall_timeout) or warned_for == progressed:
                    continue
                warned_for = progressed
                self.stalls += 1
                who = engine() if callable(engine) else engine  # a pool's members change
                message = (
                    f"{self.label}: no answer from {who} for {silent:.0f}s while {waiting} requests are in flight "
                    f"(engine.stall_timeout {stall_timeout:g}s); it may be stopped, deadlocked or its GPU wedged: "
                    f"{then}"
                )
                log.warning("%s", message)
                if on_stall is not None:
                    on_stall(message)
                    return

        self._heartbeat = threading.Thread(target=beat, name=f"heartbeat {self.label}", daemon=True)
        self._heartbeat.start()

    def _line(self) -> None:
        with self._lock:
            self.last = time.monotonic()
            line = f"{self.label}: {self.done}/{self.total} rows, {self.rates()}"
        log.info("%s", line)

    def rates(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.new / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (
            f"{self.output_tokens / elapsed:.1f} output tok/s, ETA {eta:.0f}s, "
            f"truncated {self.truncated / max(self.new, 1):.1%}"
        )

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.bar is not None:
            self.bar.close()


@dataclass
class Turn:
    context_ids: list[int]  # ids added before this turn's answer (the whole prompt for turn 0)
    output_ids: list[int]
    finish_reason: str
    stop_token_id: int | None = None
    error: str | None = None
    retokenized: bool = False
    drifted: bool = False  # re-tokenized length differs from the server's own count
    reused_from: str | None = None  # "gen_key/shard" of the completion this row was taken from
    continued: bool = False  # the engine extended the reused (truncated) answer
    history_retokenized: bool = False  # the prompt holds earlier answers as text the template wrote

    @property
    def generated_ids(self) -> list[int]:
        return self.output_ids + ([self.stop_token_id] if self.stop_token_id is not None else [])


@dataclass
class Conversation:
    prompt_id: str
    sample_idx: int
    messages: list[dict[str, Any]]  # for turns=all: with the source's assistant turns as slots
    tools: list[dict[str, Any]] | None
    slots: list[int]  # message index of each assistant answer to generate
    turns: list[Turn] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # an earlier truncated answer to continue
    prefix_from: str | None = None
    finish_reason: str | None = None  # set when the conversation is finished
    error: str | None = None
    template_kwargs: dict[str, Any] | None = None  # this row's own (chat_template_kwargs_from)
    per_turn: bool = False  # each turn is a sample; its context_ids are its whole prompt

    @property
    def key(self) -> tuple[str, int]:
        return self.prompt_id, self.sample_idx

    @property
    def all_ids(self) -> list[int]:
        """The sequence so far (one-sequence form): every turn's context, answer and stop token."""
        ids: list[int] = []
        for t in self.turns:
            ids += t.context_ids + t.generated_ids
        return ids

    def split_turns(self) -> None:
        """Make each turn a sample of its own: its context becomes the whole prompt the engine saw."""
        prompt: list[int] = []
        for t in self.turns:
            t.context_ids = prompt = prompt + t.context_ids
            prompt = prompt + t.generated_ids
        self.per_turn = True

    def request_ids(self, context_ids: list[int]) -> list[int]:
        """The engine's prompt for the next turn, whose new context is ``context_ids``."""
        return context_ids if self.per_turn else self.all_ids + context_ids

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error = reason, error


def answer_slots(messages: list[dict[str, Any]], turns: str) -> list[int]:
    """Where each answer goes. ``first``: one answer after the whole prompt."""
    if turns == "first":
        return [len(messages)]
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not messages or messages[-1]["role"] != "assistant":
        slots.append(len(messages))
    return slots


class HistoryRewritten(ValueError):
    """The template does not write a conversation's history as a prefix of its next prompt."""


class Renderer:
    """Prompt ids for each turn of a conversation, never re-tokenizing generated ids but the history
    text a template rewrites (see the module docstring)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any], turn_samples: str = "auto") -> None:
        self.tokenizer, self.kwargs, self.turn_samples = tokenizer, template_kwargs, turn_samples

    def kwargs_of(self, conv: Conversation) -> dict[str, Any]:
        return {**self.kwargs, **(conv.template_kwargs or {})}

    def history(self, conv: Conversation) -> list[dict[str, Any]]:
        """The conversation up to the next answer, with earlier answers replaced by generated ones."""
        slot = conv.slots[len(conv.turns)]
        messages = [dict(m) for m in conv.messages[:slot]]
        for turn, s in zip(conv.turns, conv.slots, strict=False):
            messages[s] = {"role": "assistant", "content": self.decode(turn.output_ids)}
        return messages

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def next_context(self, conv: Conversation) -> list[int]:
        """Ids to add before the next answer (the whole prompt once turns are samples of their own).

        Under ``auto`` a conversation whose template rewrites its history becomes per-turn here (the
        same turn on every replay, as rendering is deterministic); under ``sequence`` that raises
        :class:`HistoryRewritten`.
        """
        history = self.history(conv)
        kwargs = self.kwargs_of(conv)
        text = chat.render_text(self.tokenizer, history, conv.tools, kwargs)
        if not conv.turns or conv.per_turn:
            return chat.encode(self.tokenizer, text)
        # What the template wrote up to the end of the last answer must be a prefix of the new render.
        seen = chat.render_text(self.tokenizer, history[: conv.slots[len(conv.turns) - 1]], conv.tools, kwargs)
        seen += self.decode(conv.turns[-1].generated_ids)
        if text.startswith(seen):
            return chat.encode(self.tokenizer, text[len(seen) :])
        if self.turn_samples == "sequence":
            raise HistoryRewritten(
                "chat template rewrites earlier turns (not prefix-stable); set turn_samples: auto or per_turn"
            )
        conv.split_turns()
        return chat.encode(self.tokenizer, text)


def _journal_row(conv: Conversation, turn: Turn) -> dict[str, Any]:
    return {
        "prompt_id": conv.prompt_id,
        "sample_idx": conv.sample_idx,
        "turn": len(conv.turns) - 1,
        "output_ids": turn.output_ids,
        "finish_reason": turn.finish_reason,
        "stop_token_id": turn.stop_token_id,
        "error": turn.error,
        "retokenized": turn.retokenized,
        "drifted": turn.drifted,
        "reused_from": turn.reused_from,
        "continued": turn.continued,
        "at": round(time.time(), 1),  # when it finished: `dflash-build status` reads rates from it
    }


@dataclass(frozen=True)
class ShardPaths:
    """Where one generation job reads and writes: Snakemake's input/output, or the plan's own paths."""

    prompts: Path
    data: Path
    stats: Path
    journal: Path  # a folder, never a Snakemake output: it survives failed and killed jobs

    @classmethod
    def of(cls, plan: Plan, source: str, shard: str) -> ShardPaths:
        data = layout.shard_file(plan.completion_dir(source), shard)
        return cls(
            layout.shard_file(plan.prompt_dir(source), shard),
            data,
            layout.sidecar(data),
            plan.journal_dir(source, shard),
        )


@dataclass
class ShardWork:
    """One shard's conversations and everything needed to render and account for them."""

    plan: Plan
    source: str
    shard: str
    paths: ShardPaths
    tokenizer: Any
    renderer: Renderer
    context: int | None
    params: SamplingParams
    convs: dict[tuple[str, int], Conversation]

    @property
    def spec(self) -> SourceSpec:
        return self.plan.sources[self.source].spec

    @property
    def label(self) -> str:
        return f"{self.source}/{self.shard}"

    def pending(self) -> list[Conversation]:
        return [c for c in self.convs.values() if c.finish_reason is None]

    def budget(self, prompt_tokens: int) -> int:
        """New tokens an answer after ``prompt_tokens`` may have: max_new_tokens, or what is left of the
        trainer's window (trainer.max_length) when that is less, so no token is generated past it."""
        limit = self.spec.sampling.max_new_tokens
        window = self.plan.config.trainer.max_length
        return limit if window is None else min(limit, window - prompt_tokens)

    def ran_out(self, budget: int) -> str:
        """How an answer that used up ``budget`` ended: at the trainer's window when the window made the
        budget shorter than max_new_tokens, else truncated."""
        return R.FINISH_WINDOW if budget < self.spec.sampling.max_new_tokens else R.FINISH_LENGTH

    @property
    def min_new_tokens(self) -> int:
        """Fewer new tokens than this in the window: the prompt is skipped (1 without a window)."""
        trainer = self.plan.config.trainer
        return 1 if trainer.max_length is None else trainer.min_new_tokens


@dataclass
class EngineRun:
    """What the engine did in this run: rows journaled and tokens it produced."""

    journaled: int = 0
    engine_tokens: int = 0
    in_flight: int = 0  # requests sent in this round and not answered yet (the heartbeat reads it)
    served: Any = None  # what the engine says it serves (openai backend: per server), for the sidecar


def run(plan: Plan, source: str, shard: str, paths: ShardPaths | None = None) -> dict[str, Any]:
    """Generate every (prompt, sample) of one shard; returns the stats written beside it.

    The pipeline, under the shard's lock: restore a shard published before (:func:`restore`), else
    rows to do (:func:`open_shard`) → resume from the journal (:func:`replay`) → reuse earlier
    completions (:func:`reuse`) → the engine for the rest (:func:`generate_rest`) → :func:`publish`.
    """
    cfg = plan.config
    paths = paths or ShardPaths.of(plan, source, shard)
    journal = Journal(paths.journal, cfg.engine.journal_flush_rows, cfg.engine.journal_flush_seconds)
    with journal.locked(f"{source}/{shard}"):
        restored = restore(plan, source, shard, paths, journal)
        if restored is not None:
            return restored
        needs_gpu = engines.uses_gpu(cfg.engine)
        with gpus.pinned(cfg.engine) if needs_gpu else contextlib.nullcontext() as lease:
            started = time.time()
            work = open_shard(plan, source, shard, paths)
            resumed = replay(work, journal)
            if work.spec.turns == "first":
                reuse(work, journal)
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
    tokenizer = chat.load_tokenizer(plan.config.model)
    if any(p["tools"] for p in prompts):
        chat.check_renders_tools(tokenizer, template_kwargs)
    params = SamplingParams(
        sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.max_new_tokens
    )
    convs: dict[tuple[str, int], Conversation] = {}
    for p in prompts:
        messages = json.loads(p["messages"])
        slots = answer_slots(messages, sp.spec.turns)
        tools = json.loads(p["tools"]) if p["tools"] else None
        row_kwargs = json.loads(p["template_kwargs"]) if p.get("template_kwargs") else None
        for idx in range(sampling.samples_per_prompt):
            conv = Conversation(p["prompt_id"], idx, messages, tools, slots, template_kwargs=row_kwargs)
            conv.per_turn = sp.spec.turn_samples == "per_turn" and len(slots) > 1
            convs[conv.key] = conv
    renderer = Renderer(tokenizer, template_kwargs, sp.spec.turn_samples)
    return ShardWork(
        plan, source, shard, paths, tokenizer, renderer, chat.context_length(plan.config.model), params, convs
    )


_JOURNAL_FIELDS = ("prompt_id", "sample_idx", "turn", "output_ids", "finish_reason", "stop_token_id", "error")


def replay(work: ShardWork, journal: Journal) -> int:
    """Apply every journaled turn, in order (each turn's context derives from the ones before).

    A row that does not fit (a repeated turn, a turn after a gap, a prompt not in this shard, missing
    fields: damage, or two writers before shards had locks) is skipped with a warning and its turn is
    generated again; the first copy of a turn wins.
    """
    applied, skipped = 0, 0
    for row in journal.load():
        conv = work.convs.get((row.get("prompt_id"), row.get("sample_idx")))  # type: ignore[arg-type]
        if conv is None or any(k not in row for k in _JOURNAL_FIELDS) or row["turn"] != len(conv.turns):
            skipped += 1
            continue
        if conv.finish_reason is not None:
            skipped += 1
            continue
        turn = _apply(conv, work.renderer.next_context(conv), _result_of(row))
        turn.reused_from, turn.continued = row.get("reused_from"), row.get("continued", False)
        applied += 1
    if skipped:
        log.warning("%s: %d journal rows in %s do not fit the shard and are skipped", work.label, skipped, journal.path)
    if applied:
        log.info("%s: resuming, %d turns already journaled", work.label, applied)
    return applied


def reuse(work: ShardWork, journal: Journal) -> int:
    """Take every row an earlier build already generated validly (see rowindex); returns how many."""
    sp = work.plan.sources[work.source]
    limit = sp.spec.sampling.max_new_tokens
    pending = [c.key for c in work.pending() if not c.turns]
    if not pending:
        return 0
    store = work.plan.config.store
    with RowIndex.open(store, sync=None) as index:  # the build's start synced it with the store
        found = index.lookup(reuse_key(sp.gen_components), pending, limit)
        by_file: dict[str, list[Any]] = {}
        for cand in found.values():
            by_file.setdefault(cand.path, []).append(cand)
        count = 0
        for path, cands in by_file.items():
            try:
                table = pq.read_table(
                    store / path, columns=["prompt_ids", "output_ids", "stop_token_id", "finish_reason"]
                )
                rows = table.take(pa.array([c.row for c in cands], type=pa.int64())).to_pylist()
            except (OSError, pa.ArrowException, IndexError) as e:
                log.warning("index points at unreadable %s (%s): dropping its entries", store / path, e)
                index.remove_shard(store / path)
                continue
            origin = f"{Path(path).parent.name}/{Path(path).stem}"
            for cand, old in zip(cands, rows, strict=True):
                conv = work.convs[(cand.prompt_id, cand.sample_idx)]
                ids = work.renderer.next_context(conv)
                if ids != old["prompt_ids"]:
                    continue  # rendered differently (should not happen under one reuse_key): generate it
                budget = work.budget(len(ids))
                if not fits_context(len(ids), budget, work.context) or budget < work.min_new_tokens:
                    continue  # a fresh build skips it, so reuse does too (next_requests records the skip)
                output = list(old["output_ids"])
                use = cand.use_for(budget)
                if use == "continue":
                    conv.prefix, conv.prefix_from = output, origin  # the engine generates the rest
                    continue
                if use == "whole":
                    result = Result(conv.prompt_id, conv.sample_idx, output, R.FINISH_STOP, old["stop_token_id"])
                else:  # a prefix of a longer sample is this budget's truncated sample (or window's)
                    result = Result(conv.prompt_id, conv.sample_idx, output[:budget], work.ran_out(budget))
                turn = _apply(conv, ids, result)
                turn.reused_from = origin
                journal.append(_journal_row(conv, turn))
                count += 1
        journal.sync()
        if count:
            log.info("%s: %d rows reused from earlier completions", work.label, count)
        return count


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
        elif budget < work.min_new_tokens:
            window = work.plan.config.trainer
            reason = (
                f"prompt of {len(prompt_ids)} tokens leaves {max(budget, 0)} new tokens in the trainer's window of "
                f"{window.max_length} (trainer.min_new_tokens {window.min_new_tokens})"
            )
        if reason is not None:
            if conv.turns:  # later turns: the conversation ends with what it has
                conv.finish(conv.turns[-1].finish_reason, reason)
            else:
                conv.finish(R.FINISH_SKIPPED, reason)
            progress.update(Result(conv.prompt_id, conv.sample_idx, [], conv.finish_reason), True)
            continue
        seed = row_seed(sampling.seed, conv.prompt_id, conv.sample_idx, len(conv.turns))
        # continue an earlier truncated answer with what is left of the budget
        params = dataclasses.replace(work.params, max_new_tokens=budget - len(conv.prefix))
        prompt_ids = prompt_ids + conv.prefix
        requests.append(Request(conv.prompt_id, conv.sample_idx, prompt_ids, params, seed))
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
    turn = _apply(conv, context_ids, result)
    if conv.prefix_from is not None:
        turn.reused_from, turn.continued = conv.prefix_from, True
        conv.prefix, conv.prefix_from = [], None
    return turn


def start_engine(work: ShardWork, lease: gpus.GpuLease | None) -> engines.Engine:
    """The job's own engine, or (``engine.shared``, or a server backend) a client of the long-lived
    engine servers this config's jobs share (see engine_host)."""
    cfg = work.plan.config
    stop_ids = chat.stop_token_ids(work.tokenizer, cfg.model.path)
    if engine_host.served(cfg.engine):
        fingerprint = work.plan.model_fingerprint
        return engine_host.open_engine(cfg, stop_ids, lease, work.tokenizer, fingerprint, work.context)
    return engines.load(cfg.engine, cfg.model, stop_ids, lease, work.tokenizer)


def engine_name(engine: engines.Engine, backend: str, lease: gpus.GpuLease | None) -> str:
    """How a warning names the engine: a server's own name (slot, URLs), else the backend and its GPU."""
    name = getattr(engine, "name", None)
    if name:
        return str(name)
    return f"the in-process {backend} engine" + (f" on GPU {lease.gpu}" if lease is not None else "")


STALL_STOP_GRACE_SECONDS = 10.0  # an interrupted engine returns within this, or the job exits at once
STALLED_EXIT_CODE = 75  # EX_TEMPFAIL: a rerun finishes the shard


class StallStop:
    """An in-process engine that makes no progress cannot be replaced: stop the job, keeping the journal.

    The engine is interrupted; if it returns, the job fails with :class:`engines.EngineStalled`. A hung
    one (a wedged GPU, a kernel that never returns) never does, so after a grace the journal is synced
    and the process exits, as a kill would (the fault tests prove a rerun loses nothing then).
    """

    def __init__(self, engine: engines.Engine, journal: Journal, grace: float = STALL_STOP_GRACE_SECONDS) -> None:
        self.engine, self.journal, self.grace = engine, journal, grace
        self.message: str | None = None
        self.returned = threading.Event()  # the job's thread is out of the engine

    def __call__(self, message: str) -> None:
        self.message = (
            f"{message}. It runs in this job, so it cannot be replaced: the rows finished so far are kept in "
            f"{self.journal.path}; check the GPU (nvidia-smi) and the job's log, then run the build again"
        )
        log.error("%s", self.message)
        self.engine.interrupt()
        if self.returned.wait(self.grace):
            return
        self.journal.sync()
        log.error("the engine did not return within %gs of its interrupt: exiting now", self.grace)
        logging.shutdown()
        os._exit(STALLED_EXIT_CODE)

    def check(self) -> None:
        self.returned.set()
        if self.message is not None:
            raise engines.EngineStalled(self.message)


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
                    counts.served = getattr(engine, "identity", None)
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
                    journal.append(_journal_row(conv, turn))
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


class ShardFailedError(RuntimeError):
    """Too many rows of a shard could not be generated; publishing it would hide that."""


def check_failures(stats: dict[str, Any], max_failed_fraction: float, journal_path: Path) -> None:
    """Refuse to publish a shard whose rows mostly (or all) ended as error, abort or skipped."""
    rows = stats[R.STAT_INPUT_ROWS]
    failed = stats[R.STAT_ERROR] + stats[R.STAT_SKIPPED]
    if rows == 0 or failed / rows <= max_failed_fraction:
        return
    reasons = sorted(stats["errors"].items(), key=lambda kv: -kv[1])[:3]
    lines = [
        f"{stats['source']}/{stats['shard']}: {failed} of {rows} rows could not be generated "
        f"({stats[R.STAT_ERROR]} error/abort, {stats[R.STAT_SKIPPED]} skipped over the context); "
        f"the limit is {max_failed_fraction:.0%} (checks.max_failed_fraction). Nothing was published; "
        f"finished rows stay in {journal_path}."
    ]
    lines += [f"  {n} x {reason}" for reason, n in reasons]
    lines.append(
        "Skipped rows: raise model.context_length or lower sampling.max_new_tokens; template errors: "
        "fix model.chat_template; engine aborts: see the engine log above."
    )
    raise ShardFailedError("\n".join(lines))


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
    rows = [_completion_row(conv, work.renderer, sampling.seed) for conv in convs]
    stats = _stats(work.plan, work.source, work.shard, rows, resumed, lease, wall, engine_run.engine_tokens)
    turns = [t for conv in convs for t in conv.turns]
    retokenized = sum(t.retokenized for t in turns)
    stats[R.STAT_RETOKENIZED_TURNS] = retokenized
    stats[R.STAT_RETOKENIZE_DRIFT] = round(sum(t.drifted for t in turns) / retokenized, 6) if retokenized else 0.0
    reused_from: dict[str, int] = {}
    continued = 0
    for conv in convs:
        if conv.turns and conv.turns[0].reused_from:
            reused_from[conv.turns[0].reused_from] = reused_from.get(conv.turns[0].reused_from, 0) + 1
            continued += conv.turns[0].continued
    stats[R.STAT_REUSED] = sum(reused_from.values()) - continued
    stats[R.STAT_CONTINUED] = continued
    stats[R.STAT_REUSED_FROM] = reused_from
    stats[R.STAT_GENERATED] = engine_run.journaled
    if engine_run.served is not None:
        stats["engine"]["served"] = engine_run.served
    if work.spec.turns == "all":
        stats[R.STAT_TURNS] = turn_counts(list(convs))
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


def turn_counts(convs: list[Conversation]) -> dict[str, Any]:
    """What ``turns: all`` made of a shard's conversations: how many turns each got, how many became
    per-turn samples, and how many ended before their last answer (the row's ``error`` says why)."""
    by_count: dict[str, int] = {}
    for conv in convs:
        by_count[str(len(conv.turns))] = by_count.get(str(len(conv.turns)), 0) + 1
    return {
        "conversations": len(convs),
        "turns": sum(len(c.turns) for c in convs),
        "per_turn": sum(c.per_turn for c in convs),
        "history_retokenized": sum(t.history_retokenized for c in convs for t in c.turns),
        "ended_early": sum(0 < len(c.turns) < len(c.slots) for c in convs),
        "by_count": dict(sorted(by_count.items(), key=lambda kv: int(kv[0]))),
    }


# What the row index needs of a completion shard (restore reads only these).
_INDEXED_COLUMNS = ("prompt_id", "sample_idx", "finish_reason", "n_output_tokens", "n_prompt_tokens", "turns")


def _link_outputs(journal: Journal, paths: ShardPaths) -> None:
    atomic.link(journal.published_data, paths.data)
    atomic.link(journal.published_stats, paths.stats)


def _index_shard(plan: Plan, source: str, data: Path, rows: list[dict[str, Any]]) -> None:
    sp = plan.sources[source]
    with RowIndex.open(plan.config.store, sync=False) as index:
        index.add_shard(reuse_key(sp.gen_components), sp.gen_key, data, rows, sp.spec.sampling.max_new_tokens)


def _result_of(row: dict[str, Any]) -> Result:
    return Result(
        row["prompt_id"],
        row["sample_idx"],
        row["output_ids"],
        row["finish_reason"],
        row["stop_token_id"],
        row["error"],
        retokenized=row.get("retokenized", False),
        # a journaled drift is replayed as a count that cannot match
        engine_output_tokens=-1 if row.get("drifted") else None,
    )


def _apply(conv: Conversation, context_ids: list[int], result: Result) -> Turn:
    """Record one answer; the conversation ends unless it stopped cleanly and has more slots."""
    drifted = result.engine_output_tokens is not None and result.engine_output_tokens != len(result.output_ids)
    turn = Turn(
        context_ids,
        list(result.output_ids),
        result.finish_reason,
        result.stop_token_id,
        result.error,
        result.retokenized,
        result.retokenized and drifted,
    )
    turn.history_retokenized = conv.per_turn and bool(conv.turns)
    conv.turns.append(turn)
    if result.finish_reason != R.FINISH_STOP:
        conv.finish(result.finish_reason, result.error)
    elif len(conv.turns) == len(conv.slots):
        conv.finish(R.FINISH_STOP)
    return turn


def _completion_row(conv: Conversation, renderer: Renderer, base_seed: int) -> dict[str, Any]:
    turns = conv.turns
    first = turns[0] if turns else None
    last = turns[-1] if turns else None
    multi = len(conv.slots) > 1
    return {
        "prompt_id": conv.prompt_id,
        "sample_idx": conv.sample_idx,
        "seed": row_seed(base_seed, conv.prompt_id, conv.sample_idx),
        "prompt_ids": first.context_ids if first else [],
        "output_ids": last.output_ids if last else [],
        "stop_token_id": last.stop_token_id if last and conv.finish_reason == R.FINISH_STOP else None,
        "text": renderer.decode(last.output_ids) if last else "",
        "finish_reason": conv.finish_reason,
        "error": conv.error,
        "n_prompt_tokens": len(first.context_ids) if first else 0,
        "n_output_tokens": sum(len(t.output_ids) for t in turns),
        "reused_from": first.reused_from if first else None,
        "continued": bool(first and first.continued),
        "per_turn": conv.per_turn if multi else None,
        "turns": [
            {
                "context_ids": t.context_ids,
                "output_ids": t.output_ids,
                "stop_token_id": t.stop_token_id,
                "finish_reason": t.finish_reason,
                "text": renderer.decode(t.output_ids),
                "history_retokenized": t.history_retokenized,
            }
            for t in turns
        ]
        if multi
        else None,
    }


def _stats(
    plan: Plan,
    source: str,
    shard: str,
    rows: list[dict[str, Any]],
    resumed_turns: int,
    lease: gpus.GpuLease | None,
    wall: float,
    engine_tokens: int,
) -> dict[str, Any]:
    cfg = plan.config
    sp = plan.sources[source]
    output_tokens = sum(r["n_output_tokens"] for r in rows)

    def count(*reasons: str) -> int:
        return sum(r["finish_reason"] in reasons for r in rows)

    stats = {
        "stage": "generate",
        "source": source,
        "shard": shard,
        "gen_key": sp.gen_key,
        "components": sp.gen_components,
        "model_fingerprint": plan.model_fingerprint,
        "template_fingerprint": plan.template_fingerprint,
        # Recorded; only the options that change the numbers are keyed (keys.ENGINE_OPTIONS).
        "engine": {
            "backend": cfg.backend,
            "options": dict(cfg.engine_options),
            "host": platform.node(),
            "gpu": None
            if lease is None
            else {"id": lease.gpu, "node_gpu": lease.node_id, "port": lease.port, "via": lease.source},
        },
        "scheduler_job": gpus.scheduler_job(),  # e.g. SLURM_JOB_ID: which allocation wrote this shard
        R.STAT_INPUT_ROWS: len(rows),
        R.STAT_OK: count(R.FINISH_STOP),
        R.STAT_TRUNCATED: count(R.FINISH_LENGTH),
        R.STAT_WINDOW: count(R.FINISH_WINDOW),
        R.STAT_ERROR: count(R.FINISH_ERROR, R.FINISH_ABORT),
        R.STAT_SKIPPED: count(R.FINISH_SKIPPED),
        R.STAT_RESUMED_TURNS: resumed_turns,
        R.STAT_PROMPT_TOKENS: sum(r["n_prompt_tokens"] for r in rows),
        R.STAT_OUTPUT_TOKENS: output_tokens,
        R.STAT_WALL_SECONDS: round(wall, 3),
        # what the engine produced in this run: reused, resumed and continued-from tokens cost nothing
        R.STAT_OUTPUT_TOK_PER_S: round(engine_tokens / wall, 3) if wall > 0 else None,
        "started_at": round(time.time() - wall, 3),
        "finished_at": round(time.time(), 3),
        "errors": _error_summary(rows),
    }
    accounted = sum(stats[k] for k in (R.STAT_OK, R.STAT_TRUNCATED, R.STAT_WINDOW, R.STAT_ERROR, R.STAT_SKIPPED))
    if accounted != stats[R.STAT_INPUT_ROWS]:
        raise RuntimeError(f"{source}/{shard}: {accounted} rows accounted for, {len(rows)} in the shard")
    return stats


def _error_summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Error and skip reasons with their counts (numbers folded so reasons group)."""
    import re

    counts: dict[str, int] = {}
    for r in rows:
        if r["error"]:
            reason = re.sub(r"\d+", "N", r["error"])[:200]
            counts[reason] = counts.get(reason, 0) + 1
    return counts
