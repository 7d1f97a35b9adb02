"""The dataset's card (README.md, with the YAML header `datasets` reads) and the build's summary lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_build.publish import plots, report
from dflash_build.store import layout
from dflash_build.store import records as R


def summary(manifest: dict[str, Any], where: Path, sources: bool = False) -> str:
    """The mix achieved against its targets; with ``sources``, the report's per-source table too."""
    counts = f"{manifest['rows']} rows, {manifest['tokens']} tokens, {manifest['loss_tokens']} loss tokens"
    lines = [f"dataset: {where} ({counts})"]
    lines.append(f"{'category':<16}{'target':>8}{'achieved':>10}{'tokens':>12}{'rows':>8}")
    for category, c in manifest["mix"]["categories"].items():
        lines.append(
            f"{category:<16}{c['target_share']:>8.1%}{c['achieved_share']:>10.1%}{c['tokens']:>12}{c['rows']:>8}"
        )
    length = manifest["length"]
    lines.append(f"length: mean {length['mean']}, p50 {length['p50']}, p90 {length['p90']}, max {length['max']}")
    if "languages" in manifest:
        shares = report.language_shares(dict(report.language_totals(manifest)))
        named = list(shares.items())[: report.NAMED_LANGUAGES]
        lines.append("languages: " + ", ".join(f"{lang} {share:.1%}" for lang, share in named))
    if "use" in manifest:
        use = manifest["use"]
        lines.append(
            f"used: {use['used_tokens']} of the {use['generated_tokens']} tokens generated ({use['used_share']:.1%}); "
            "the mix left out the rest"
        )
        if unread := use.get("unread"):  # as_needed: built for an earlier, larger need
            shards = sum(u["shards"] for u in unread.values())
            tokens = sum(u["tokens"] for u in unread.values())
            each = ", ".join(f"{name} {u['shards']}" for name, u in sorted(unread.items()))
            lines.append(
                f"also generated: {tokens} tokens in {shards} shards the current sizing does not name ({each}); "
                "kept in the store, used when the need grows"
            )
    across = {
        name: s["generation"][R.STAT_REUSED_ACROSS]
        for name, s in manifest.get("report", {}).get("by_source", {}).items()
        if s["generation"].get(R.STAT_REUSED_ACROSS)
    }
    if across:  # a template, prepare or scheme change re-keyed them; their requests were the same
        shown = ", ".join(f"{name} {n}" for name, n in sorted(across.items()))
        lines.append(f"reused across settings: {sum(across.values())} rows whose requests did not change ({shown})")
    lines.extend(f"note: {s}" for s in [*manifest["shortfalls"], *manifest.get("overshoots", [])])
    if sources and "report" in manifest:
        lines += ["", report.plain(manifest["report"]), f"card, plots and tables: {where}/README.md"]
    return "\n".join(lines)


