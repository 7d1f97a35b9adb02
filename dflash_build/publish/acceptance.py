"""The acceptance report (``dist/NAME-acceptance``): the drafters side by side per slice of the eval split,
with what a reader needs to trust a figure: each slice's sampling and requests, the draft length and its
k + 1 ceiling, τ per token and per request, the answers left out as degenerate, the engine that measured
it, and whether that engine passed its calibration (stages.accept.calibration)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build.publish import release

NEXT_ROUND_ASSUMES = (
    "that a slice's τ rises when the training data holds more of it is an assumption, not a measurement: "
    "measure the drafter trained on the next round with `accept`"
)
OVERALL = ("all", "all")
OVERALL_LABEL = "overall"


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


def label(column: str, value: str) -> str:
    return OVERALL_LABEL if (column, value) == OVERALL else f"{column}={value}"


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


def sampling_label(row: dict[str, Any]) -> str:
    """A row's sampling as the report shows it: ``T 0.6, top_p 0.95, top_k 20, min_p 0``."""
    return ", ".join(f"{'T' if k == 'temperature' else k} {row[k]:g}" for k in SAMPLING_KEYS)


def build_report(
    measured: dict[str, dict[str, Any]],
    training: dict[str, dict[str, float]],
    weakest: int,
    split_key: str,
) -> dict[str, Any]:
    """The drafters side by side per slice (with the change from the first) and each one's weakest slices."""
    names = list(measured)
    first = names[0]
    slices = []
    for column, values in measured[first]["slices"].items():
        for value, figures in values.items():
            entry: dict[str, Any] = {
                "slice": label(column, value),
                "column": column,
                "value": value,
                "samplings": figures.get("samplings", []),
                "requests": figures["requests"],
                "degenerate": figures.get("degenerate", 0),
                "training_share": training.get(column, {}).get(value) if column != "all" else 1.0,
            }
            for name in names:
                theirs = measured[name]["slices"].get(column, {}).get(value)
                entry[name] = None if theirs is None else theirs["tau"]
                entry[f"{name} per request"] = None if theirs is None else theirs.get("tau_per_request")
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
            "slice": label(column, value),
            "column": column,
            "value": value,
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


def trust_line(drafter: dict[str, Any]) -> str:
    """Whether a drafter's figures can be trusted, as the engine's calibration found (one line)."""
    calibration = drafter.get("calibration")
    if calibration is None:
        return "not calibrated (accept.calibration.rows: 0): the engine's figures are taken as they are"
    failed = [c for c in calibration["samplings"] if not c["trusted"]]
    if not failed:
        return "trusted: the engine passed its calibration at every sampling measured"
    return "UNTRUSTED at " + "; ".join(
        f"{c['sampling']} (the target drafting for itself accepted position 1 on {c['position_1']:.2f} of its "
        f"steps; its own choices say {c['expected']:.2f} ± {c['margin']:.2f})"
        for c in failed
    )


