"""Preflight (`dflash-build preflight`, `snakemake preflight`; not part of `all`): prove the engine, its options
and the target's answers on this node in minutes, before the days of GPU time.

In order, each problem one line naming the setting or package and the change (:mod:`.checks`):

1. **the environment**: the engine's interpreter (the env ``envs/`` names for the backend) imports the engine;
   its version, torch's and CUDA's; every GPU the build would use against the architectures torch carries
   kernels for (:func:`dflash_build.engines.probe.kernels_for`);
2. **the model folder**: its weights, architecture and dtype, and what a hybrid target needs of the engine;
3. **the engines**, started on every GPU at once by the build's own host (same options), each timed to
   ready, with what it says about itself in its log (its KV cache, the kernels it chose) set against the
   requests the build keeps in flight;
4. **a pilot**: ``preflight.rows`` prompts of every source (and variant) from its first unbuilt shard through
   the real driver, and more of the largest source to measure the speed at the build's own batch. Their rows
   are the build's: journaled in the shard's journal under its keys, so the build resumes them and generates
   none of them again. From them: output tok/s per GPU (which `plan` then uses), finish reasons (a ``length``
   share over ``preflight.max_length_share``), the thinking switch (a template that renders the same either
   way, answers that think where it is off), tool calls parsed, degenerate answers;
5. with ``engine.drafter``, first (before the pilot journals the drafter's rows): its parity guard, the pilot's
   requests with the drafter and without on the same seeds, compared (:mod:`.parity`); generate refuses a
   drafter whose guard failed or has not run on this engine identity.

The summary, PASS or FAIL with every problem, is written to ``LOGS/preflight/NAME.json`` and ``.md``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash_build import engines, toolcalls
from dflash_build.engines import EngineFailed, gpus, probe, registry
from dflash_build.engines import host as engine_host
from dflash_build.engines.host import logs as engine_logs
from dflash_build.engines.host.served import concurrency
from dflash_build.plan import Plan
from dflash_build.spec import ConfigError
from dflash_build.stages import generate
from dflash_build.stages.common import chat, crosssource
from dflash_build.stages.common.job import Job
from dflash_build.stages.generate.work import ShardPaths, ShardWork
from dflash_build.stages.preflight import checks, parity
from dflash_build.stages.preflight.checks import FAIL, Problem
from dflash_build.stages.registry import planned
from dflash_build.store import atomic, layout
from dflash_build.store.journal import Journal

log = logging.getLogger(__name__)

LOAD_POLL_SECONDS = 0.2  # how often the pilot's engines are asked for their load
LOG_TAIL_BYTES = 4 << 20  # an engine's log is read from its end: it logs its settings once, at start


def run(job: Job) -> dict[str, Any]:
    """Every check, then the summary beside the logs (the job succeeds with a FAIL summary: the CLI says it)."""
    summary = check(job.plan)
    write(Path(job.output("summary")), summary)
    return summary


def check(plan: Plan) -> dict[str, Any]:
    """The environment and the model; then, where they pass, the engines and the pilot."""
    cfg = plan.config
    parts, problems = before_engines(plan)
    if cfg.engine.drafter is not None and checks.verdict(problems) == "PASS":
        try:  # first: a failing drafter's pilot rows would be journaled for the build
            parts["parity"], found = parity.guard(plan)
            problems += found
        except EngineFailed as e:
            problems.append(Problem(FAIL, "engine", " ".join(str(e).split())))
    if checks.verdict(problems) == "PASS":
        try:
            with started_engines(plan) as states, watched(plan, states) as loads:
                parts["pilot"], found = pilot(plan)
                problems += found
                parts["engines"], found = engine_reports(plan, states, parts["pilot"], parts["at"])
                problems += found
            for report in parts["engines"]:
                report.update(loads.get(report["slot"], {}))
        except EngineFailed as e:
            problems.append(Problem(FAIL, "engine", " ".join(str(e).split())))
    parts["seconds"] = round(time.time() - parts["at"], 1)
    log.info("preflight of %s: %s", cfg.dataset_name, checks.verdict(problems))
    return checks.summary(parts, problems)


def before_engines(plan: Plan) -> tuple[dict[str, Any], list[Problem]]:
    """What needs no engine: the engine's environment and GPUs, and the model folder (seconds)."""
    cfg = plan.config
    backend = registry.get(cfg.engine.backend)
    parts: dict[str, Any] = {"dataset": cfg.dataset_name, "backend": cfg.engine.backend, "at": round(time.time(), 3)}
    parts["gpus_used"] = engines.uses_gpu(cfg.engine)
    problems: list[Problem] = []
    try:
        registry.check_environment(cfg.engine)
    except ConfigError as e:
        problems.append(Problem(FAIL, "environment", str(e)))
    if backend.preflight is not None and not problems:
        python = backend.preflight.python(cfg.engine.options)
        probed = probe.probe(python, backend.preflight.package)
        parts["environment"], found = checks.environment(
            probed, backend.preflight.package, backend.conda_env, engines.uses_gpu(cfg.engine)
        )
        problems += found
    hybrid_needs = backend.preflight.hybrid(cfg.engine.options) if backend.preflight is not None else None
    parts["model"], found = checks.model_folder(cfg.model.path, hybrid_needs)
    return parts, problems + found


