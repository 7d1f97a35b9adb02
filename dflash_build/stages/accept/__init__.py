"""Acceptance per slice (config key `accept`): serve the target with each drafter through the engine layer,
generate the eval split (``dist/NAME-eval``) under each slice's own sampling, and read acceptance from the
engine itself, per request (vLLM's ``metrics.speculative_decoding``, SGLang's ``meta_info``), checked
against the engine's own totals over the run (vLLM's ``/metrics`` counters) where it has them.

τ, the acceptance length, is tokens per verify step with the target's bonus token: ``1 + accepted /
steps``, as DFlash reports it, summed over a slice's steps (per token) and averaged over its requests (per
request: long answers weigh no more than short ones); acceptance at draft position i is the part of the
steps that accepted position i. Answers that looped to their budget or were empty
(:mod:`~dflash_build.stages.common.degenerate`) are left out of τ and counted apart: a drafter predicts a
loop easily. Before the drafters, the engine's calibration (:mod:`.calibration`) checks that it measures
right at the split's samplings; a drafter measured on an engine that fails it is marked untrusted.

A drafter's measurement is keyed by :func:`dflash_build.keys.accept_key` (the target, the drafter's files, method and
options, the engine's keyed options, the split and the budget) and kept in the store (``store/acceptance/
KEY``): a rerun measures nothing again, a new drafter only itself. The report (:mod:`dflash_build.publish.
acceptance`), ``dist/NAME-acceptance``, puts the drafters side by side per slice. Where measurements lie and
which are in use is :mod:`dflash_build.measurements`'s (what `plan`, `gc` and `verify` read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash_build import hashing, measurements, running
from dflash_build.engines import Request, Result, SamplingParams, gpus, registry, uses_gpu
from dflash_build.engines import host as engine_host
from dflash_build.engines.base import per_position, summed_histogram, tau_figures
from dflash_build.plan import Plan
from dflash_build.publish import acceptance as report_mod
from dflash_build.publish import release
from dflash_build.spec import DrafterSpec
from dflash_build.stages import evalset
from dflash_build.stages.accept import calibration
from dflash_build.stages.common import chat, degenerate
from dflash_build.stages.common.failure import StageFailure
from dflash_build.stages.common.job import Job
from dflash_build.stages.generate.work import row_seed
from dflash_build.store import atomic, layout

log = logging.getLogger(__name__)

# 2: accept.max_new_tokens is the budget (the build's no longer caps it); degenerate answers are left out
# of τ; requests carry their sampling and prompt length; the summary its calibration and engine.
# 3: degenerate answers by the build's rule and thresholds (config degenerate: a loop anywhere, a
# repetitive answer), keyed.
OVERALL = report_mod.OVERALL
COUNTS = ("steps", "drafted", "accepted")
PROGRESS_EVERY = 16  # results between two updates of the job's progress record (dflash_build.running)
# The prompt's length in tokens, in bands: acceptance decays with context.
CONTEXT_BANDS = (256, 1024, 4096, 16384)
SLICES = (*evalset.SLICES, "context")
REQUEST_SCHEMA = pa.schema(
    [
        *(evalset.EVAL_SCHEMA.field(c) for c in ("prompt_id", *evalset.SLICES)),
        ("sampling", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("output_tokens", pa.int32()),
        ("degenerate", pa.string()),
        ("steps", pa.int64()),
        ("drafted", pa.int64()),
        ("accepted", pa.int64()),
        ("histogram", pa.list_(pa.int64())),
    ]
)


class AcceptanceMismatch(RuntimeError):
    """The requests' own counts do not add up to the engine's totals over the run."""


def run(job: Job) -> dict[str, Any]:
    """Calibrate the engine, measure each drafter not measured yet, then write the report into a new
    version of the folder, with the weakest slices' next round where its rule gives ``next_round``
    (``job.given``: ops.nextround.table, `plan`'s estimate of a change, which a stage cannot import)."""
    plan = job.plan
    accept = plan.config.accept
    assert accept is not None
    placed = release.in_place(release.folder_of(job.input("split")))
    if placed.manifest.get("eval_key") != plan.eval_key:
        raise StageFailure(
            f"accept: the eval split in place ({release.folder_of(job.input('split'))}) was rendered for other "
            "settings than this config's (its sampling, template, model or prompts); run `snakemake evalset` first"
        )
    split, split_key = evalset.read(placed), placed.manifest["split_key"]
    folders, calibration_folder = measurements.folders(plan, split_key)
    summaries = {name: measurements.kept(folder) for name, folder in folders.items()}
    todo = [name for name, summary in summaries.items() if summary is None]
    measured = {}
    with Servers(plan) as servers:
        verdict = calibrated(plan, split, calibration_folder, measure_now=bool(todo), servers=servers)
        for i, (name, drafter) in enumerate(accept.drafters.items()):
            running.progress(drafters_done=f"{i}/{len(folders)}", to_measure=len(todo))
            summary = summaries[name]
            if summary is None:
                summary = measure(plan, drafter, split, folders[name], verdict, servers)
            else:
                log.info("accept: %s measured before (%s): nothing to run", name, folders[name])
            measured[name] = {**summary, "drafter": {**summary["drafter"], "name": name}}  # as the config names it
    training = report_mod.training_shares(release.folder_of(job.input("dataset")))
    report = report_mod.build_report(measured, training, accept.weakest, split_key)
    if (next_round := job.given.get("next_round")) is not None:
        dataset = release.folder_of(job.input("dataset"))
        report["next_round"] = next_round(plan, report_mod.weak_slices(report), dataset)
    record = job.output("record")
    with release.publish(release.folder_of(record), record) as tmp:
        atomic.write_json(tmp / layout.ACCEPTANCE_REPORT, report)
        atomic.write_text(tmp / "README.md", report_mod.render_table(report))
        report_mod.plot(report, tmp / layout.ACCEPTANCE_PLOT)
        # named by its report's digest (release.publish names a version by its manifest's)
        report_digest = hashing.sha256_file(tmp / layout.ACCEPTANCE_REPORT)
        # the measurements it was made from, by drafter: gc keeps them, verify checks them
        keys = {name: folder.name for name, folder in folders.items()}  # a measurement's folder is its key
        manifest = {
            "stage": "accept",
            "split_key": split_key,
            "files": [],
            "report": layout.ACCEPTANCE_REPORT,
            "measurements": keys,
        }
        if verdict is not None:
            manifest["calibration"] = verdict["key"]
        atomic.write_json(tmp / layout.MANIFEST, {**manifest, "report_sha256": report_digest})
    for name, drafter in report["drafters"].items():
        if drafter.get("calibration") and not drafter["calibration"]["trusted"]:
            log.warning("accept: %s: %s", name, report_mod.trust_line(drafter))
    return report


def calibrated(
    plan: Plan, split: pa.Table, folder: Path | None, measure_now: bool, servers: Servers
) -> dict[str, Any] | None:
    """The engine's calibration on this split, kept in ``folder``: kept, or run now when a drafter is to be
    measured (None with accept.calibration.rows 0, or none kept and nothing to measure)."""
    accept = plan.config.accept
    assert accept is not None
    if folder is None:
        return None
    if (summary := measurements.kept(folder)) is not None or not measure_now:
        return summary
    backend = registry.get(plan.config.engine.backend)
    assert backend.speculative is not None and backend.speculative.self_drafter is not None
    drafter = backend.speculative.self_drafter(plan.config.model.path, accept.calibration.draft_tokens)
    rows = calibration.rows(split.to_pylist(), accept.calibration.rows)
    log.info("accept: calibrating the engine: the target drafting for itself on %d eval rows", len(rows))
    running.progress(drafter=drafter.name, step="calibration: starting its server")
    served = servers.serving(drafter)
    requests = [_request(i, row, accept.calibration.max_new_tokens) for i, row in enumerate(rows)]
    results = served.generate(requests, "calibration")
    oracle = served.generate(calibration.oracle_requests(requests, results), "calibration's argmax")
    verdict = {**calibration.verdict(rows, requests, results, oracle, folder.name), "engine": served.engine}
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_json(folder / measurements.SUMMARY_FILE, verdict)
    return verdict


@dataclasses.dataclass
class Served:
    """One speculative server for one drafter: requests in, results by prompt id out."""

    engine: dict[str, Any]
    _served: Any
    label: str = ""

    def generate(self, requests: list[Request], step: str = "requests") -> dict[str, Result]:
        """Every request's result by prompt id; `status` sees how many are done."""
        out: dict[str, Result] = {}
        for result in self._served.generate(requests):
            out[result.prompt_id] = result
            if len(out) % PROGRESS_EVERY == 0 or len(out) == len(requests):
                running.progress(drafter=self.label, step=step, done=f"{len(out)}/{len(requests)}")
        return out

    @property
    def urls(self) -> list[str]:
        return list(self._served.attached.urls)


class Servers:
    """The target served with one drafter at a time, on an engine of its own: a use that wants the engine
    already running (the calibration's drafter is often the target itself, as a drafter measured next may
    be) is served by it; another drafter stops it and starts its own. Everything is stopped at the end."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._open: tuple[Any, Any, contextlib.ExitStack] | None = None  # (engine, Served, what closes it)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._open is not None:
            _, _, stack = self._open
            self._open = None
            stack.close()

    def serving(self, drafter: DrafterSpec) -> Served:
        cfg = self.plan.config
        assert cfg.accept is not None
        engine = registry.with_drafter(cfg.engine, drafter, cfg.accept.engine_options)
        if self._open is not None and self._open[0] == engine:
            served: Served = self._open[1]
            log.info("accept: %s is served by the server already running for %s", drafter.name, served.label)
            served.label = drafter.name
            return served
        self._close()
        tokenizer = chat.load_tokenizer(cfg.model, self.plan.tokenizer_cache())
        stop_ids = chat.stop_token_ids(tokenizer, cfg.model.path)
        with contextlib.ExitStack() as stack:
            lease = stack.enter_context(gpus.pinned(engine)) if uses_gpu(engine) else None
            opened = engine_host.open_engine(
                cfg, stop_ids, lease, tokenizer, self.plan.model_fingerprint, chat.context_length(cfg.model), engine
            )
            stack.callback(opened.close)
            urls = list(opened.attached.urls)
            engine_line = {"backend": cfg.engine.backend, "version": _version(urls), "urls": urls}
            served = Served(engine_line, opened, drafter.name)
            self._open = (engine, served, stack.pop_all())
        return served


def measure(
    plan: Plan, drafter: DrafterSpec, split: pa.Table, folder: Path, verdict: dict[str, Any] | None, servers: Servers
) -> dict[str, Any]:
    """Serve the target with ``drafter``, generate every row of the split, and keep each request's counts
    and the summary in ``folder`` (the summary last: it marks the measurement done)."""
    accept = plan.config.accept
    assert accept is not None
    backend = registry.get(plan.config.engine.backend)
    rows = split.to_pylist()
    requests = [_request(i, row, accept.max_new_tokens) for i, row in enumerate(rows)]
    log.info("accept: %s (%s) on %d eval requests", drafter.name, drafter.method, len(requests))
    running.progress(drafter=drafter.name, step="starting its server")
    served = servers.serving(drafter)
    before = _totals(backend, served.urls)  # the server's totals over this drafter's requests only
    results = served.generate(requests, "eval requests")
    after = _totals(backend, served.urls)
    detector = degenerate.Detector(plan.config.degenerate)  # on token ids: loops, repetition, empty answers
    out = [_request_row(row, requests[i], results.get(str(i)), detector) for i, row in enumerate(rows)]
    table = pa.Table.from_pylist(out, schema=REQUEST_SCHEMA)
    summary = summarize(table)
    summary["drafter"] = {"name": drafter.name, "method": drafter.method, "path": drafter.path, **drafter.options}
    summary["draft_tokens"] = registry.draft_tokens(plan.config.engine.backend, drafter)
    summary["ceiling"] = None if summary["draft_tokens"] is None else summary["draft_tokens"] + 1
    summary["engine"] = served.engine
    summary["calibration"] = verdict
    summary["engine_totals"] = _difference(before, after)
    check_totals(summary)
    return measurements.keep(folder, table, summary)


def _request_row(
    row: dict[str, Any], request: Request, result: Result | None, detector: degenerate.Detector
) -> dict[str, Any]:
    counted = None if result is None else result.acceptance
    finish = "missing" if result is None else result.finish_reason
    output = [] if result is None else result.output_ids
    return {
        **{c: row[c] for c in ("prompt_id", *evalset.SLICES)},
        "sampling": report_mod.sampling_label(row),
        "prompt_tokens": len(request.prompt_ids),
        "finish_reason": finish,
        "output_tokens": len(output),
        "degenerate": detector.reason(request.prompt_ids, output, finish) if result is not None else None,
        "steps": counted.steps if counted else 0,
        "drafted": counted.drafted if counted else 0,
        "accepted": counted.accepted if counted else 0,
        "histogram": list(counted.histogram) if counted else [],
    }


def _request(i: int, row: dict[str, Any], max_new_tokens: int) -> Request:
    # accept's own budget: acceptance is measured over as long an answer as it asks, the build's limit aside
    sampling = {f.name: row[f.name] for f in dataclasses.fields(SamplingParams) if f.name != "max_new_tokens"}
    params = SamplingParams(**sampling, max_new_tokens=max_new_tokens)
    # the row's own seed, as generate gives it (a prompt id and turn), under an index the results come back by
    return Request(str(i), 0, list(row["prompt_ids"]), params, row_seed(row["seed"], row["prompt_id"], 0, row["turn"]))


def _version(urls: list[str]) -> str | None:
    """The serving engine's version, as its server reports it (vLLM's /version)."""
    for url in urls:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{url}/version", timeout=10) as answer:
            return str(json.loads(answer.read()).get("version"))
    return None


def _totals(backend: registry.Backend, urls: list[str]) -> dict[str, Any] | None:
    """The engine's own counters summed over its servers, where the backend exposes them."""
    assert backend.speculative is not None
    if backend.speculative.totals is None:
        return None
    totals: dict[str, Any] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=30) as answer:
            totals = _added(totals, backend.speculative.totals(answer.read().decode()))
    return totals


