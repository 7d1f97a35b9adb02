"""Acceptance per slice (config key `accept`): serve the target with each drafter through the engine layer,
generate the eval split (``dist/NAME-eval``) under each slice's own sampling, and read acceptance from the
engine itself, per request (vLLM's ``metrics.speculative_decoding``, SGLang's ``meta_info``), checked
against the engine's own totals over the run (vLLM's ``/metrics`` counters) where it has them.

τ, the acceptance length, is tokens per verify step with the target's bonus token: ``1 + accepted /
steps``, as DFlash reports it; acceptance at draft position i is the part of the steps that accepted
position i. A drafter's measurement is keyed by :func:`accept_key` (the target, the drafter's files,
method and options, the engine's keyed options and the split) and kept in the store
(``store/acceptance/KEY``): a rerun measures nothing again, a new drafter only itself. The
report, ``dist/NAME-acceptance``, puts the drafters side by side per slice, with the change from the
first, and names the slices where τ falls furthest below the overall figure, with their share of the
training tokens.
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
import pyarrow.parquet as pq

from dflash_build import hashing
from dflash_build.engines import Request, SamplingParams, gpus, registry, uses_gpu
from dflash_build.engines import host as engine_host
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import DrafterSpec
from dflash_build.stages import evalset
from dflash_build.stages.common import chat
from dflash_build.stages.common.job import Job
from dflash_build.stages.generate.work import row_seed
from dflash_build.store import atomic, layout

log = logging.getLogger(__name__)

ACCEPT_VERSION = 1
REQUESTS_FILE = "requests.parquet"
SUMMARY_FILE = "summary.json"
REPORT_JSON = "acceptance.json"
PLOT = "plots/acceptance.png"
OVERALL = ("all", "all")
COUNTS = ("steps", "drafted", "accepted")
REQUEST_SCHEMA = pa.schema(
    [
        *(evalset.EVAL_SCHEMA.field(c) for c in ("prompt_id", *evalset.SLICES)),
        ("finish_reason", pa.string()),
        ("output_tokens", pa.int32()),
        ("steps", pa.int64()),
        ("drafted", pa.int64()),
        ("accepted", pa.int64()),
        ("histogram", pa.list_(pa.int64())),
    ]
)


class AcceptanceMismatch(RuntimeError):
    """The requests' own counts do not add up to the engine's totals over the run."""


def accept_key(plan: Plan, drafter: DrafterSpec, split_key: str) -> str:
    """What one drafter's measurement depends on."""
    cfg = plan.config
    assert cfg.accept is not None
    options = {**cfg.engine.options, **cfg.accept.engine_options}
    return hashing.content_key(
        {
            "scheme": ACCEPT_VERSION,
            "target": plan.model_fingerprint["digest"],
            "backend": cfg.engine.backend,
            "engine": registry.keyed_options(cfg.engine.backend, options),
            "method": drafter.method,
            "drafter": plan.drafter_fingerprints.get(drafter.name),
            "options": dict(drafter.options),
            "split": split_key,
            "max_new_tokens": cfg.accept.max_new_tokens,
        }
    )


def run(job: Job) -> dict[str, Any]:
    """Measure each drafter not measured yet, then write the report into a new version of the folder."""
    plan = job.plan
    accept = plan.config.accept
    assert accept is not None
    placed = release.in_place(release.folder_of(job.input("split")))
    split, split_key = evalset.read(placed), placed.manifest["split_key"]
    measured, keys = {}, {}
    for name, drafter in accept.drafters.items():
        keys[name] = accept_key(plan, drafter, split_key)
        folder = layout.acceptance_dir(plan.config.store, keys[name])
        summary = kept(folder)
        if summary is None:
            summary = measure(plan, drafter, split, folder)
        else:
            log.info("accept: %s measured before (%s): nothing to run", name, folder)
        measured[name] = {**summary, "drafter": {**summary["drafter"], "name": name}}  # as the config names it
    training = training_shares(release.folder_of(job.input("dataset")))
    report = build_report(measured, training, accept.weakest, split_key)
    record = job.output("record")
    with release.publish(release.folder_of(record), record) as tmp:
        atomic.write_json(tmp / REPORT_JSON, report)
        atomic.write_text(tmp / "README.md", render_table(report))
        plot(report, tmp / PLOT)
        # named by its report's digest (release.publish names a version by its manifest's)
        report_digest = hashing.sha256_file(tmp / REPORT_JSON)
        # the measurements it was made from, by drafter: gc keeps them, verify checks them
        manifest = {"stage": "accept", "split_key": split_key, "files": [], "report": REPORT_JSON, "measurements": keys}
        atomic.write_json(tmp / layout.MANIFEST, {**manifest, "report_sha256": report_digest})
    return report


