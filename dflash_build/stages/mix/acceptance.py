"""Choosing a category's rows by where the drafter failed (config ``mix.by_acceptance``): verl-SpeCo's
hard-sample rule by tokens. Rows the drafter served in generation carry the engine's counts
(engine.drafter; a row's τ = 1 + accepted / steps); the measured rows with the lowest τ form a pool of
``pool`` x the hard part's tokens, the hard part (``fraction`` of the category's token target) is drawn from
the pool in the mix's seeded rank order, and the rest of the category fills in rank order as without the
rule. Only the order changes: the category's target and its language floors are met as before. Rows
without a measurement (no drafter, reused, counted with no verify step) never enter the pool: they are
part of the random rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dflash_build.spec import AcceptanceRule as Rule

COLUMNS = ("spec_steps", "spec_accepted")


def tau(paths: list[Path], rows: int) -> np.ndarray:
    """Each sample's τ across the token shards (in input order), NaN where unmeasured (a shard tokenized
    before the columns, a row no drafter served, or one counted with no verify step)."""
    out = np.full(rows, np.nan)
    at = 0
    for path in paths:
        shard = pq.ParquetFile(path)
        n = shard.metadata.num_rows
        if all(c in shard.schema_arrow.names for c in COLUMNS):
            table = shard.read(columns=list(COLUMNS))
            steps = table.column("spec_steps").to_numpy(zero_copy_only=False).astype(float)
            accepted = table.column("spec_accepted").to_numpy(zero_copy_only=False).astype(float)
            with np.errstate(invalid="ignore", divide="ignore"):
                out[at : at + n] = np.where(steps > 0, 1 + accepted / steps, np.nan)
        at += n
    return out


def order(members: np.ndarray, rank: np.ndarray, n_tokens: np.ndarray, taus: np.ndarray, target: float,
          rule: Rule) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``members`` (a category's eligible samples) in the order the mix fills from, and the samples drawn
    as the hard part (which lead it)."""
    by_rank = members[np.argsort(rank[members], kind="stable")]
    measured = by_rank[~np.isnan(taus[by_rank])]
    if not len(measured) or rule.fraction <= 0:
        return by_rank, by_rank[:0]
    hard_tokens = rule.fraction * target
    hardest = measured[np.lexsort((rank[measured], taus[measured]))]  # lowest τ first, ties by rank
    reach = np.cumsum(n_tokens[hardest].astype(np.int64))
    pool = hardest[: int(np.searchsorted(reach, rule.pool * hard_tokens)) + 1]
    pool = pool[np.argsort(rank[pool], kind="stable")]
    drawn = pool[: int(np.searchsorted(np.cumsum(n_tokens[pool].astype(np.int64)), hard_tokens)) + 1]
    rest = by_rank[~np.isin(by_rank, drawn)]
    return np.concatenate([drawn, rest]), drawn


def report(rule: Rule, drawn: np.ndarray, members: np.ndarray, chosen: np.ndarray, taus: np.ndarray,
           n_tokens: np.ndarray) -> dict[str, Any]:  # fmt: skip
    """The manifest's account of one category: the rows each part chose and τ of the chosen rows against the
    rows left out (per row: their mean; and weighted by their tokens)."""
    took = chosen[members]
    mine = members[took]
    left = members[~took]
    hard = np.isin(mine, drawn)

    def side(rows: np.ndarray) -> dict[str, Any]:
        measured = rows[~np.isnan(taus[rows])]
        weights = n_tokens[measured].astype(float)
        return {
            "rows": len(rows),
            "measured": len(measured),
            "tau_per_row": round(float(taus[measured].mean()), 4) if len(measured) else None,
            # the rows' own τ weighted by their tokens (not steps summed: a row's steps are not kept here)
            "tau_weighted_by_tokens": round(float(np.average(taus[measured], weights=weights)), 4)
            if len(measured)
            else None,
        }

    return {
        "fraction": rule.fraction,
        "pool": rule.pool,
        "hard_rows": int(hard.sum()),
        "rest_rows": int((~hard).sum()),
        "unmeasured_chosen": int(np.isnan(taus[mine]).sum()),
        "chosen": side(mine),
        "left_out": side(left),
    }