def _difference(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if before is None or after is None else _added(after, before, -1)


def _added(a: dict[str, Any], b: dict[str, Any], sign: int = 1) -> dict[str, Any]:
    """Counters ``a + sign * b``, a list of them (per draft position) position by position."""
    out = dict(a)
    for name, value in b.items():
        if isinstance(value, list):
            out[name] = [x + sign * y for x, y in itertools.zip_longest(out.get(name) or [], value, fillvalue=0)]
        else:
            out[name] = out.get(name, 0) + sign * value
    return out


def check_totals(summary: dict[str, Any]) -> None:
    """The requests' counts, summed, must be the engine's own totals over the run (when it has them)."""
    totals = summary["engine_totals"]
    if totals is None:
        return
    ours = {**{k: summary["counted"][k] for k in COUNTS}, "per_position": summary["counted"]["per_position_steps"]}
    theirs = {k: totals.get(k) for k in ours}
    positions = len(ours["per_position"])
    if theirs["per_position"] is not None:
        theirs["per_position"] = (list(theirs["per_position"]) + [0] * positions)[:positions]
    if ours != theirs:
        raise AcceptanceMismatch(
            f"accept: the requests' counts {ours} are not the engine's own totals over the run {theirs}: "
            "another client used the server meanwhile, or the engine counts differently; measure again"
        )


def context_band(prompt_tokens: int) -> str:
    """The prompt-length band a request falls in (``<256``, ``256-1K``, ..., ``>=16K``)."""
    names = [_k(b) for b in CONTEXT_BANDS]
    for i, bound in enumerate(CONTEXT_BANDS):
        if prompt_tokens < bound:
            return f"<{names[0]}" if i == 0 else f"{names[i - 1]}-{names[i]}"
    return f">={names[-1]}"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def summarize(table: pa.Table) -> dict[str, Any]:
    """τ and acceptance per draft position for every slice value and overall, over the answers that are
    not degenerate (those are counted apart); ``counted``: every request's counts, as the engine's totals
    count them."""
    rows = table.to_pylist()
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[OVERALL].append(row)
        for column in SLICES:
            value = context_band(row["prompt_tokens"]) if column == "context" else row[column]
            groups[(column, str(value))].append(row)
    slices: dict[str, dict[str, Any]] = defaultdict(dict)
    for (column, value), members in sorted(groups.items()):
        slices[column][value] = _figures(members)
    failed = sum(r["finish_reason"] not in ("stop", "length") for r in rows)
    left_out: dict[str, int] = defaultdict(int)
    for row in rows:
        if row["degenerate"]:
            left_out[row["degenerate"]] += 1
    return {
        "slices": dict(slices),
        "requests": len(rows),
        "failed": failed,
        "degenerate": dict(left_out),
        "counted": _figures(rows, everything=True),
    }


def _figures(rows: list[dict[str, Any]], everything: bool = False) -> dict[str, Any]:
    """A group's figures over its answers that are not degenerate (all of them with ``everything``)."""
    kept_rows = rows if everything else [r for r in rows if not r["degenerate"]]
    steps, drafted, accepted = (sum(r[k] for r in kept_rows) for k in COUNTS)
    positions = per_position(summed_histogram(r["histogram"] for r in kept_rows))
    per_request = [1 + r["accepted"] / r["steps"] for r in kept_rows if r["steps"]]
    return {
        "requests": len(kept_rows),
        "degenerate": len(rows) - len(kept_rows),
        "samplings": sorted({r["sampling"] for r in rows}),
        **tau_figures(steps, drafted, accepted, (sum(per_request), len(per_request)), positions),
    }