def measure(plan: Plan, drafter: DrafterSpec, split: pa.Table, folder: Path) -> dict[str, Any]:
    """Serve the target with ``drafter``, generate every row of the split, and keep each request's counts
    and the summary in ``folder`` (the summary last: it marks the measurement done)."""
    cfg = plan.config
    accept = cfg.accept
    assert accept is not None
    backend = registry.get(cfg.engine.backend)
    assert backend.speculative is not None, "registry.check_drafters refuses it at parse time"
    options = {**cfg.engine.options, **accept.engine_options, **backend.speculative.options(drafter)}
    # an engine of its own, stopped when done: the next drafter is another server
    engine_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, options=options, shared=False))
    tokenizer = chat.load_tokenizer(cfg.model, plan.tokenizer_cache())
    stop_ids = chat.stop_token_ids(tokenizer, cfg.model.path)
    rows = split.to_pylist()
    requests = [_request(i, row, accept.max_new_tokens) for i, row in enumerate(rows)]
    log.info("accept: %s (%s) on %d eval requests", drafter.name, drafter.method, len(requests))
    with gpus.pinned(engine_cfg.engine) if uses_gpu(engine_cfg.engine) else contextlib.nullcontext() as lease:
        served = engine_host.open_engine(
            engine_cfg, stop_ids, lease, tokenizer, plan.model_fingerprint, chat.context_length(cfg.model)
        )
        try:
            urls = list(served.attached.urls)
            before = _totals(backend, urls)
            results = {int(r.prompt_id): r for r in served.generate(requests)}
            after = _totals(backend, urls)
        finally:
            served.close()
    out = []
    for i, row in enumerate(rows):
        result = results.get(i)
        counted = None if result is None else result.acceptance
        out.append(
            {
                **{c: row[c] for c in ("prompt_id", *evalset.SLICES)},
                "finish_reason": "missing" if result is None else result.finish_reason,
                "output_tokens": 0 if result is None else len(result.output_ids),
                "steps": counted.steps if counted else 0,
                "drafted": counted.drafted if counted else 0,
                "accepted": counted.accepted if counted else 0,
                "histogram": list(counted.histogram) if counted else [],
            }
        )
    table = pa.Table.from_pylist(out, schema=REQUEST_SCHEMA)
    summary = summarize(table)
    summary["drafter"] = {"name": drafter.name, "method": drafter.method, "path": drafter.path, **drafter.options}
    summary["engine_totals"] = _difference(before, after)
    check_totals(summary)
    return keep(folder, table, summary)


