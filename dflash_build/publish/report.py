"""What a built dataset is and what it cost: tables, plots and the dataset card of ``dist/NAME``.

The mix stage tallies every row it writes (:class:`Tally`) and reads each source's generation sidecars
(:func:`generation_stats`); :func:`tables` turns both into per-source and per-category numbers kept in
the manifest (``report``); :mod:`.plots` draws them and the card (:mod:`.card`) lays out its tables and
plots. The end of a build prints :func:`summary`.
Snakemake's ``--report`` picks up the plots and the CSV tables of the dataset folder (rules/mix.smk).
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dflash_build.engines import uses_gpu
from dflash_build.plan import Plan
from dflash_build.spec import DEGENERATE_REASONS
from dflash_build.store import atomic, layout
from dflash_build.store import records as R

TABLES = ("tables/by_source.csv", "tables/by_category.csv", "tables/by_language.csv")
NAMED_LANGUAGES = 8  # the plot and the build's summary name the largest; the rest are "other"


def percentile(values: Sequence[int] | np.ndarray, q: float) -> int:
    if not len(values):
        return 0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, float | int]:
    values = np.sort(np.asarray(lengths, dtype=np.int64))
    if not len(values):
        return {"mean": 0, "p50": 0, "p90": 0, "max": 0}
    return {
        "mean": round(int(values.sum()) / len(values), 2),
        "p50": int(percentile(values, 0.5)),
        "p90": int(percentile(values, 0.9)),
        "max": int(values[-1]),
    }


class Tally:
    """Per-row numbers of the rows the mix writes, by source and by category: 4 bytes a row (numpy)."""

    def __init__(self) -> None:
        self._chunks: dict[str, dict[str, list[np.ndarray]]] = {
            "source": defaultdict(list),
            "category": defaultdict(list),
        }
        self.prompt_tokens: dict[str, Counter[str]] = {"source": Counter(), "category": Counter()}
        self.finish: dict[str, Counter[str]] = defaultdict(Counter)

    def add_rows(
        self, source: str, category: str, n_tokens: np.ndarray, n_loss_tokens: np.ndarray, finish: Counter[str]
    ) -> None:
        """Rows of one source and category: their token counts, generated (loss) token counts, finish reasons."""
        generated = np.asarray(n_loss_tokens, dtype=np.int32)
        prompt = int(np.asarray(n_tokens, dtype=np.int64).sum() - generated.sum(dtype=np.int64))
        for by, name in (("source", source), ("category", category)):
            self._chunks[by][name].append(generated)
            self.prompt_tokens[by][name] += prompt
        self.finish[source].update(finish)

    @property
    def completion(self) -> dict[str, dict[str, np.ndarray]]:
        """Generated tokens per row, by source and by category."""
        return {
            by: {name: np.concatenate(chunks) for name, chunks in names.items()} for by, names in self._chunks.items()
        }


def generation_stats(plan: Plan, source: str) -> dict[str, Any]:
    """A source's generate sidecars summed: row outcomes, reuse, job hours and engine throughput."""
    engine = plan.config.engine
    gpus_per_job = (1 / engine.jobs_per_engine if engine.shared else 1.0) if uses_gpu(engine) else 0.0
    total: Counter[str] = Counter()
    wall = engine_tokens = 0.0
    shards = 0
    turns: dict[str, Any] | None = None
    for path in layout.sidecars(plan.completion_dir(source)):
        stats = json.loads(path.read_text())
        shards += 1
        if R.STAT_TURNS in stats:
            turns = _add_turns(turns, stats[R.STAT_TURNS])
        for key in (R.STAT_INPUT_ROWS, R.STAT_OK, R.STAT_TRUNCATED, R.STAT_WINDOW, R.STAT_ERROR, R.STAT_SKIPPED,
                    R.STAT_OUTSIDE_WINDOW, R.STAT_CROSS_SOURCE, R.STAT_REUSED, R.STAT_CONTINUED,
                    R.STAT_REUSED_ACROSS, R.STAT_GENERATED, R.STAT_LOOPS_STOPPED, R.STAT_LOOP_TOKENS,
                    R.STAT_REGENERATED, R.STAT_REGENERATED_ROWS):  # fmt: skip
            total[key] += int(stats.get(key) or 0)
        # a restored shard's sidecar keeps the numbers of the one run that generated it
        seconds = float(stats.get(R.STAT_WALL_SECONDS) or 0)
        wall += seconds
        engine_tokens += float(stats.get(R.STAT_OUTPUT_TOK_PER_S) or 0) * seconds
    rows = total[R.STAT_INPUT_ROWS]
    return {
        **({} if turns is None else {R.STAT_TURNS: turns}),
        "shards": shards,
        **{
            k: total[k]
            for k in (R.STAT_INPUT_ROWS, R.STAT_OK, R.STAT_TRUNCATED, R.STAT_WINDOW, R.STAT_ERROR, R.STAT_SKIPPED)
        },
        # of the skipped rows, those a selection left out (the window, another source's copies): no failure
        **{k: total[k] for k in (R.STAT_OUTSIDE_WINDOW, R.STAT_CROSS_SOURCE) if total[k]},
        # rows the engine stopped on the loop rule, and the output tokens they had (config degenerate.loop)
        **{k: total[k] for k in (R.STAT_LOOPS_STOPPED, R.STAT_LOOP_TOKENS) if total[k]},
        # degenerate policy regenerate: answers asked again, and rows whose answer is a later attempt's
        **{k: total[k] for k in (R.STAT_REGENERATED, R.STAT_REGENERATED_ROWS) if total[k]},
        "truncation_rate": round(total[R.STAT_TRUNCATED] / rows, 6) if rows else 0.0,
        "window_rate": round(total[R.STAT_WINDOW] / rows, 6) if rows else 0.0,  # ended at trainer.max_length
        "error_rate": round(R.failed_rows(total) / rows, 6) if rows else 0.0,
        "reuse_rate": round((total[R.STAT_REUSED] + total[R.STAT_CONTINUED]) / rows, 6) if rows else 0.0,
        # of those, rows a generation under other settings made (the same requests: keys.reuse_key)
        **({R.STAT_REUSED_ACROSS: total[R.STAT_REUSED_ACROSS]} if total[R.STAT_REUSED_ACROSS] else {}),
        "job_hours": round(wall / 3600, 4),
        "gpu_hours": round(wall / 3600 * gpus_per_job, 4),
        "engine_tok_per_s": round(engine_tokens / wall, 2) if wall else None,
    }


