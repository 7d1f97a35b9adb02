"""The dataset card's plots: matplotlib PNGs of a built dataset's manifest and its tally, into ``plots/``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dflash_build.publish.report import NAMED_LANGUAGES, Tally, language_shares, language_totals, mean, removed
from dflash_build.store import records as R

PLOTS = {
    "category_mix.png": (
        "Tokens per category: achieved share against the target share (split by sampling variant, with variants)."
    ),
    "completion_length_by_category.png": "Completion length (generated tokens per sample) per category, mean and P90.",
    "finish_reasons_by_source.png": "How each source's generated rows ended (from the generation sidecars).",
    "prompt_vs_completion_by_source.png": "Mean prompt and completion tokens per sample, per source.",
    "prompt_removals_by_source.png": (
        "Rows each source lost before generation (prepare) and in the mix to other sources' copies, by reason."
    ),
    "languages_by_category.png": (
        "Tokens per category by the prompt's language (the largest languages; the rest as other)."
    ),
}


def write_plots(folder: Path, manifest: dict[str, Any], tally: Tally) -> list[str]:
    """The card's PNGs (:data:`PLOTS`) into ``folder/plots``; returns their paths relative to ``folder``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a build node
    import matplotlib.pyplot as plt

    out = folder / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in _PLOTTERS.items():
        fig = draw(plt, manifest, tally)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(f"plots/{name}")
    return written


def _category_mix(plt: Any, manifest: dict[str, Any], tally: Tally) -> Any:
    """Achieved against target share."""
    categories = manifest["mix"]["categories"]
    names = list(categories)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(names)), 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [100 * categories[c]["target_share"] for c in names], 0.4, label="target")
    variants = manifest.get("variants") or {}
    if not variants:
        ax.bar([i + 0.2 for i in x], [100 * categories[c]["achieved_share"] for c in names], 0.4, label="achieved")
    bottom = [0.0] * len(names)
    for variant, v in variants.items():  # the achieved bar split by sampling variant
        heights = [100 * v["tokens_by_category"].get(c, 0) / max(manifest["tokens"], 1) for c in names]
        ax.bar([i + 0.2 for i in x], heights, 0.4, bottom=bottom, label=f"achieved: {variant}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    rest = [max(0.0, 100 * categories[c]["achieved_share"] - b) for c, b in zip(names, bottom, strict=True)]
    if variants and any(r > 0.05 for r in rest):  # sources without variants
        ax.bar([i + 0.2 for i in x], rest, 0.4, bottom=bottom, label="achieved: no variant")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("share of tokens (%)")
    ax.set_title(f"{manifest['dataset']}: category mix ({manifest['tokens']:,} tokens)")
    ax.legend()
    return fig


def _completion_lengths(plt: Any, manifest: dict[str, Any], tally: Tally) -> Any:
    """Completion length histograms, one panel per category."""
    from matplotlib.ticker import MaxNLocator

    names = list(manifest["mix"]["categories"])
    completion = tally.completion["category"]
    cols = min(3, max(1, len(names)))
    panels = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(panels, cols, figsize=(4.2 * cols, 3.0 * panels), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        lengths = completion.get(name, np.zeros(0, dtype=np.int32))
        stats = manifest["report"]["by_category"][name]["completion_length"]
        ax.hist(lengths if len(lengths) else [0], bins=min(40, max(5, len(lengths))), color="tab:blue", alpha=0.8)
        ax.axvline(stats["mean"], color="tab:orange", label=f"mean {stats['mean']:.0f}")
        ax.axvline(stats["p90"], color="tab:red", linestyle="--", label=f"P90 {stats['p90']}")
        ax.set_title(f"{name} ({len(lengths)} sample{'' if len(lengths) == 1 else 's'})")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("generated tokens per sample")
        ax.set_ylabel("samples")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    return fig


def _stacked(plt: Any, sources: list[str], series: dict[str, list[float]], xlabel: str, title: str) -> Any:
    """One horizontal bar per source, its parts stacked in ``series`` order."""
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(sources) + 1.2)))
    left = [0.0] * len(sources)
    for label, values in series.items():
        ax.barh(sources, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
    pad = 6
    if series:
        columns = min(5, len(series))
        ax.legend(ncols=columns, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
        pad += 18 * math.ceil(len(series) / columns)  # the title above the legend's rows
    ax.set_title(title, pad=pad)
    return fig


def _finish_reasons(plt: Any, manifest: dict[str, Any], tally: Tally) -> Any:
    """Generation outcomes per source, as fractions of the source's rows."""
    by_source = manifest["report"]["by_source"]
    kinds = (("ok", R.STAT_OK), ("truncated", R.STAT_TRUNCATED), ("at window", R.STAT_WINDOW),
             ("error/abort", R.STAT_ERROR), ("skipped", R.STAT_SKIPPED))  # fmt: skip

    def share(gen: dict[str, Any], key: str) -> float:
        return 100 * gen.get(key, 0) / gen[R.STAT_INPUT_ROWS] if gen[R.STAT_INPUT_ROWS] else 0.0

    series = {label: [share(by_source[s]["generation"], key) for s in by_source] for label, key in kinds}
    fig = _stacked(plt, list(by_source), series, "share of generated rows (%)", "finish reasons per source")
    fig.axes[0].set_xlim(0, 100)
    return fig


def _prompt_vs_completion(plt: Any, manifest: dict[str, Any], tally: Tally) -> Any:
    """Mean prompt and completion tokens per source."""
    by_source = manifest["report"]["by_source"]
    sources = list(by_source)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(sources) + 1.2)))
    ys = range(len(sources))
    prompt = [mean(by_source[s]["prompt_tokens"], by_source[s]["rows"]) for s in sources]
    completion = [mean(by_source[s]["completion_tokens"], by_source[s]["rows"]) for s in sources]
    ax.barh([y - 0.2 for y in ys], prompt, 0.4, label="prompt")
    ax.barh([y + 0.2 for y in ys], completion, 0.4, label="completion")
    ax.set_yticks(list(ys), sources)
    ax.invert_yaxis()
    ax.set_xlabel("mean tokens per sample")
    ax.set_title("prompt vs completion length per source")
    ax.legend(ncols=2, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.06))
    return fig