def keep(folder: Path, table: pa.Table, summary: dict[str, Any]) -> dict[str, Any]:
    """Write a measurement: its requests, then its summary (which marks it done) with their rows and digest."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_parquet(folder / REQUESTS_FILE, table)
    record = {"rows": table.num_rows, "sha256": hashing.sha256_file(folder / REQUESTS_FILE)}
    summary = {**summary, REQUESTS_FILE: record}
    atomic.write_json(folder / SUMMARY_FILE, summary)
    return summary


def kept(folder: Path) -> dict[str, Any] | None:
    """The measurement kept in ``folder``: None when there is none, or its summary is damaged (then the
    drafter is measured again, and the summary replaced)."""
    try:
        return json.loads((folder / SUMMARY_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("accept: %s is damaged (%s): measuring again", folder / SUMMARY_FILE, e)
        return None


def _config_folders(plan: Plan) -> tuple[release.InPlace, dict[str, Path]] | None:
    """The eval split in place and, by drafter, the folder the config's drafters' measurements on it go to
    (None without `accept` or a split in place)."""
    cfg = plan.config
    if cfg.accept is None or release.current(cfg.eval_dir) is None:
        return None
    placed = release.in_place(cfg.eval_dir)
    split_key = placed.manifest["split_key"]
    drafters = cfg.accept.drafters.items()
    return placed, {name: layout.acceptance_dir(cfg.store, accept_key(plan, d, split_key)) for name, d in drafters}


def measurements(plan: Plan, reports: list[Path]) -> set[Path]:
    """The measurement folders in use: those the config's drafters key to on the eval split in place, and
    those each acceptance report in ``reports`` was made from."""
    in_place = _config_folders(plan)
    used = set() if in_place is None else set(in_place[1].values())
    for report in reports:
        if release.current(report) is not None:
            keys = release.in_place(report).manifest.get("measurements", {}).values()
            used |= {layout.acceptance_dir(plan.config.store, key) for key in keys}
    return used


def preview(plan: Plan) -> str | None:
    """`plan`'s line: which drafters `snakemake accept` would serve and which it reads from the store."""
    cfg = plan.config
    if cfg.accept is None:
        return None
    names = list(cfg.accept.drafters)
    in_place = _config_folders(plan)
    if in_place is None:
        return f"accept: measures {len(names)} drafters ({', '.join(names)}: a server each) once the eval split is in"
    placed, folders = in_place
    todo = [name for name, folder in folders.items() if kept(folder) is None]
    read = [name for name in names if name not in todo]
    serve = f" ({', '.join(todo)}: a server each, {placed.manifest['rows']} eval requests)" if todo else ""
    reads = f" ({', '.join(read)})" if read else ""
    return (
        f"accept: measures {len(todo)} of {len(names)} drafters{serve}, reads {len(read)} from the store{reads}; "
        f"on the eval split in place ({placed.manifest['split_key']}: a build that changes it measures every "
        "drafter again)"
    )


def _request(i: int, row: dict[str, Any], max_new_tokens: int) -> Request:
    params = SamplingParams(**{f.name: row[f.name] for f in dataclasses.fields(SamplingParams)})
    params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, max_new_tokens))
    # the row's own seed, as generate gives it (a prompt id and turn), under an index the results come back by
    return Request(str(i), 0, list(row["prompt_ids"]), params, row_seed(row["seed"], row["prompt_id"], 0, row["turn"]))


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
    overall = summary["slices"]["all"]["all"]
    ours = {**{k: overall[k] for k in COUNTS}, "per_position": overall["per_position_steps"]}
    theirs = {k: totals.get(k) for k in ours}
    positions = len(ours["per_position"])
    if theirs["per_position"] is not None:
        theirs["per_position"] = (list(theirs["per_position"]) + [0] * positions)[:positions]
    if ours != theirs:
        raise AcceptanceMismatch(
            f"accept: the requests' counts {ours} are not the engine's own totals over the run {theirs}: "
            "another client used the server meanwhile, or the engine counts differently; measure again"
        )


def summarize(table: pa.Table) -> dict[str, Any]:
    """Counts, τ and acceptance per draft position for every slice value, and overall."""
    rows = table.to_pylist()
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[OVERALL].append(row)
        for column in evalset.SLICES:
            groups[(column, str(row[column]))].append(row)
    slices: dict[str, dict[str, Any]] = defaultdict(dict)
    for (column, value), members in sorted(groups.items()):
        slices[column][value] = _figures(members)
    failed = sum(r["finish_reason"] not in ("stop", "length") for r in rows)
    return {"slices": dict(slices), "requests": len(rows), "failed": failed}


def _figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps, drafted, accepted = (sum(r[k] for r in rows) for k in COUNTS)
    width = max((len(r["histogram"]) for r in rows), default=1) - 1
    per_position = [sum(sum(r["histogram"][p + 1 :]) for r in rows) for p in range(max(width, 0))]
    return {
        "requests": len(rows),
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "tau": round(1 + accepted / steps, 4) if steps else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "per_position_steps": per_position,
        "per_position": [round(n / steps, 4) for n in per_position] if steps else [],
    }


