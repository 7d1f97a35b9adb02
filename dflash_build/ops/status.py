"""Where a build stands, from the store alone: `dflash-build status`.

Read only, and without taking any lock, so it never slows or blocks a build; it works from any
terminal on the working directory or store, also while Snakemake runs and under SLURM (the store is
on the shared file system). The facts it reads:

- the plan: every shard of every source, and the rows of each (the prompt shards, once prepared);
- published shards: their stats sidecars (rows by outcome, start and end, output tokens);
- journals of unpublished shards: the rows finished so far, each with the time it finished;
- shard locks: the job holding one writes who it is (pid, host, since when) and clears it when done;
- shared engines: their state files in ``engine.lock_dir`` (slot, GPU, backend, URL, pid).

Rates are over the last ``window`` seconds: rows journaled in it, and the part of each published
shard's generation that fell in it.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_build import running, workflow
from dflash_build.engines import host as engine_host
from dflash_build.engines.base import tau
from dflash_build.ops import estimate, standing
from dflash_build.plan import Plan
from dflash_build.store import layout
from dflash_build.store import records as R
from dflash_build.store.journal import LOCK_FILE, ROWS_FILE, Journal, answers

WINDOW_SECONDS = 600.0
_HOLDER = re.compile(r"pid (\d+) on (\S+), working directory .*, since (.+)$")


@dataclass
class Job:
    source: str
    shard: str
    pid: int
    host: str
    since: float | None
    rows_done: int
    rows: int
    last_row_ago: float | None  # seconds since its last finished row (None: none yet)


@dataclass
class SourceStatus:
    source: str
    rows: int
    rows_known: bool  # False: not prepared yet; rows is the plan's upper bound
    rows_done: int = 0
    shards: int = 0
    shards_done: int = 0
    failed: int = 0  # error and abort rows
    skipped: int = 0
    truncated: int = 0
    loops: int = 0  # rows the engine stopped on the loop rule (config degenerate.loop.stop_early)
    # engine.drafter: rows the engine counted, their verify steps and accepted drafts (τ = 1 + accepted/steps)
    measured: int = 0
    spec_steps: int = 0
    spec_accepted: int = 0

    def count(self, measured: int, steps: int, accepted: int) -> None:
        self.measured, self.spec_steps, self.spec_accepted = (
            self.measured + measured,
            self.spec_steps + steps,
            self.spec_accepted + accepted,
        )


@dataclass
class Status:
    at: float
    window_seconds: float
    rows: int = 0
    rows_done: int = 0
    rows_per_second: float = 0.0
    output_tokens_per_second: float = 0.0
    eta_seconds: float | None = None
    done: bool = False
    sources: list[SourceStatus] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)
    starting: list[dict[str, Any]] = field(default_factory=list)  # engine hosts whose server is not ready yet
    others: list[dict[str, Any]] = field(default_factory=list)  # running jobs of other stages (accept, mix, ...)
    build: dict[str, Any] | None = None  # the live Snakemake of this working directory (None: none runs)
    standing: str | None = None  # a standing dataset's lost shards (ops.standing): not left to build

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Window:
    """Rows and output tokens finished within the last ``seconds``, and over how long: a build that
    started two minutes ago has a two-minute rate, not a tenth of a ten-minute one."""

    def __init__(self, now: float, seconds: float) -> None:
        self.start, self.now = now - seconds, now
        self.first = now  # the earliest activity counted
        self.rows = self.tokens = 0.0

    def add_span(self, started: float, finished: float, rows: float, tokens: float) -> None:
        """A published shard's generation, spread evenly over its span."""
        overlap = min(finished, self.now) - max(started, self.start)
        if overlap > 0:
            share = overlap / max(finished - started, 1e-9)
            self.rows, self.tokens = self.rows + rows * share, self.tokens + tokens * share
            self.first = min(self.first, max(started, self.start))

    def add_job(self, since: float | None) -> None:
        """A running job counts from its start, rows or not."""
        if since is not None:
            self.first = min(self.first, max(since, self.start))

    def add_row(self, at: float | None, tokens: int) -> None:
        if at is not None and at >= self.start:
            self.rows, self.tokens = self.rows + 1, self.tokens + tokens
            self.first = min(self.first, at)

    def per_second(self, amount: float) -> float:
        return amount / (self.now - self.first) if self.now > self.first else 0.0


