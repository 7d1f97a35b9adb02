"""A source that loses too much fails loudly: at planning, from its first rows (a wrong ``format`` or
``fields``), and in prepare, from the whole selection (``max_drop_fraction``, or no prompt at all)."""

from __future__ import annotations

import itertools
import logging

from dflash_build.inputs import to_prompt
from dflash_build.inputs.rows import row_template_kwargs
from dflash_build.plan import Plan
from dflash_build.spec import SourceSpec
from dflash_build.stages.common.job import StageFailure
from dflash_build.stages.prepare.drops import DROP_OTHER_VARIANT, DROP_SETTINGS, INTENDED_DROPS, Drop, DropCounter
from dflash_build.stages.prepare.read import raw_rows
from dflash_build.stages.prepare.selection import Selection

log = logging.getLogger(__name__)


class SourceLossError(StageFailure):
    """A source lost too many rows (or all of them) in prepare; the message says why and what to change."""


SAMPLE_ROWS = 1000


def check_sample(plan: Plan, source: str, rows: int = SAMPLE_ROWS) -> None:
    """Fail at planning when the first ``rows`` rows of a local source are all defects (a wrong
    ``format`` or ``fields``), which its prepare job would find only after other jobs took the GPUs.

    Reads one batch, so it costs milliseconds; a source that allows every loss (max_drop_fraction 1)
    is not checked. The full check is prepare's (:func:`check_losses`), and ``dflash-build plan`` runs it.
    """
    spec = plan.sources[source].spec
    if spec.hf is not None or spec.max_drop_fraction >= 1:
        return
    drops = DropCounter()
    seen = 0
    for row in itertools.islice(raw_rows(plan, source), rows):
        seen += 1
        try:
            to_prompt(row.value, spec)
            row_template_kwargs(row.value, spec)
            return
        except Drop as drop:
            if drop.reason in INTENDED_DROPS:
                return
            drops.add(drop.reason, row.location, drop.detail)
    if not seen:
        return  # an empty input: prepare says so, with its own message
    key = f"sources.{source}"
    extra = f" or {key}.chat_template_kwargs_from" if spec.chat_template_kwargs_from else ""
    reasons = "; ".join(
        f"{reason}: {n}" + (f", e.g. {drops.examples[reason][0]}" if drops.examples[reason] else "")
        for reason, n in drops.counts.most_common(3)
    )
    raise SourceLossError(
        f"{key} ({', '.join(spec.files)}): the first {seen} rows are all dropped for defects ({reasons}), so "
        f"its prepare job would fail after the other sources' jobs took the GPUs. Fix {key}.format or "
        f"{key}.fields{extra}; if only these first rows are bad, set {key}.max_drop_fraction: 1.0 to skip this check."
    )


def check_losses(spec: SourceSpec, selection: Selection) -> None:
    """Fail loudly when a source yields nothing or drops more than ``max_drop_fraction`` to defects.

    Duplicates, ``max_samples`` and the length filters are what the config asked for and never count.
    """
    drops = selection.drops
    rows_out = selection.rows_out
    defects = {r: n for r, n in drops.counts.items() if r not in INTENDED_DROPS}
    lost = sum(defects.values())
    key = f"sources.{spec.config_name}"
    variant = f", variant {spec.variant}" if spec.variant is not None else ""
    where = f"{key} ({', '.join(spec.files) if spec.hf is None else spec.hf.path}{variant})"
    if selection.rows_in == 0:
        raise SourceLossError(f"{where}: the input has no rows; check {key}.files / {key}.hf (path, name, split)")
    intended = {r: n for r, n in drops.counts.items() if r in INTENDED_DROPS}
    if rows_out == 0 and drops.counts.get(DROP_OTHER_VARIANT) and lost / selection.rows_in <= spec.max_drop_fraction:
        # the source's prompts went to its other variants: a selection (variants.*.share), never a defect
        log.warning(
            "%s: the variant draw gave this variant none of its %d prompts (other_variant %d): it generates "
            "nothing; its siblings hold them",
            where,
            selection.rows_in,
            drops.counts[DROP_OTHER_VARIANT],
        )
        return
    if rows_out == 0 and intended and sum(intended.values()) >= lost:
        steps = "; ".join(
            f"{reason} {n} ({DROP_SETTINGS[reason]}"
            + (f", e.g. {drops.examples[reason][0]})" if drops.examples[reason] else ")")
            for reason, n in sorted(intended.items(), key=lambda kv: -kv[1])
        )
        raise SourceLossError(
            f"{where}: every one of its {selection.rows_in} rows was removed, so the source yields no prompt "
            f"at all: {steps}. Loosen that step or remove the source."
        )
    fraction = lost / selection.rows_in
    if rows_out > 0 and fraction <= spec.max_drop_fraction:
        return
    lines = [
        f"{where}: {lost} of {selection.rows_in} rows ({fraction:.1%}) were dropped for defects"
        + (", so the source yields no prompt at all" if rows_out == 0 else "")
        + f"; the limit is {spec.max_drop_fraction:.0%} ({key}.max_drop_fraction or checks.max_drop_fraction)."
    ]
    for reason, n in sorted(drops.counts.items(), key=lambda kv: -kv[1])[:4]:
        examples = "; ".join(drops.examples[reason][:2])
        lines.append(f"  {reason}: {n} rows" + (f", e.g. {examples}" if examples else ""))
    lines.append(
        f"Fix the mapping ({key}.format, {key}.fields, {key}.roles) if the rows are good but read wrongly; "
        f"raise {key}.max_drop_fraction if these rows are meant to go."
    )
    raise SourceLossError("\n".join(lines))