def render_table(report: dict[str, Any]) -> str:
    """The report as Markdown: τ per slice for each drafter, then each drafter's figures and weakest slices."""
    names = list(report["drafters"])
    head = ["slice", "sampling", "requests", "left out", "training share"]
    head += [f"τ {n} (per token / per request)" for n in names] + [f"Δ {n}" for n in names[1:]]
    drafters = report["drafters"]
    lines = [
        "# Acceptance per slice",
        "",
        "τ: tokens per verify step, the bonus token included (1 + accepted / steps), read from the engine; "
        "per token sums every step of a slice, per request averages each request's own τ. Its ceiling is the "
        "draft length k + 1. Answers that looped to their budget or were empty are left out of τ and counted "
        "apart ('left out').",
        f"Eval split {report['split_key']}; engine {_engine(report)}.",
        "",
    ]
    for name in names:
        d = drafters[name]
        lines.append(f"- **{name}** ({d['drafter']['method']}): k = {d.get('draft_tokens', '?')}, ceiling τ "
                     f"{d.get('ceiling', '?')}; {trust_line(d)}")  # fmt: skip
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in report["slices"]:
        cells = [entry["slice"], "; ".join(entry["samplings"]) or "-", str(entry["requests"]), str(entry["degenerate"])]
        cells.append(_pct(entry["training_share"]))
        cells += [f"{_num(entry[n])} / {_num(entry.get(f'{n} per request'))}" for n in names]
        cells += [_num((entry.get("change") or {}).get(n)) for n in names[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    for name in names:
        overall = drafters[name]["overall"]
        lines += ["", f"## {name}: τ {_num(overall['tau'])} of a ceiling of {drafters[name].get('ceiling', '?')}"]
        left = drafters[name].get("degenerate", {})
        lines.append(
            f"{overall['requests']} requests measured, {drafters[name].get('failed', 0)} failed; left out of τ: "
            + (", ".join(f"{n} {reason}" for reason, n in sorted(left.items())) or "none")
        )
        lines += ["", "Acceptance by draft position: "]
        lines[-1] += ", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(overall["per_position"])) or "-"
        weak = report["weakest"][name]
        lines += ["", "Weakest slices (τ furthest below the overall figure):", ""]
        if not weak:
            lines.append("None: no slice is below the overall τ.")
            continue
        lines += ["| slice | τ | below overall | requests | training share |", "|---|---|---|---|---|"]
        for w in weak:
            lines.append(
                f"| {w['slice']} | {_num(w['tau'])} | {_num(w['below_overall'])} | {w['requests']} | "
                f"{_pct(w['training_share'])} |"
            )
    if "next_round" in report:
        lines += ["", "## The next round", ""]
        lines += [
            "The weakest slices' prompts the dataset does not hold, the config change that would take them, "
            "and what generating them costs:",
            "",
            *nextround_lines(report["next_round"]),
        ]
    return "\n".join(lines) + "\n"


def weak_slices(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Every drafter's weakest slices as (column, value), each once, weakest first."""
    return list(dict.fromkeys((w["column"], w["value"]) for weak in report["weakest"].values() for w in weak))


def _engine(report: dict[str, Any]) -> str:
    engines = {
        f"{d['engine']['backend']} {d['engine'].get('version') or '?'}"
        for d in report["drafters"].values()
        if d.get("engine")
    }
    return ", ".join(sorted(engines)) or "unrecorded"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def plot(report: dict[str, Any], path: Path) -> None:
    """τ per slice, one bar per drafter, with each drafter's k + 1 ceiling; the legend beside the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["drafters"])
    entries = report["slices"]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * len(entries) + 3.0), 4.5))
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(entries))]
        bars = ax.bar(xs, [e[name] or 0 for e in entries], width, label=f"τ {name}")
        ceiling = report["drafters"][name].get("ceiling")
        if ceiling is not None:
            color = bars.patches[0].get_facecolor() if bars.patches else None
            ax.axhline(ceiling, linestyle="--", linewidth=1, color=color, label=f"ceiling {name} (k + 1 = {ceiling})")
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(entries))])
    ax.set_xticklabels([e["slice"] for e in entries], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("τ (tokens per verify step)")
    ax.set_title(f"Acceptance per slice of the eval split {report['split_key']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)  # into the version being written, which is swapped in whole
    plt.close(fig)


def nextround_lines(table: list[dict[str, Any]]) -> list[str]:
    """The table as Markdown lines, with what it assumes."""
    out = [
        "| slice | prompts left out | past max_samples | change | rows to generate | answer tokens | GPU-h |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        left = sum(v for v in r["left_out_prompts"].values() if v is not None)
        unknown = " (some sources not prepared)" if None in r["left_out_prompts"].values() else ""
        if degenerate := sum(r.get("degenerate_rows", {}).values()):
            unknown += f" ({degenerate} degenerate: never taken)"
        change = "; ".join(f"`{k}: {_yaml(c['from'])} → {_yaml(c['to'])}`" for k, c in r["change"].items())
        if r["note"] and not r["change"]:
            out.append(f"| {r['slice']} | - | - | {r['note']} | - | - | - |")
            continue
        out.append(
            f"| {r['slice']} | {left}{unknown} | {sum(r['over_max_samples'].values())} | {change or 'none needed'}"
            f"{' (' + r['note'] + ')' if r['note'] else ''} | {r['rows_to_generate']} | {r['answer_tokens']} | "
            f"{r['gpu_hours']:.2f} |"
        )
    out += [
        "",
        "Rows, answer tokens and GPU-hours are `dflash-build plan`'s for the config with that row's change (each "
        f"row's against the config as it is: two rows' changes together are not costed here); {NEXT_ROUND_ASSUMES}.",
    ]
    return out


def _yaml(value: Any) -> str:
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
