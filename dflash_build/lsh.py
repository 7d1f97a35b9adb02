"""Locality-sensitive hashing's band split for near-duplicate removal (``dedup.near``): which bands of
how many MinHash values catch pairs around a similarity threshold. Plain numpy, so the plan can key
the split without loading a stage (stages/neardup.py computes the bands themselves)."""

from __future__ import annotations

import functools

import numpy as np

from dflash_build.spec import NearSpec


@functools.cache
def bands_rows(near: NearSpec) -> tuple[int, int]:
    """(bands, rows per band) of ``near``'s threshold and permutations (:func:`optimal_bands`)."""
    return optimal_bands(near.threshold, near.num_perm)


def components(near: NearSpec) -> dict[str, object]:
    """What decides which prompts go: the settings and the band split they give."""
    bands, rows = bands_rows(near)
    return {
        "threshold": near.threshold,
        "ngram": near.ngram,
        "num_perm": near.num_perm,
        "seed": near.seed,
        "bands": bands,
        "rows": rows,
    }


def catch_probability(similarity: float | np.ndarray, bands: int, rows: int) -> float | np.ndarray:
    """The chance two prompts of this Jaccard similarity share a band."""
    return 1 - (1 - np.asarray(similarity, dtype=float) ** rows) ** bands


def optimal_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) with bands × rows ≤ num_perm that minimise the false-positive area below
    ``threshold`` plus the false-negative area above it, equally weighted (as datasketch's MinHashLSH
    chooses them)."""
    grid = np.linspace(0, 1, 1001)
    below, above = grid <= threshold, grid >= threshold
    best: tuple[float, int, int] | None = None
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            p = catch_probability(grid, bands, rows)
            error = np.trapezoid(p[below], grid[below]) + np.trapezoid(1 - p[above], grid[above])
            if best is None or error < best[0] - 1e-12:
                best = (float(error), bands, rows)
    assert best is not None
    return best[1], best[2]