def training_shares(dataset: Path) -> dict[str, dict[str, float]]:
    """The training dataset's tokens by the value of each slice column it has, as shares."""
    if release.current(dataset) is None and not dataset.is_dir():
        return {}
    columns = ["source", "category", "language", "variant", "turn", "n_tokens"]
    table = pa.concat_tables([pq.read_table(f, columns=columns) for f in release.in_place(dataset).files])
    tokens = table.column("n_tokens").to_pylist()
    total = sum(tokens) or 1
    shares: dict[str, dict[str, float]] = {}
    for column in columns[:-1]:
        by: dict[str, int] = defaultdict(int)
        for value, n in zip(table.column(column).to_pylist(), tokens, strict=True):
            # a whole row (turn null) starts at turn 0: a first-turn source's only turn
            by["0" if column == "turn" and value is None else str(value)] += n
        shares[column] = {k: round(v / total, 4) for k, v in by.items()}
    return shares


def build_report(
    measured: dict[str, dict[str, Any]], training: dict[str, dict[str, float]], weakest: int, split_key: str
) -> dict[str, Any]:
    """The drafters side by side per slice (with the change from the first) and each one's weakest slices."""
    names = list(measured)
    first = names[0]
    slices = []
    for column, values in measured[first]["slices"].items():
        for value in values:
            entry: dict[str, Any] = {"slice": f"{column}={value}", "column": column, "value": value}
            entry["training_share"] = training.get(column, {}).get(value) if column != "all" else 1.0
            for name in names:
                figures = measured[name]["slices"].get(column, {}).get(value)
                entry[name] = None if figures is None else figures["tau"]
            if len(names) > 1 and entry[first] is not None:
                entry["change"] = {n: _change(entry[n], entry[first]) for n in names[1:]}
            slices.append(entry)
    return {
        "split_key": split_key,
        "drafters": {n: _without_slices(m) for n, m in measured.items()},
        "slices": slices,
        "per_slice": {n: m["slices"] for n, m in measured.items()},
        "weakest": {n: _weakest(m, training, weakest) for n, m in measured.items()},
    }


def _without_slices(measured: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in measured.items() if k != "slices"} | {"overall": measured["slices"]["all"]["all"]}


def _change(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else round(value - base, 4)


def _weakest(measured: dict[str, Any], training: dict[str, dict[str, float]], count: int) -> list[dict[str, Any]]:
    overall = measured["slices"]["all"]["all"]["tau"]
    rows = [
        {
            "slice": f"{column}={value}",
            "tau": figures["tau"],
            "below_overall": round(overall - figures["tau"], 4),
            "requests": figures["requests"],
            "training_share": training.get(column, {}).get(value),
        }
        for column, values in measured["slices"].items()
        if column != "all"
        for value, figures in values.items()
        if figures["tau"] is not None and overall is not None and figures["tau"] < overall
    ]
    return sorted(rows, key=lambda r: (-r["below_overall"], r["slice"]))[:count]


def render_table(report: dict[str, Any]) -> str:
    """The report as Markdown: τ per slice for each drafter, then each drafter's weakest slices."""
    names = list(report["drafters"])
    head = ["slice", "training share", *(f"τ {n}" for n in names), *(f"Δ {n}" for n in names[1:])]
    lines = [
        "# Acceptance per slice",
        "",
        "τ: tokens per verify step, the bonus token included (1 + accepted / steps), read from the engine.",
        f"Eval split {report['split_key']}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for entry in report["slices"]:
        cells = [entry["slice"], _pct(entry["training_share"])]
        cells += [_num(entry[n]) for n in names]
        cells += [_num((entry.get("change") or {}).get(n)) for n in names[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    for name in names:
        overall = report["drafters"][name]["overall"]
        lines += ["", f"## {name}: τ {_num(overall['tau'])}, acceptance by draft position"]
        lines.append(", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(overall["per_position"])) or "-")
        lines += ["", "Weakest slices (τ furthest below the overall figure):", ""]
        lines += ["| slice | τ | below overall | requests | training share |", "|---|---|---|---|---|"]
        for w in report["weakest"][name]:
            lines.append(
                f"| {w['slice']} | {_num(w['tau'])} | {_num(w['below_overall'])} | {w['requests']} | "
                f"{_pct(w['training_share'])} |"
            )
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def plot(report: dict[str, Any], path: Path) -> None:
    """τ per slice, one bar per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["drafters"])
    entries = report["slices"]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(entries)), 4.0))
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(entries))]
        ax.bar(xs, [e[name] or 0 for e in entries], width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(entries))])
    ax.set_xticklabels([e["slice"] for e in entries], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("τ (tokens per verify step)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)  # into the version being written, which is swapped in whole
    plt.close(fig)
