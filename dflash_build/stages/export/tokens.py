"""Token rows: ``specforge`` and ``speculators``, JSONL rows ``{id, input_ids, loss_mask}``.

- ``specforge``: for SpecForge's ``data.prompts_path`` (``specforge/data/prompt_builder.py``: the first
  record decides that the file is pre-tokenized; rows are cut to ``max_length``; rows with fewer than
  ``min_loss_tokens`` supervised tokens are dropped, and for DFlash those without two adjacent ones,
  ``specforge/data/loss_mask.py``).
- ``speculators``: the same rows, which vLLM speculators' ``prepare_data`` passes through
  (``data_generation/preprocessing.py``, ``_passthrough_pretokenized``: cut to ``seq_length``, rows with
  no supervised token in the window dropped) from a folder of ``.jsonl`` files.

A trainer cuts every sample at its window, silently. With ``max_length`` set, the export says what that
costs and applies a policy (``long``): ``warn`` keeps samples whole and reports the samples and loss
tokens the trainer will cut, ``cut`` cuts them as the trainer would, ``drop`` leaves them out, ``split``
writes ``max_length`` pieces (``id`` gets ``#k``). The trainer's own filters are applied to what the
trainer will see, so the rows its loader yields are exactly the rows written (cut at its window), and
every sample left out is counted with its reason.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_build.spec import ExportSpec
from dflash_build.stages.export.formats import ExportFormat, Written
from dflash_build.stages.export.jsonl import JsonlShards, sample_id, samples

DROP_LONG = "longer_than_max_length"
DROP_FEW_LOSS = "few_loss_tokens"  # fewer than min_loss_tokens in the whole sample
DROP_FEW_IN_WINDOW = "few_loss_tokens_within_max_length"  # enough in all, too few in the trainer's window
DROP_NOT_CONSECUTIVE = "no_adjacent_loss_tokens"


def shape(ids: Sequence[int], mask: Sequence[int], spec: ExportSpec) -> tuple[list[tuple[int, int]], str | None]:
    """The rows one sample becomes, as (start, end) spans of it, or the reason it is left out.

    The trainer's filters look at what the trainer sees: the row cut at ``max_length``.
    """
    limit = spec.max_length
    if limit is None or len(ids) <= limit or spec.long == "warn":
        spans = [(0, len(ids))]
    elif spec.long == "drop":
        return [], DROP_LONG
    elif spec.long == "cut":
        spans = [(0, limit)]
    else:  # split
        spans = [(start, min(start + limit, len(ids))) for start in range(0, len(ids), limit)]
    kept, why = [], None
    for start, end in spans:
        seen = mask[start : end if limit is None else min(end, start + limit)]
        why = _filtered(seen, spec)
        whole = mask[start:end] if spec.long == "split" else mask  # a cut sample: the window is the cause
        if why == DROP_FEW_LOSS and _filtered(whole, spec) is None:
            why = DROP_FEW_IN_WINDOW
        if why is None:
            kept.append((start, end))
    return kept, (why if not kept else None)


def _filtered(mask: Sequence[int], spec: ExportSpec) -> str | None:
    if sum(mask) < max(spec.min_loss_tokens, 1):  # a row with no supervised token teaches nothing
        return DROP_FEW_LOSS
    if spec.consecutive and not any(a and b for a, b in itertools.pairwise(mask)):
        return DROP_NOT_CONSECUTIVE
    return None


def _token_rows(files: Sequence[Path], spec: ExportSpec, out: JsonlShards) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for row in samples(files, ["input_ids", "loss_mask", "prompt_id", "sample_idx", "turn", "variant"]):
        ids, mask = row["input_ids"], row["loss_mask"]
        counts["samples_in"] += 1
        counts["loss_tokens_in"] += sum(mask)
        long = spec.max_length is not None and len(ids) > spec.max_length
        spans, why = shape(ids, mask, spec)
        counts["long"] += long
        if why is not None:
            dropped[why] += 1
            counts["dropped_loss_tokens"] += sum(mask)
            continue
        counts["long_kept"] += long
        base = sample_id(row["prompt_id"], row["sample_idx"], row["turn"], row["variant"])
        for k, (start, end) in enumerate(spans):
            piece_id = base if len(spans) == 1 and start == 0 else f"{base}#{k}"
            out.write({"id": piece_id, "input_ids": ids[start:end], "loss_mask": mask[start:end]})
            counts["rows"] += 1
            counts["tokens"] += end - start
            counts["loss_tokens"] += sum(mask[start:end])
            if spec.max_length is not None and end - start > spec.max_length:  # warn: the trainer cuts it
                counts["trainer_cuts_loss_tokens"] += sum(mask[start + spec.max_length : end])
        if long and spec.long in ("cut", "split"):
            counts["cut_loss_tokens"] += sum(mask) - sum(sum(mask[s:e]) for s, e in spans)
    return {
        "samples_in": counts["samples_in"],
        "rows": counts["rows"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "loss_tokens_in": counts["loss_tokens_in"],
        "longer_than_max_length": counts["long"],
        "kept_longer_than_max_length": counts["long_kept"],  # long: warn, the trainer cuts these
        "trainer_cuts_loss_tokens": counts["trainer_cuts_loss_tokens"],  # long: warn, lost in the trainer
        "cut_loss_tokens": counts["cut_loss_tokens"],  # long: cut/split, lost here (split loses none it keeps)
        "dropped": dict(sorted(dropped.items())),
        "dropped_loss_tokens": counts["dropped_loss_tokens"],
    }


def summary(manifest: dict[str, Any], where: Path) -> str:
    rows, fmt = manifest["rows"], manifest["format"]
    limit = manifest["export"]["max_length"]
    window = f", max_length {limit} ({manifest['export']['long']})" if limit else ""
    tokens = f"{manifest['tokens']} tokens, {manifest['loss_tokens']} loss tokens"
    return f"export {fmt}: {where} ({rows} rows, {tokens}{window})"


def card(manifest: dict[str, Any]) -> list[str]:
    spec = manifest["export"]
    return [
        f"- tokens: {manifest['tokens']}, loss tokens: {manifest['loss_tokens']} of {manifest['loss_tokens_in']}",
        f"- max_length: {spec['max_length']} (long samples: {spec['long']}); longer samples: "
        f"{manifest['longer_than_max_length']}",
        f"- filters: min_loss_tokens {spec['min_loss_tokens']}, two adjacent loss tokens: {spec['consecutive']}",
    ]


def write(job: Written) -> dict[str, Any]:
    return _token_rows(job.files, job.spec, job.out)


FORMATS = (
    # JSONL {id, input_ids, loss_mask} for SpecForge's data.prompts_path
    ExportFormat("specforge", write, summary, card),
    # the same rows, which speculators' prepare_data passes through
    ExportFormat("speculators", write, summary, card),
)