def card_header(manifest: dict[str, Any]) -> str:
    """A dataset card's YAML header (so the folder loads with `datasets`) and its title.

    The exact file names, not a glob: `datasets` keys its cache of a local folder by the card's
    data_files, so a glob would serve the previous build's rows after a rebuild.
    """
    data_files = "\n".join(f"    - {f['path']}" for f in manifest["files"])
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path:
{data_files}
---
# {manifest["dataset"]}
"""


def use_table(manifest: dict[str, Any]) -> str:
    """Generated against used tokens by category and by source (empty for a dataset built before)."""
    use = manifest.get("use")
    if not use:
        return ""
    lines = ["Generated against used tokens (prompts and answers of every sample that reached the mix):", ""]
    lines += ["| category or source | generated | used | used share |", "|---|---|---|---|"]
    for col in ("category", "source"):
        for name, n in use[f"by_{col}"].items():
            share = n["used_tokens"] / n["generated_tokens"] if n["generated_tokens"] else 0.0
            lines.append(f"| {col} {name} | {n['generated_tokens']} | {n['used_tokens']} | {share:.1%} |")
    return "\n".join(lines) + "\n"


def variants_section(manifest: dict[str, Any]) -> str:
    """The card's table of sampling variants; empty without variants."""
    variants = manifest.get("variants") or {}
    if not variants:
        return ""

    def share(value: float | None) -> str:
        return "every prompt" if value is None else f"{value:.1%}"

    lines = [
        "## Sampling variants",
        "",
        "Each prompt is generated under the variant its prompt id draws by share (and under every variant "
        "with `every: true`). Shares are of prompts: configured, drawn at prepare, and held by the dataset; "
        "a variant that ends more than its tolerance below its drawn share fails the build. Answer tokens "
        "are the loss tokens per sample; ran out: samples whose answer hit max_new_tokens or the window.",
        "",
        "| variant | sources | configured | drawn | in the dataset | prompts | samples | tokens | mean answer tokens "
        "| ran out |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in variants.items():
        lines.append(
            f"| {name} | {', '.join(v['sources'])} | {share(v['configured_share'])} | {share(v['drawn_share'])} "
            f"| {share(v['achieved_share'])} | {v['prompts']} of {v['drawn_prompts']} | {v['rows']} | {v['tokens']} "
            f"| {v['mean_answer_tokens']} | {v['ran_out_rows']} |"
        )
    return "\n".join(lines) + "\n"


def dataset_card(manifest: dict[str, Any]) -> str:
    sources = "\n".join(
        f"| {name} | {s['category']} | {s['rows']} | {s['tokens']} | `{s['gen_key']}` |"
        for name, s in manifest["sources"].items()
    )
    shortfalls = "\n".join(f"- {s}" for s in manifest["shortfalls"]) or "- none"
    overshoots = "\n".join(f"- {s}" for s in manifest.get("overshoots", [])) or "- none"
    return f"""{card_header(manifest)}
Built by dflash-build. Each row is one training sample: `input_ids` are the prompt as the target model's
chat template rendered it, followed by the model's own answer; `loss_mask` is 1 on the generated tokens
only. Content keys of every input shard are in `{layout.MANIFEST}`.

```
{summary(manifest, Path("."))}
```

| source | category | rows | tokens | gen_key |
|---|---|---|---|---|
{sources}

{use_table(manifest)}
{variants_section(manifest)}
Shortfalls (below the configured mix):
{shortfalls}

Above the configured mix:
{overshoots}

Finish reasons: {json.dumps(manifest["finish_reasons"])}
{evaluation_line(manifest)}
{report.recipe(manifest)}
{card_body(manifest)}"""


def evaluation_line(manifest: dict[str, Any]) -> str:
    """Where the held-out split and the drafters' acceptance per slice are (config eval), else nothing."""
    found = manifest.get("evaluation")
    if found is None:
        return ""
    return (
        f"\nEval split (never trained on): [`{found['split']}`](../{found['split']}); acceptance per slice of "
        f"each drafter (`dflash-build accept`): [`{found['acceptance']}`](../{found['acceptance']}/README.md).\n"
    )


def card_body(manifest: dict[str, Any]) -> str:
    """The card's report: tables, then each plot with its caption."""
    shown = "\n\n".join(f"![{caption}]({path})\n\n*{caption}*" for path, caption in plots.captions(manifest))
    sections = [
        report.markdown(manifest["report"]),
        report.languages_section(manifest),
        report.removals(manifest),
        report.degenerate_section(manifest),
        drafting_section(manifest),
        by_acceptance_section(manifest),
        report.multi_turn(manifest["report"]),
    ]
    return "## Report\n\n" + "\n".join(s for s in sections if s) + f"\n{shown}\n"


PARITY_SKIPPED = (
    "**Warning:** this config generated with engine.drafter without its parity guard (preflight.skip_parity): "
    "nothing showed that the drafter leaves the target's answers unchanged on this engine."
)


def drafting_section(manifest: dict[str, Any]) -> str:
    """The card's table of the dataset's own acceptance, or nothing when no row was measured."""
    found = manifest.get("drafting")
    if not found:
        return ""
    slices = found["slices"]
    whole = slices["all"]
    drafter = found.get("drafter") or {}
    served = f"`{drafter.get('method')}`" + (f", `{drafter['path']}`" if drafter.get("path") else "")
    lines = [
        "## Acceptance in generation",
        "",
        f"Rows a drafter served in generation carry the engine's counts (this config's engine.drafter: "
        f"{served if drafter else 'none'}; each shard's generate sidecar names the one that served it): "
        f"{whole['measured']} of {whole['rows']} rows measured "
        f"({whole['measured_share']:.0%}; a row generated without it, or reused, carries no count). τ is tokens per "
        "verify step with the target's own token; per token it sums a slice's steps, per request it averages "
        "the own τ of each row with a verify step (as `accept` does).",
        *(["", PARITY_SKIPPED] if drafter.get("parity_skipped") else []),
        "",
        "| slice | rows | measured | τ per token | τ per request | accepted per draft position |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in slices.items():
        positions = " ".join(f"{p:.2f}" for p in s["per_position"])
        tau = "" if s["tau"] is None else f"{s['tau']:.2f}"
        per_request = "" if s["tau_per_request"] is None else f"{s['tau_per_request']:.2f}"
        lines.append(f"| {name} | {s['rows']} | {s['measured']} | {tau} | {per_request} | {positions} |")
    return "\n".join(lines) + "\n"


def by_acceptance_section(manifest: dict[str, Any]) -> str:
    """The card's account of mix.by_acceptance: per category, the rows each part chose and τ chosen against
    left out; nothing without it."""
    found = manifest.get("by_acceptance")
    if not found:
        return ""

    def tau(side: dict[str, Any]) -> str:
        return "" if side["tau_per_row"] is None else f"{side['tau_per_row']:.2f}"

    lines = [
        "## Chosen by acceptance",
        "",
        "Where a category had more rows than its target, the mix drew `fraction` of its tokens from the rows the "
        "drafter accepted least (a pool of the lowest-τ rows, `pool` times that part), the rest in rank order "
        "(config `mix.by_acceptance`; unmeasured rows are in the rest).",
        "",
        "| category | fraction | pool | hard rows | rest rows | unmeasured chosen | τ chosen | τ left out |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in found.items():
        lines.append(
            f"| {name} | {c['fraction']:g} | {c['pool']:g} | {c['hard_rows']} | {c['rest_rows']} | "
            f"{c['unmeasured_chosen']} | {tau(c['chosen'])} | {tau(c['left_out'])} |"
        )
    return "\n".join(lines) + "\n"