def _add_turns(total: dict[str, Any] | None, shard: dict[str, Any]) -> dict[str, Any]:
    """Two shards' ``turns`` summaries (generate.turn_counts) summed."""
    if total is None:
        return {**shard, "by_count": dict(shard["by_count"])}
    out: dict[str, Any] = {}
    for k in total.keys() | shard.keys():
        a, b = total.get(k), shard.get(k)
        if k != "by_count":  # counts add up; example lists are joined, the first few kept
            out[k] = ((a or []) + (b or []))[:3] if isinstance(a or b, list) else (a or 0) + (b or 0)
    by_count = Counter(total["by_count"]) + Counter(shard["by_count"])
    out["by_count"] = dict(sorted(by_count.items(), key=lambda kv: int(kv[0])))
    return out


def tables(plan: Plan, tally: Tally) -> dict[str, dict[str, dict[str, Any]]]:
    """The report's per-source and per-category numbers (kept in the manifest under ``report``)."""
    by_source: dict[str, dict[str, Any]] = {}
    completion = tally.completion
    no_rows = np.zeros(0, dtype=np.int32)
    for name, sp in plan.sources.items():
        lengths = completion["source"].get(name, no_rows)
        by_source[name] = {
            "category": sp.spec.category,
            "rows": len(lengths),
            "prompt_tokens": tally.prompt_tokens["source"][name],
            "completion_tokens": int(lengths.sum(dtype=np.int64)),
            "completion_length": length_stats(lengths),
            "finish_reasons": dict(sorted(tally.finish[name].items())),
            "generation": generation_stats(plan, name),
        }
    by_category: dict[str, dict[str, Any]] = {}
    for category in plan.config.mix_categories:
        lengths = completion["category"].get(category, no_rows)
        gens = [s["generation"] for s in by_source.values() if s["category"] == category]
        rows = sum(g[R.STAT_INPUT_ROWS] for g in gens)
        by_category[category] = {
            "rows": len(lengths),
            "prompt_tokens": tally.prompt_tokens["category"][category],
            "completion_tokens": int(lengths.sum(dtype=np.int64)),
            "completion_length": length_stats(lengths),
            "truncation_rate": round(sum(g[R.STAT_TRUNCATED] for g in gens) / rows, 6) if rows else 0.0,
            "window_rate": round(sum(g[R.STAT_WINDOW] for g in gens) / rows, 6) if rows else 0.0,
            "error_rate": round(sum(R.failed_rows(g) for g in gens) / rows, 6) if rows else 0.0,
            "gpu_hours": round(sum(g["gpu_hours"] for g in gens), 4),
        }
    return {"by_source": by_source, "by_category": by_category}


