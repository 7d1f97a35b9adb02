"""Each category's token target, the mix's rule: what the mix takes (:mod:`dflash_build.stages.mix`) and
what the sizing generates towards (:mod:`dflash_build.stages.size`, ``mix.generate: as_needed``), and
whether a category binds (taken whole). It lives here, below both stages, so that neither imports the
other for it: the sizing reads the mix's rule, and the mix's descriptor reads the sizing's shards
(tests/test_layout.py names that one seam)."""

from __future__ import annotations

from collections import Counter


def category_targets(
    shares: dict[str, float],
    available: dict[str, int],
    budget: int | None,
    floors: dict[str, dict[str, float]] | None = None,
    available_by_language: dict[str, Counter[str]] | None = None,
) -> dict[str, float]:
    """Token target per category. Without a budget, the largest total at which every category's share,
    and every language floor within a category (``floors``, met from ``available_by_language``), can be
    taken from what is available."""
    if budget is not None:
        return {c: share * budget for c, share in shares.items()}
    limits = [available.get(c, 0) / share for c, share in shares.items() if available.get(c, 0) > 0]
    for category, by_language in (floors or {}).items():
        supply = (available_by_language or {}).get(category, Counter())
        limits += [supply[lang] / (floor * shares[category]) for lang, floor in by_language.items() if supply[lang]]
    total = min(limits) if limits else 0.0
    return {c: share * total for c, share in shares.items()}


def binds(target: float, available: float) -> bool:
    """Whether a category's target takes all it has (its supply sets the dataset's size), to within the
    rounding of a target to whole tokens."""
    return available > 0 and target >= available - 1