def collect(plan: Plan, window: float = WINDOW_SECONDS, now: float | None = None) -> Status:
    """The build's state now: per source, per running job and per engine."""
    now = time.time() if now is None else now
    status = Status(at=now, window_seconds=window)
    recent = _Window(now, window)
    wanted = estimate.wanted_shards(plan)  # mix.generate as_needed: the shards the build will generate
    lost = standing.standing(plan)
    held = frozenset(lost.missing) if lost is not None else frozenset()
    status.standing = lost.line() if lost is not None else None
    for name, sp in plan.sources.items():
        samples = sp.spec.sampling.samples_per_prompt
        n = wanted.get(name, sp.n_shards)
        shards = [
            (shard, prompts, completion)
            for shard, prompts, completion in zip(
                sp.shards[:n], plan.prompt_shards(name)[:n], plan.completion_shards(name)[:n], strict=True
            )
            if f"{name}/{shard}" not in held  # a build makes none of them while the dataset stands
        ]
        source = SourceStatus(name, 0, True, shards=len(shards))
        for shard, prompts, completion in shards:
            stats_file = layout.sidecar(completion)
            if completion.exists() and stats_file.exists():
                _published(source, json.loads(stats_file.read_text()), recent)
                continue
            rows = _planned_rows(prompts, sp.planned_rows, sp.n_shards, samples)
            source.rows_known &= prompts.exists()
            source.rows += rows
            job = _journaled(name, shard, plan.journal_dir(name, shard), rows, source, recent, now)
            if job is not None:
                status.jobs.append(job)
        status.sources.append(source)
    status.rows = sum(s.rows for s in status.sources)
    status.rows_done = sum(s.rows_done for s in status.sources)
    status.rows_per_second = recent.per_second(recent.rows)
    status.output_tokens_per_second = recent.per_second(recent.tokens)
    status.done = status.rows_done >= status.rows and all(s.shards_done == s.shards for s in status.sources)
    left = status.rows - status.rows_done
    status.build = workflow.build_running(Path.cwd())
    records = running.jobs(plan.config.logs)
    _add_recorded(status, records)
    if not status.done and status.rows_per_second > 0 and status.build is not None:
        status.eta_seconds = left / status.rows_per_second  # no build, no end to foresee
    status.engines = [_engine(e, now) for e in engine_host.running(plan.config.engine.lock_dir)]
    status.starting = [
        {**s, "waiting": [f"{r['source']}/{r['shard']}" for r in records if r.get("stage") == "generate"]}
        for s in engine_host.starting(plan.config.engine.lock_dir)
    ]
    return status


def _add_recorded(status: Status, records: list[dict[str, Any]]) -> None:
    """The jobs running by their own records: a generate job the journals missed (it has not taken its
    shard's lock yet: loading, waiting for its engine), and the other stages' jobs with their progress."""
    seen = {(j.source, j.shard) for j in status.jobs}
    for r in records:
        if r.get("stage") == "generate":
            if (r.get("source"), r.get("shard")) not in seen:
                status.jobs.append(Job(r["source"], r["shard"], r["pid"], r["host"], r.get("since"), 0, 0, None))
        else:
            status.others.append(r)


