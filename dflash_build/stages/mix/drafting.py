"""What the engine counted of the dataset's own rows where a drafter served generation (config
engine.drafter): τ per slice of the training data, per token and per request, and acceptance per draft
position, with the share of rows measured (the manifest's ``drafting``, the card's section)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dflash_build.engines.base import per_position, summed_histogram, tau, tau_figures

SLICES = ("category", "source", "language", "variant")


@dataclass
class _Slice:
    rows: int = 0
    measured: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tau_sum: float = 0.0  # the own τ of each measured row with a verify step, summed: τ per request
    tau_rows: int = 0
    histogram: list[int] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        steps = per_position(self.histogram)
        figures = tau_figures(self.steps, self.drafted, self.accepted, (self.tau_sum, self.tau_rows), steps)
        share = round(self.measured / self.rows, 4) if self.rows else 0.0
        return {"rows": self.rows, "measured": self.measured, "measured_share": share, **figures}


@dataclass
class DraftTally:
    """The written rows' acceptance columns (``records.SAMPLE_SCHEMA``), summed by slice as they are written."""

    slices: dict[str, _Slice] = field(default_factory=lambda: defaultdict(_Slice))

    def add(self, table: pa.Table, source: str, category: str, variant: str | None) -> None:
        columns = table.select(["language", "spec_steps", "spec_drafted", "spec_accepted", "spec_histogram"])
        for row in columns.to_pylist():
            names = {"category": category, "source": source, "language": row["language"], "variant": variant}
            for key in ["all", *(f"{k}={v}" for k, v in names.items() if v is not None)]:
                self._add(self.slices[key], row)

    @staticmethod
    def _add(into: _Slice, row: dict[str, Any]) -> None:
        into.rows += 1
        if row["spec_steps"] is None:
            return
        into.measured += 1
        into.steps += row["spec_steps"]
        into.drafted += row["spec_drafted"]
        into.accepted += row["spec_accepted"]
        if (own := tau(row["spec_steps"], row["spec_accepted"])) is not None:  # as accept's τ per request
            into.tau_sum, into.tau_rows = into.tau_sum + own, into.tau_rows + 1
        into.histogram = summed_histogram([into.histogram, row["spec_histogram"] or []])

    def report(self, drafter: dict[str, Any] | None) -> dict[str, Any] | None:
        """The manifest's ``drafting``; None when no row of the dataset was measured."""
        if not self.slices or self.slices["all"].measured == 0:
            return None
        return {"drafter": drafter, "slices": {k: s.report() for k, s in sorted(self.slices.items())}}