# -- tables as text ----------------------------------------------------------------------------------
# rows, tokens and completion length: the same columns in both tables
_SIZE_COLUMNS = (
    ("rows", lambda n, s: s["rows"]),
    ("prompt tok", lambda n, s: s["prompt_tokens"]),
    ("completion tok", lambda n, s: s["completion_tokens"]),
    *((k, lambda n, s, k=k: s["completion_length"][k]) for k in ("mean", "p50", "p90", "max")),
)
WINDOW_COLUMN = "at window"
OUTSIDE_WINDOW_COLUMN = "outside window"  # prompts trainer.max_length left no room for: skipped, never failed
_SOURCE_COLUMNS = (
    ("source", lambda n, s: n),
    ("category", lambda n, s: s["category"]),
    *_SIZE_COLUMNS,
    ("truncated", lambda n, s: f"{s['generation']['truncation_rate']:.1%}"),
    (WINDOW_COLUMN, lambda n, s: f"{s['generation'].get('window_rate', 0.0):.1%}"),
    (OUTSIDE_WINDOW_COLUMN, lambda n, s: s["generation"].get(R.STAT_OUTSIDE_WINDOW, 0)),
    ("failed", lambda n, s: f"{s['generation']['error_rate']:.1%}"),
    ("reused", lambda n, s: f"{s['generation']['reuse_rate']:.1%}"),
    ("GPU-h", lambda n, s: f"{s['generation']['gpu_hours']:.2f}"),
    ("tok/s", lambda n, s: s["generation"]["engine_tok_per_s"] or "-"),
)
_CATEGORY_COLUMNS = (
    ("category", lambda n, s: n),
    *_SIZE_COLUMNS,
    ("truncated", lambda n, s: f"{s['truncation_rate']:.1%}"),
    (WINDOW_COLUMN, lambda n, s: f"{s.get('window_rate', 0.0):.1%}"),
    ("failed", lambda n, s: f"{s['error_rate']:.1%}"),
    ("GPU-h", lambda n, s: f"{s['gpu_hours']:.2f}"),
)


def _shown(report: dict[str, Any], columns: Any) -> Any:
    """The columns worth showing: "at window" only in a build with rows that ended at trainer.max_length,
    "outside window" only in one with prompts it left no room for."""
    sources = report["by_source"].values()
    hidden = {
        WINDOW_COLUMN: not any(s["generation"].get("window_rate") for s in sources),
        OUTSIDE_WINDOW_COLUMN: not any(s["generation"].get(R.STAT_OUTSIDE_WINDOW) for s in sources),
    }
    return tuple(c for c in columns if not hidden.get(c[0]))


def _rows(table: dict[str, dict[str, Any]], columns: Any) -> list[list[str]]:
    return [[str(get(name, entry)) for _, get in columns] for name, entry in table.items()]