@contextlib.contextmanager
def started_engines(plan: Plan) -> Iterator[list[dict[str, Any]]]:
    """With shared engines: one on every GPU the build would use (the CPU's one without GPUs), started at once
    by the build's own host and held through the pilot (they stop when the workflow ends, as a build's do).
    An engine of each job's own is started by the pilot, as a job starts it."""
    cfg = plan.config
    if not (cfg.engine.shared and engine_host.through_server(cfg.engine)):
        yield []
        return
    tokenizer = chat.load_tokenizer(cfg.model, plan.tokenizer_cache())
    stop_ids = chat.stop_token_ids(tokenizer, cfg.model.path)
    leases = gpus.every_gpu(cfg.engine) if engines.uses_gpu(cfg.engine) else [None]
    specs = [
        engine_host.launch_spec(cfg, stop_ids, lease, plan.model_fingerprint, chat.context_length(cfg.model))
        for lease in leases
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(engine_host.attach, spec, False) for spec in specs]
    attached = [f.result() for f in futures if f.exception() is None]
    if len(attached) < len(futures):  # one did not start: the others are let go before its error is said
        for a in attached:
            a.release()
        next(f.result() for f in futures if f.exception() is not None)
    try:
        yield [state for a in attached for state in a.engines]
    finally:
        for a in attached:
            a.release()


@contextlib.contextmanager
def watched(plan: Plan, states: list[dict[str, Any]]) -> Iterator[dict[str, dict[str, float]]]:
    """Each engine's load while the pilot runs, from its /metrics where the backend reads them: the peak of
    requests running and waiting and of KV cache usage, by slot (filled in when the block ends)."""
    load = getattr(registry.get(plan.config.engine.backend).preflight, "load", None)
    peaks: dict[str, dict[str, float]] = {}
    if load is None or not states:
        yield peaks
        return
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(LOAD_POLL_SECONDS):
            for state in states:
                try:
                    with urllib.request.urlopen(f"{state['url']}/metrics", timeout=5) as answer:
                        now = load(answer.read().decode())
                except (OSError, ValueError):
                    continue
                seen = peaks.setdefault(state["slot"], {})
                for name, value in now.items():
                    seen[f"peak_{name}"] = max(seen.get(f"peak_{name}", 0.0), value)

    sampler = threading.Thread(target=sample, name="preflight-load", daemon=True)
    sampler.start()
    try:
        yield peaks
    finally:
        stop.set()
        sampler.join()


def pilot(plan: Plan) -> tuple[dict[str, Any], list[Problem]]:
    """Each source's pilot rows through the real driver, one source after another, and what they show."""
    cfg = plan.config
    speed_source = max(sorted(plan.sources), key=lambda s: (plan.sources[s].n_shards, plan.sources[s].planned_rows))
    by_source, problems = {}, []
    totals = Counter[str]()
    for name in sorted(plan.sources):
        rows = cfg.preflight.rows
        if name == speed_source:
            rows = max(rows, _speed_rows(plan))
        try:
            figures, found = pilot_source(plan, name, rows)
        except (EngineFailed, OSError):  # the engine (every source's), the store: the run's end
            raise
        except Exception as e:  # the template refuses the source's rows, a shard's defect: what its job would meet
            figures, found = _figures(None, 0, 0, 0.0), [Problem(FAIL, "pilot", f"source {name}: {_one_line(e)}")]
        by_source[name], problems = figures, problems + found
        totals.update({k: figures[k] for k in ("rows", "generated", "output_tokens")})
        totals["milliseconds"] += round(figures["seconds"] * 1000)
    gpu_count = _engine_count(plan)
    seconds = totals["milliseconds"] / 1000
    rate = totals["output_tokens"] / seconds if seconds else 0.0
    speed = by_source[speed_source]
    speed_rate = speed["output_tokens"] / speed["seconds"] / gpu_count if speed["seconds"] else 0.0
    return {
        "rows": totals["rows"],
        "generated": totals["generated"],
        "output_tokens": totals["output_tokens"],
        "seconds": round(seconds, 2),
        "gpus": gpu_count,
        "tokens_per_second": round(rate, 2),
        "tokens_per_second_per_gpu": round(rate / gpu_count, 2),
        "speed_source": speed_source,
        "speed_tokens_per_second": round(speed_rate, 2) if speed["generated"] else None,
        "sources": by_source,
    }, problems


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if text.startswith("config key") else f"{type(e).__name__}: {text}"