def _planned_rows(prompts: Path, planned: int, shards: int, samples: int) -> int:
    if prompts.exists():
        return pq.read_metadata(prompts).num_rows * samples
    return -(-planned // max(shards, 1)) * samples  # not prepared: the plan's upper bound


def _published(source: SourceStatus, stats: dict[str, Any], recent: _Window) -> None:
    rows = int(stats.get(R.STAT_INPUT_ROWS, 0))
    source.rows += rows
    source.rows_done += rows
    source.shards_done += 1
    source.failed += int(stats.get(R.STAT_ERROR, 0))
    source.skipped += int(stats.get(R.STAT_SKIPPED, 0))
    source.truncated += int(stats.get(R.STAT_TRUNCATED, 0))
    source.loops += int(stats.get(R.STAT_LOOPS_STOPPED, 0))
    if drafted := stats.get(R.STAT_DRAFTING):
        source.count(int(drafted["rows"]), int(drafted["steps"]), int(drafted["accepted"]))
    if "started_at" in stats and "finished_at" in stats:
        generated = float(stats.get(R.STAT_GENERATED, rows))
        tokens = float(stats.get(R.STAT_OUTPUT_TOKENS, 0)) * (generated / rows if rows else 0.0)
        recent.add_span(float(stats["started_at"]), float(stats["finished_at"]), generated, tokens)


def _journaled(
    source_name: str, shard: str, folder: Path, rows: int, source: SourceStatus, recent: _Window, now: float
) -> Job | None:
    """Count a shard's journaled rows (read, never locked); the job holding it, if one does."""
    finished: dict[tuple[str, int], dict[str, Any]] = {}
    # a degenerate attempt asked again is no row's answer (the sidecar counts it as regenerated)
    for row in answers(Journal.read(folder / ROWS_FILE)):
        finished[(row["prompt_id"], row["sample_idx"])] = row
        recent.add_row(row.get("at"), len(row.get("output_ids") or []))
        if counted := row.get("acceptance"):  # each answer (turn) a drafter served, as the engine counted it
            source.count(int(not row.get("turn")), int(counted["steps"]), int(counted["accepted"]))
    source.rows_done += len(finished)
    source.failed += sum(r["finish_reason"] in R.NO_ANSWER for r in finished.values())
    source.skipped += sum(r["finish_reason"] == R.FINISH_SKIPPED for r in finished.values())
    source.truncated += sum(r["finish_reason"] == R.FINISH_LENGTH for r in finished.values())
    source.loops += sum(r["finish_reason"] == R.FINISH_LOOP for r in finished.values())
    holder = _holder(folder / LOCK_FILE)
    if holder is None:
        return None
    pid, host, since = holder
    recent.add_job(since)
    last = max((r["at"] for r in finished.values() if r.get("at") is not None), default=None)
    return Job(source_name, shard, pid, host, since, len(finished), rows, None if last is None else now - last)


def _holder(lock: Path) -> tuple[int, str, float | None] | None:
    """Who holds a shard's lock, from what the job wrote in it; a dead process on this host holds none."""
    try:
        text = lock.read_text().strip()
    except OSError:
        return None
    match = _HOLDER.match(text)
    if match is None:
        return None
    pid, host = int(match.group(1)), match.group(2)
    if host == platform.node() and not engine_host.alive(pid):  # the one liveness rule (zombies too)
        return None  # killed (SIGKILL leaves the text): the lock went with the process
    try:
        since: float | None = time.mktime(time.strptime(match.group(3)))
    except ValueError:
        since = None
    return pid, host, since


def _engine(state: dict[str, Any], now: float) -> dict[str, Any]:
    keys = ("slot", "gpu", "backend", "url", "pid", "server_pid", "ready_at", "identity_key")
    out = {k: state.get(k) for k in keys}
    out["up_seconds"] = round(now - state["ready_at"], 1) if state.get("ready_at") else None
    return out


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def text(status: Status) -> str:
    """The plain-text view (what `status` prints when not on a terminal, and under --watch's bars)."""
    share = status.rows_done / status.rows if status.rows else 1.0
    head = "done" if status.done else f"ETA {_duration(status.eta_seconds)}"
    lines = [
        f"rows {status.rows_done}/{status.rows} ({share:.1%}), {status.rows_per_second:.2f} rows/s, "
        f"{status.output_tokens_per_second:.1f} output tok/s (last {_duration(status.window_seconds)}); {head}",
        f"{'source':<28}{'rows done':>12}{'rows':>10}{'shards':>10}{'failed':>8}{'skipped':>9}{'truncated':>11}"
        f"{'loops':>7}",
    ]
    for s in status.sources:
        rows = f"{s.rows}" if s.rows_known else f"≤{s.rows}"
        shards = f"{s.shards_done}/{s.shards}"
        lines.append(
            f"{s.source:<28}{s.rows_done:>12}{rows:>10}{shards:>10}{s.failed:>8}{s.skipped:>9}{s.truncated:>11}"
            f"{s.loops:>7}"
        )
    lines += _drafting(status.sources)
    if status.build is None and not status.done:
        lines[0] += " (no Snakemake runs this build now: run it again to go on; `dflash-build plan` says what is left)"
    lines.append(f"jobs running: {len(status.jobs) + len(status.others)}")
    for r in status.others:
        what = "/".join(str(r[k]) for k in ("stage", "source", "shard", "format") if r.get(k))
        done = r.get("progress") or {}
        progress = ", ".join(f"{k} {v}" for k, v in done.items())
        lines.append(
            f"  {what}: {progress or 'started'}; pid {r['pid']} on {r['host']} "
            f"running {_duration(status.at - r['since'])}"
        )
    for j in status.jobs:
        since = f"running {_duration(status.at - j.since)}" if j.since else ""
        last = "no row yet" if j.last_row_ago is None else f"last row {_duration(j.last_row_ago)} ago"
        lines.append(f"  {j.source}/{j.shard}: {j.rows_done}/{j.rows} rows, {last}; pid {j.pid} on {j.host} {since}")
    if status.standing is not None:
        lines.append(status.standing)
    lines.append(
        f"engines running: {len(status.engines)}" + (f", {len(status.starting)} starting" if status.starting else "")
    )
    for e in status.starting:
        waiting = f"; jobs waiting: {', '.join(e['waiting'])}" if e["waiting"] else ""
        lines.append(
            f"  {e['slot']}: starting for {_duration(status.at - e['since'])} (host pid {e['host_pid']}){waiting}"
        )
    for e in status.engines:
        lines.append(
            f"  {e['slot']}: {e['backend']} on {'GPU ' + str(e['gpu']) if e['gpu'] else 'CPU'} at {e['url']}, "
            f"server pid {e['server_pid']}, up {_duration(e['up_seconds'])}"
        )
    return "\n".join(lines)


def _drafting(sources: list[SourceStatus]) -> list[str]:
    """τ so far where engine.drafter served generation: overall and per source (nothing without it)."""

    def shown(steps: int, accepted: int) -> str:
        per_token = tau(steps, accepted)
        return "-" if per_token is None else f"{per_token:.2f}"

    measured = [s for s in sources if s.measured]
    if not measured:
        return []
    steps, accepted = sum(s.spec_steps for s in measured), sum(s.spec_accepted for s in measured)
    each = ", ".join(f"{s.source} {shown(s.spec_steps, s.spec_accepted)}" for s in measured)
    count = sum(s.measured for s in measured)
    return [f"drafter: τ {shown(steps, accepted)} tokens per verify step over {count} rows it served ({each})"]


def watch(plan: Plan, every: float, window: float = WINDOW_SECONDS, as_json: bool = False) -> int:
    """Refresh every ``every`` seconds until the build is done (or Ctrl-C): progress bars on a
    terminal (rich), the plain text (or a JSON line) each time otherwise."""
    import sys

    try:
        if as_json or not sys.stdout.isatty():
            while True:
                now = collect(plan, window)
                print(json.dumps(now.as_dict()) if as_json else text(now) + "\n", flush=True)
                if now.done:
                    return 0
                time.sleep(every)
        _watch_bars(plan, every, window)
    except KeyboardInterrupt:
        pass
    return 0


def _watch_bars(plan: Plan, every: float, window: float) -> None:
    from rich.live import Live

    screen = Screen()
    with Live(refresh_per_second=2) as live:
        while True:
            now = collect(plan, window)
            live.update(screen.frame(now))
            if now.done:
                return
            time.sleep(every)


class Screen:
    """The ``--watch`` screen: a bar per source and the total (rich), then the rate, jobs and engines."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        columns = (
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"),
        )
        self.bars = Progress(*columns)
        self.tasks: dict[str, Any] = {}

    def frame(self, now: Status) -> Any:
        from rich.console import Group

        eta = "done" if now.done else f"ETA {_duration(now.eta_seconds)}"
        for s in [*now.sources, SourceStatus("total", now.rows, True, now.rows_done)]:
            note = eta if s.source == "total" else f"{s.shards_done}/{s.shards} shards"
            if s.source not in self.tasks:
                self.tasks[s.source] = self.bars.add_task(s.source, total=max(s.rows, 1), note=note)
            self.bars.update(self.tasks[s.source], completed=s.rows_done, total=max(s.rows, 1), note=note)
        lines = text(now).split("\n")
        # the rate line, then the jobs and engines (the per-source table is the bars)
        return Group(self.bars, lines[0], *lines[2 + len(now.sources) :])