def markdown(report: dict[str, Any]) -> str:
    out = []
    for title, key, columns in (("By source", "by_source", _SOURCE_COLUMNS), ("By category", "by_category",
                                                                              _CATEGORY_COLUMNS)):  # fmt: skip
        columns = _shown(report, columns)
        head = [c for c, _ in columns]
        out += [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in _rows(report[key], columns)]
        out.append("")
    return "\n".join(out)


def plain(report: dict[str, Any]) -> str:
    """The per-source table as aligned text (the end-of-build summary)."""
    columns = _shown(report, _SOURCE_COLUMNS)
    head = [c for c, _ in columns]
    rows = [head, *_rows(report["by_source"], columns)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


def write_tables(folder: Path, manifest: dict[str, Any]) -> None:
    report = manifest["report"]
    language_head, language_rows = language_table(manifest)
    for name, head, rows in (
        (TABLES[0], *_table(report["by_source"], _shown(report, _SOURCE_COLUMNS))),
        (TABLES[1], *_table(report["by_category"], _shown(report, _CATEGORY_COLUMNS))),
        (TABLES[2], language_head, language_rows),
    ):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with atomic.atomic_open(folder / name) as f:
            writer = csv.writer(f)
            writer.writerow(head)
            writer.writerows(rows)


def _table(table: dict[str, dict[str, Any]], columns: Any) -> tuple[list[str], list[list[str]]]:
    return [c for c, _ in columns], _rows(table, columns)


# -- languages ---------------------------------------------------------------------------------------
def language_shares(by_language: dict[str, int]) -> dict[str, float]:
    """Each language's share of these tokens, largest first."""
    total = sum(by_language.values())
    return {lang: n / total for lang, n in sorted(by_language.items(), key=lambda kv: -kv[1])} if total else {}


def language_totals(manifest: dict[str, Any]) -> Counter[str]:
    """The dataset's tokens by language."""
    total: Counter[str] = Counter()
    for counts in manifest["languages"]["by_category"].values():
        total.update(counts)
    return total


def language_table(manifest: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Languages (rows, most tokens first) by their share of each category's tokens and of the dataset's."""
    by_category = manifest["languages"]["by_category"]
    total = language_totals(manifest)
    shares = {c: language_shares(counts) for c, counts in by_category.items()}
    head = ["language", *by_category, "all", "tokens"]
    rows = []
    for lang, share in language_shares(dict(total)).items():
        cells = [f"{shares[c].get(lang, 0.0):.1%}" for c in by_category]
        rows.append([lang, *cells, f"{share:.1%}", str(total[lang])])
    return head, rows


def languages_section(manifest: dict[str, Any]) -> str:
    """The card's language table, with the floors of mix.languages and what they reached."""
    head, rows = language_table(manifest)
    lines = [
        "## Languages",
        "",
        "Share of each category's tokens by the prompt's language (its user turns, detected by fastText's "
        "lid.176 model with a script rule for Chinese, Japanese and Korean; `und`: no letters).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    by_source = manifest["languages"]["by_source"]
    lines += ["", "| source | languages (share of its tokens) |", "|---|---|"]
    lines += [
        f"| {name} | " + ", ".join(f"{lang} {share:.1%}" for lang, share in language_shares(counts).items()) + " |"
        for name, counts in by_source.items()
    ]
    floors = manifest["mix"].get("languages") or {}
    if floors:
        lines += ["", "Floors (mix.languages):", ""]
        lines += [
            f"- {category}, {lang}: {got['achieved_share']:.1%} of its tokens (floor {got['floor']:.1%})"
            for category, by_language in floors.items()
            for lang, got in by_language.items()
        ]
    return "\n".join(lines) + "\n"


def degenerate_counts(plan: Plan, shards: Mapping[str, list[Path]]) -> dict[str, Any]:
    """The degenerate answers tokenize found in the shards the mix read (config ``degenerate``), by reason:
    per source, category, variant and language, each reason's policy, and how many of them were dropped."""
    policy = plan.config.degenerate
    by: dict[str, dict[str, Counter[str]]] = {k: {} for k in ("source", "category", "variant", "language")}
    for name, paths in shards.items():
        spec = plan.sources[name].spec
        for path in paths:
            stats_file = layout.sidecar(path)
            found = json.loads(stats_file.read_text()).get(R.STAT_DEGENERATE, {}) if stats_file.exists() else {}
            for reason, by_language in found.items():
                n = sum(by_language.values())
                for column, value in (("source", name), ("category", spec.category), ("variant", spec.variant)):
                    if value is not None:
                        by[column].setdefault(value, Counter())[reason] += n
                for lang, count in by_language.items():
                    by["language"].setdefault(lang, Counter())[reason] += count
    totals: Counter[str] = Counter()
    for counts in by["source"].values():
        totals.update(counts)
    return {
        "policy": {reason: policy.policy(reason) for reason in DEGENERATE_REASONS},
        "found": dict(totals),
        "dropped": sum(n for reason, n in totals.items() if policy.policy(reason) != "keep"),
        **{f"by_{k}": {name: dict(c) for name, c in sorted(v.items())} for k, v in by.items()},
    }


def degenerate_section(manifest: dict[str, Any]) -> str:
    """The card's section on degenerate answers: per source, by reason, with each reason's policy."""
    found = manifest.get("degenerate")
    if not found:
        return ""
    policies = ", ".join(f"{r} {p}" for r, p in found["policy"].items())
    lines = [
        "## Degenerate answers",
        "",
        f"Answers that are no training data (config `degenerate`; policies: {policies}): "
        f"{sum(found['found'].values())} found, {found['dropped']} dropped, never in the data.",
        "",
        "| source | " + " | ".join(DEGENERATE_REASONS) + " | stopped by the engine | asked again |",
        "|---|" + "---|" * (len(DEGENERATE_REASONS) + 2),
    ]
    by_source = found["by_source"]
    generation = {n: s["generation"] for n, s in manifest["report"]["by_source"].items()}
    for name in manifest["sources"]:
        counts = by_source.get(name, {})
        stopped = generation.get(name, {}).get(R.STAT_LOOPS_STOPPED, 0)
        again = generation.get(name, {}).get(R.STAT_REGENERATED, 0)
        cells = " | ".join(str(counts.get(r, 0)) for r in DEGENERATE_REASONS)
        lines.append(f"| {name} | {cells} | {stopped} | {again} |")
    if found["by_language"]:
        each = "; ".join(f"{lang} {dict(c)}" for lang, c in found["by_language"].items())
        lines += ["", f"By language: {each}."]
    return "\n".join(lines) + "\n"


def removed(manifest: dict[str, Any], source: str) -> dict[str, int]:
    """Rows of ``source`` removed by each reason: prepare's drops and the mix's cross-source ones."""
    counts = dict((manifest.get("prompts") or {}).get(source, {}).get(R.PROMPTS_DROPS, {}))
    for reason, n in ((manifest.get("cross_source") or {}).get(source) or {}).items():
        if reason != "examples" and n:
            counts[reason] = n
    return counts


def removals(manifest: dict[str, Any]) -> str:
    """The card's section on removed rows: per source, how many each step removed, with examples."""
    prompts = manifest.get("prompts") or {}
    lines = [
        "## Removed rows",
        "",
        "Per source, the rows that did not become prompts (prepare) and the prompts the mix left to another "
        "source that holds them too (cross_source_*).",
        "",
        "| source | rows in | prompts | removed |",
        "|---|---|---|---|",
    ]
    examples = []
    for name in manifest["sources"]:
        counts = removed(manifest, name)
        summary = ", ".join(f"{r} {n}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"
        info = prompts.get(name, {})
        lines.append(f"| {name} | {info.get('rows_in', '')} | {info.get('rows_out', '')} | {summary} |")
        for reason, found in sorted((info.get(R.PROMPTS_DROP_EXAMPLES) or {}).items()):
            examples += [f"- {name}, {reason}: `{e}`" for e in found[:2]]
        cross = (manifest.get("cross_source") or {}).get(name) or {}
        examples += [f"- {name}: `{e}`" for e in cross.get("examples", [])[:2]]
    if examples:
        lines += ["", "Examples:", "", *examples]
    return "\n".join(lines) + "\n"


def multi_turn(report: dict[str, Any]) -> str:
    """The card's section on ``turns: all`` sources: turns per conversation and the per-turn samples;
    empty when no source regenerates later turns."""
    rows: list[str] = []
    examples: list[str] = []
    for name, s in report["by_source"].items():
        turns = s["generation"].get(R.STAT_TURNS)
        if turns is None:
            continue
        spread = ", ".join(f"{n} turns: {c}" for n, c in turns["by_count"].items())
        tools = (
            f"{turns[R.STAT_TOOL_CALLS_MATCHED]} | {turns[R.TOOL_CALL_MISMATCH]}"
            if R.TOOL_CALL_MISMATCH in turns
            else "– | –"
        )
        rows.append(
            f"| {name} | {turns['conversations']} | {turns['turns']} | {turns['per_turn']} | "
            f"{turns['history_retokenized']} | {turns['ended_early']} | {tools} | {spread} |"
        )
        examples += [f"- {name}: `{e}`" for e in turns.get("tool_call_mismatch_examples", [])[:2]]
    if not rows:
        return ""
    head = [
        "## Multi-turn conversations",
        "",
        "Sources with `turns: all`. A per-turn conversation gives one sample per turn, its prompt the chat "
        "template's own render of the history (earlier answers re-tokenized as the template writes them); the "
        "others give one sample each. A conversation ends early when a turn does not stop on its own or its "
        "prompt no longer fits (the completion row's `error` says why). With `model.tool_call_parser`, a tool "
        "conversation goes on while the target's calls are the dataset's (turns whose calls matched) and ends "
        "after the first turn whose calls are not (`tool_call_mismatch`). Under `history: source` every assistant "
        "turn is regenerated on the dataset's own history up to it, one sample each, and none ends on a mismatch.",
        "",
        "| source | conversations | turns | per-turn conversations | turns with re-tokenized history | ended early "
        "| tool calls matched | ended on a tool-call mismatch | turns per conversation |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    tail = ["", "Tool-call mismatches, for example:", "", *examples] if examples else []
    return "\n".join(head + rows + tail) + "\n"


def mean(total: int, rows: int) -> float:
    return total / rows if rows else 0.0


def recipe(manifest: dict[str, Any]) -> str:
    """How the data was made: model, template, and per source its input, sampling and content keys."""
    model = manifest.get("model") or {}
    lines = [
        "## Recipe",
        "",
        f"- model: `{model.get('path')}`" + (f" at `{model['revision']}`" if model.get("revision") else ""),
        f"- model fingerprint (weights, config, tokenizer): `{_digest(manifest.get('model_fingerprint'))}`",
        f"- chat template fingerprint: `{_digest(manifest.get('template_fingerprint'))}`",
        "",
        "| source | category | input | sampling | prompt_key | gen_key | tok_key |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in manifest["sources"].items():
        gen = s["components"]["gen"]
        sampling = ", ".join(f"{k} {v}" for k, v in gen["sampling"].items())
        source_input = json.dumps(s["components"]["prompt"]["input"], sort_keys=True)
        if len(source_input) > 120:
            source_input = source_input[:117] + "..."
        lines.append(
            f"| {name} | {s['category']} | `{source_input}` | {sampling} | `{s['prompt_key']}` | `{s['gen_key']}` "
            f"| `{s['tok_key']}` |"
        )
    return "\n".join(lines) + "\n"


def _digest(fingerprint: Any) -> str:
    value = fingerprint.get("digest") if isinstance(fingerprint, dict) else fingerprint
    return str(value or "")[:16]