def _engine_count(plan: Plan) -> int:
    """The engines the build runs: one per GPU it would use, or the one CPU engine."""
    cfg = plan.config
    return len(gpus.every_gpu(cfg.engine)) if engines.uses_gpu(cfg.engine) else 1


def _speed_rows(plan: Plan) -> int:
    """Rows of the speed source: as many as the build keeps in flight on every engine (its batch)."""
    cfg = plan.config
    if cfg.preflight.speed_rows is not None:
        return cfg.preflight.speed_rows
    if not engine_host.through_server(cfg.engine):
        return int(registry.get(cfg.engine.backend).value(cfg.engine.options, "batch_size") or 0)
    return concurrency(cfg.engine) * _engine_count(plan)


def pilot_source(plan: Plan, source: str, rows: int) -> tuple[dict[str, Any], list[Problem]]:
    """``rows`` prompts of ``source``'s first unbuilt shard through the generate stage's own driver into the
    shard's journal (the build resumes them), under the shard's lock."""
    cfg = plan.config
    sp = plan.sources[source]
    shard = next((s for s, p in zip(sp.shards, plan.completion_shards(source), strict=True) if not p.exists()), None)
    if shard is None:
        return _figures(None, 0, 0, 0.0), []
    job = planned(plan, "generate", source, shard)
    paths = ShardPaths.of(job)
    journal = Journal(paths.journal, cfg.engine.journal_flush_rows, cfg.engine.journal_flush_seconds)
    pinned = gpus.pinned(cfg.engine) if engines.uses_gpu(cfg.engine) else contextlib.nullcontext()
    with journal.locked(f"{source}/{shard}"), pinned as lease:
        work = generate.open_shard(plan, source, shard, paths)
        for key in list(work.convs)[rows:]:
            del work.convs[key]  # the pilot's; the build generates the rest of the shard
        ids = sorted({c.prompt_id for c in work.convs.values()})
        generate.skip_copies(work, crosssource.skipped_copies(job, ids))
        generate.replay(work, journal)
        if sp.spec.turns == "first":
            generate.reuse(work, journal)
        else:
            generate.reuse_conversations(work, journal)
        before = len(work.convs) - len(work.pending())
        started = time.time()
        counts = generate.generate_rest(work, journal, lease)
        seconds = time.time() - started
    figures = _figures(work, counts.journaled, counts.engine_tokens, seconds)
    figures["reused"] = before
    return figures, _source_problems(plan, source, work, figures)


def _figures(work: ShardWork | None, generated: int, tokens: int, seconds: float) -> dict[str, Any]:
    """What a source's pilot rows show: finish reasons, degenerate answers, thinking, tool calls, lengths."""
    out: dict[str, Any] = {"rows": 0, "generated": generated, "reused": 0, "output_tokens": tokens}
    out |= {"seconds": round(seconds, 3), "finish_reasons": {}, "degenerate": {}, "thinking": 0, "tool_calls": 0}
    out["mean_request_tokens"] = 0.0
    if work is None:
        return out
    finishes, degenerate, lengths = Counter[str](), Counter[str](), []
    open_mark = work.plan.config.degenerate.reasoning_markers[:1]
    parser = work.plan.config.model.tool_call_parser
    for conv in work.convs.values():
        out["rows"] += 1
        seen: list[int] = []  # the ids before each answer: its whole prompt
        for turn in conv.turns:
            seen = turn.context_ids if conv.per_turn else seen + turn.context_ids
            finishes[turn.finish_reason] += 1
            lengths.append(len(seen) + len(turn.output_ids))
            if reason := work.detector.reason(seen, turn.output_ids, turn.finish_reason):
                degenerate[reason] += 1
            seen = seen + turn.generated_ids
            text = work.tokenizer.decode(list(turn.output_ids), skip_special_tokens=False)
            out["thinking"] += bool(open_mark and open_mark[0] in text)
            if conv.tools and parser:
                out["tool_calls"] += len(toolcalls.parse(parser, text, conv.tools).calls)
        if not conv.turns and conv.finish_reason:
            finishes[conv.finish_reason] += 1
    out |= {"finish_reasons": dict(finishes), "degenerate": dict(degenerate)}
    out["mean_request_tokens"] = round(sum(lengths) / len(lengths), 1) if lengths else 0.0
    return out