def _removals(plt: Any, manifest: dict[str, Any], tally: Tally) -> Any:
    """What removed each source's rows, in prepare and across sources in the mix."""
    sources = list(manifest["report"]["by_source"])
    counts = {name: removed(manifest, name) for name in sources}
    reasons = sorted({r for c in counts.values() for r in c})
    series = {reason: [float(counts[s].get(reason, 0)) for s in sources] for reason in reasons}
    return _stacked(plt, sources, series, "rows removed", "rows removed before generation and across sources")


def _languages(plt: Any, manifest: dict[str, Any], tally: Tally) -> Any:
    """Per category, its tokens' languages as stacked shares (the largest languages overall by name)."""
    by_category = manifest["languages"]["by_category"]
    total = language_totals(manifest)
    named = [lang for lang, _ in total.most_common(NAMED_LANGUAGES)]
    categories = list(by_category)
    shares = [language_shares(by_category[c]) for c in categories]
    series = {lang: [100 * of_category.get(lang, 0.0) for of_category in shares] for lang in named}
    if len(total) > len(named):
        series["other"] = [100 - sum(values) for values in zip(*series.values(), strict=True)]
    fig = _stacked(plt, categories, series, "share of the category's tokens (%)", "languages per category")
    fig.axes[0].set_xlim(0, 100)
    return fig


_PLOTTERS = {
    "category_mix.png": _category_mix,
    "completion_length_by_category.png": _completion_lengths,
    "finish_reasons_by_source.png": _finish_reasons,
    "prompt_vs_completion_by_source.png": _prompt_vs_completion,
    "prompt_removals_by_source.png": _removals,
    "languages_by_category.png": _languages,
}
assert list(_PLOTTERS) == list(PLOTS), "every plot has its caption, in the card's order"


def captions(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p, PLOTS[Path(p).name]) for p in manifest.get("plots", [])]