def _source_problems(plan: Plan, source: str, work: ShardWork, figures: dict[str, Any]) -> list[Problem]:
    cfg = plan.config
    sp = plan.sources[source]
    finishes, limit = Counter(figures["finish_reasons"]), cfg.preflight.max_length_share
    found = [checks.length_share(source, finishes, limit, sp.spec.sampling.max_new_tokens, cfg.truncated)]
    kwargs = dict(sp.gen_components["chat_template_kwargs"])
    if "enable_thinking" in kwargs and work.convs:
        conv = next(iter(work.convs.values()))
        flipped = {**kwargs, "enable_thinking": not kwargs["enable_thinking"]}
        messages = conv.messages[: conv.slots[0]] if conv.slots else conv.messages
        same = chat.render_text(work.tokenizer, messages, conv.tools, kwargs) == chat.render_text(
            work.tokenizer, messages, conv.tools, flipped
        )
        answered = sum(figures["finish_reasons"].values())
        found.append(checks.thinking_switch(source, kwargs["enable_thinking"], same, figures["thinking"], answered))
    return [p for p in found if p is not None]


def engine_reports(
    plan: Plan, states: list[dict[str, Any]], pilot_figures: dict[str, Any], since: float
) -> tuple[list[dict[str, Any]], list[Problem]]:
    """What each engine says about itself (its log), against the requests the build keeps in flight on it at
    the pilot's mean request length."""
    cfg = plan.config
    described = registry.get(cfg.engine.backend).preflight
    if described is None or not engine_host.through_server(cfg.engine):
        return [], []
    logs = [(s["slot"], Path(s["log"]), s["ready_at"] - s["spawned_at"]) for s in states]
    if not logs:  # engines of the pilot's own jobs, stopped by now: their logs since preflight began
        logs = [(p.stem, p, None) for p in sorted((cfg.logs / "engines").glob("*.log")) if p.stat().st_mtime >= since]
    sizes = [s["mean_request_tokens"] for s in pilot_figures["sources"].values() if s["mean_request_tokens"]]
    per_request = sum(sizes) / len(sizes) if sizes else 0.0
    in_flight = _in_flight(plan, described)
    reports, problems = [], []
    for slot, path, ready in logs:
        report = described.report("\n".join(engine_logs.tail(path, limit=LOG_TAIL_BYTES) or []))
        ready_seconds = None if ready is None else round(ready, 1)
        reports.append({"slot": slot, "log": str(path), "ready_seconds": ready_seconds, **report})
        knob = described.memory_knob(cfg.engine.options)
        if (problem := checks.engine_memory(report, in_flight, per_request, knob, slot)) is not None:
            problems.append(problem)
    return reports, problems


def _in_flight(plan: Plan, described: registry.Preflight) -> checks.InFlight:
    """The requests this build can keep in flight on one engine (upper bounds: rows before prepare's drops)."""
    cfg = plan.config
    # (rows, samples per prompt) of each source
    sources = [(sp.planned_rows, sp.spec.sampling.samples_per_prompt) for sp in plan.sources.values()]
    requests = sum(rows * samples for rows, samples in sources)
    per_shard = max((min(rows, cfg.shard_size) * samples for rows, samples in sources), default=0)
    jobs = cfg.engine.jobs_per_engine if cfg.engine.shared else 1
    option = f"engine.options.{described.batch_cap_option}" if described.batch_cap_option else ""
    cap = described.batch_cap(cfg.engine.options)
    return checks.in_flight(concurrency(cfg.engine), jobs, per_shard, requests, cap, option)


def write(path: Path, summary: dict[str, Any]) -> None:
    """The summary as JSON and, beside it, as Markdown (written last: the JSON is what `plan` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(layout.preflight_table(path), checks.render(summary))
    atomic.write_json(path, summary)
