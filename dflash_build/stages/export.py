"""Export stage (optional): the mixed dataset in the form a drafter trainer reads, beside the dataset.

- ``specforge``: JSONL rows ``{id, input_ids, loss_mask}`` for SpecForge's ``data.prompts_path``
  (``specforge/data/prompt_builder.py``: the first record decides that the file is pre-tokenized; rows
  are cut to ``max_length``; rows with fewer than ``min_loss_tokens`` supervised tokens are dropped, and
  for DFlash those without two adjacent ones, ``specforge/data/loss_mask.py``).
- ``speculators``: the same rows, which vLLM speculators' ``prepare_data`` passes through
  (``data_generation/preprocessing.py``, ``_passthrough_pretokenized``: cut to ``seq_length``, rows with
  no supervised token in the window dropped) from a folder of ``.jsonl`` files.
- ``conversations``: ``{id, conversations: [{role, content, reasoning_content?}], tools}``, the source's
  messages with every regenerated answer as text (its reasoning, between the template's think markers,
  in ``reasoning_content``), for trainers that render and mask themselves.

A trainer cuts every sample at its window, silently. With ``max_length`` set, the export says what that
costs and applies a policy (``long``): ``warn`` keeps samples whole and reports the samples and loss
tokens the trainer will cut, ``cut`` cuts them as the trainer would, ``drop`` leaves them out, ``split``
writes ``max_length`` pieces (``id`` gets ``#k``). The trainer's own filters are applied to what the
trainer will see, so the rows its loader yields are exactly the rows written (cut at its window), and
every sample left out is counted with its reason. Each export is a folder version like the dataset's
(:mod:`dflash_build.publish.release`): ``data/*.jsonl``, ``manifest.json`` and a card, swapped in whole.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import pyarrow.parquet as pq

from dflash_build import hashing, toolcalls
from dflash_build.publish import release
from dflash_build.spec import ExportSpec, SourceSpec
from dflash_build.stages.common.chat import answer_slots
from dflash_build.stages.common.job import Job, StageFailure
from dflash_build.store import atomic, layout
from dflash_build.versions import EXPORT_VERSION

log = logging.getLogger(__name__)

DATA_DIR = "data"  # the trainers read this folder (a folder of the version also holds manifest.json)
DROP_LONG = "longer_than_max_length"
DROP_FEW_LOSS = "few_loss_tokens"  # fewer than min_loss_tokens in the whole sample
DROP_FEW_IN_WINDOW = "few_loss_tokens_within_max_length"  # enough in all, too few in the trainer's window
DROP_NOT_CONSECUTIVE = "no_adjacent_loss_tokens"


class ExportEmptyError(StageFailure):
    """Every sample of the dataset would be left out of an export: it fails instead of writing nothing."""


def sample_id(prompt_id: str, sample_idx: int, turn: int | None = None, variant: str | None = None) -> str:
    """A sample's id in an export: ``prompt:sample``, ``:turn`` for one turn of a conversation, and
    ``@variant`` for a sampling variant's (one prompt under two variants is two samples)."""
    base = f"{prompt_id}:{sample_idx}" if turn is None else f"{prompt_id}:{sample_idx}:{turn}"
    return base if variant is None else f"{base}@{variant}"


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


def export_key(mix_manifest: dict[str, Any], spec: ExportSpec) -> str:
    """What decides an export: the dataset's content, the export's settings, the scheme."""
    content = [f["sha256"] for f in mix_manifest["files"]]
    return hashing.digest({"mix": content, "export": asdict(spec), "version": EXPORT_VERSION})[:16]


class JsonlShards:
    """JSONL files of ``shard_rows`` rows each, named ``train-00000-of-0000N.jsonl`` once all are written."""

    def __init__(self, folder: Path, shard_rows: int) -> None:
        self.folder, self.shard_rows = folder, shard_rows
        folder.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []
        self.rows_in: list[int] = []
        self._file: IO[str] | None = None

    def write(self, row: Mapping[str, Any]) -> None:
        if self._file is None or self.rows_in[-1] >= self.shard_rows:
            self._next()
        assert self._file is not None
        self._file.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
        self.rows_in[-1] += 1

    def _next(self) -> None:
        self._close_one()
        self.paths.append(self.folder / f".part-{len(self.paths):05d}.jsonl")
        self.rows_in.append(0)
        self._file = open(self.paths[-1], "w", encoding="utf-8")  # noqa: SIM115 (held across writes)

    def _close_one(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())  # the version becomes visible by one rename: durable before it
            self._file.close()
            self._file = None

    def close(self, base: Path) -> list[dict[str, Any]]:
        """Name the files (an empty export is one empty file: the trainer's path exists) and list them."""
        if not self.paths:
            self._next()
        self._close_one()
        files = []
        for i, (path, rows) in enumerate(zip(self.paths, self.rows_in, strict=True)):
            final = self.folder / f"train-{i:05d}-of-{len(self.paths):05d}.jsonl"
            path.rename(final)
            files.append({"path": str(final.relative_to(base)), "rows": rows, "sha256": hashing.sha256_file(final)})
        atomic.fsync_dir(self.folder)
        return files


def run(job: Job) -> dict[str, Any]:
    """Write the job's format's export of the dataset (its declared input) as a new version of the export
    folder, whose build record is the job's output. Conversations read each source's completion shards
    (declared) and the prompt shards beside its manifest (declared)."""
    assert job.fmt is not None
    spec = job.plan.config.exports[job.fmt]
    record = job.output("record")
    out_dir = release.folder_of(record)
    dataset = release.in_place(job.published("dataset"))
    mix_manifest, files = dataset.manifest, dataset.files
    stores = _prompts_and_completions(job.by_source("store"))
    with release.publish(out_dir, record) as tmp:
        shards = JsonlShards(tmp / DATA_DIR, spec.shard_rows)
        if spec.format == "conversations":
            specs = {n: sp.spec for n, sp in job.plan.sources.items()}
            counts = _conversations(files, stores, spec, shards, specs)
        else:
            counts = _token_rows(files, spec, shards)
        if counts["samples_in"] and not counts["rows"]:
            reasons = ", ".join(f"{n} {why}" for why, n in (counts.get("dropped") or {}).items())
            raise ExportEmptyError(
                f"export.{spec.format}: all {counts['samples_in']} samples of {mix_manifest['dataset']} were left "
                f"out ({reasons}): a trainer would get nothing. Raise export.{spec.format}.max_length, or set "
                f"export.{spec.format}.long to warn, cut or split; the last good {out_dir.name} stays as it was"
            )
        manifest = {
            "stage": "export",
            "format": spec.format,
            "scheme": EXPORT_VERSION,
            "export_key": export_key(mix_manifest, spec),
            "dataset": out_dir.name,
            "exported_from": mix_manifest["dataset"],
            "export": asdict(spec),
            "files": shards.close(tmp),
            **counts,
        }
        atomic.write_json(tmp / layout.MANIFEST, manifest)
        atomic.write_text(tmp / "README.md", card(manifest))
    log.info("%s", summary(manifest, out_dir))
    for line in warnings(manifest):
        log.warning("%s", line)
    return manifest


def _samples(files: list[Path], columns: list[str]) -> Iterator[dict[str, Any]]:
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048, columns=columns):
            yield from batch.to_pylist()


def _token_rows(files: list[Path], spec: ExportSpec, out: JsonlShards) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for row in _samples(files, ["input_ids", "loss_mask", "prompt_id", "sample_idx", "turn", "variant"]):
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


# -- conversations ---------------------------------------------------------------------------------
def assistant_message(text: str, think: tuple[str, str], parser: str | None, tools: toolcalls.Tools) -> dict[str, Any]:
    """A generated answer as the server would return it: reasoning apart (the generation prompt may have
    opened the think block already, so the closing marker decides), and with ``parser`` its tool calls
    as structured ``tool_calls``."""
    reasoning, content = toolcalls.split_reasoning(text, think)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parser is not None:
        parsed = toolcalls.parse(parser, content, tools)
        message["content"] = parsed.content
        if parsed.calls:
            message["tool_calls"] = [c.as_openai() for c in parsed.calls]
    return message | ({"reasoning_content": reasoning} if reasoning else {})


def conversation(
    messages: list[dict[str, Any]],
    answers: list[str],
    think: tuple[str, str],
    parser: str | None = None,
    tools: toolcalls.Tools = None,
) -> list[dict[str, Any]]:
    """The source's messages with its assistant turns replaced, in order, by the regenerated answers; a
    conversation that ended early (a truncated or failed turn) ends after its last regenerated answer."""
    out: list[dict[str, Any]] = []
    pending = list(answers)

    def answer() -> None:
        out.append(assistant_message(pending.pop(0), think, parser, tools))

    for message in messages:
        if message.get("role") == "assistant":
            if not pending:
                break
            answer()
            continue
        if not pending and out and out[-1]["role"] == "assistant":
            break  # what follows the last regenerated answer was never answered
        out.append({k: v for k, v in message.items() if v is not None})
    while pending:
        answer()
    return out


def turn_on_history(
    messages: list[dict[str, Any]],
    turn: int,
    answer: str,
    think: tuple[str, str],
    parser: str | None = None,
    tools: toolcalls.Tools = None,
) -> list[dict[str, Any]]:
    """One turn of a ``history: source`` conversation as it was asked: the source's messages up to that
    answer (its own earlier answers, their calls as a server sends them), then the regenerated answer."""
    slot = answer_slots(messages, "all")[turn]
    history = [_as_sent(m) for m in messages[:slot]]
    return [*history, assistant_message(answer, think, parser, tools)]


def _as_sent(message: dict[str, Any]) -> dict[str, Any]:
    """A prompt message as a chat API holds it: no empty fields, calls' arguments as JSON strings."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("tool_calls"):
        out["tool_calls"] = [
            toolcalls.ToolCall(c["function"]["name"], c["function"].get("arguments") or {}).as_openai()
            for c in out["tool_calls"]
        ]
    return out


def _prompts_and_completions(store: Mapping[str, list[Path]]) -> dict[str, list[tuple[Path, Path]]]:
    """Each source's (prompt shard, completion shard) pairs, in shard order, from its declared manifest
    and completion shards: a prompt shard lies beside its manifest, named as its completion shard."""
    pairs = {}
    for source, paths in store.items():
        manifests = [p for p in paths if p.name == layout.MANIFEST]
        if manifests:
            pairs[source] = [(manifests[0].parent / p.name, p) for p in paths if p.name != layout.MANIFEST]
    return pairs


def _records(
    messages: list[dict[str, Any]],
    done: dict[str, Any],
    tools: toolcalls.Tools,
    spec: ExportSpec,
    on_history: bool,
    variant: str | None = None,
) -> list[tuple[str, list[dict[str, Any]]]]:
    """A completion row's export records, (id, conversation): its conversation, or under ``history:
    source`` each turn on the history it was asked on."""
    key = (done["prompt_id"], done["sample_idx"])
    parser = spec.tool_call_parser
    answers = [t["text"] for t in done["turns"]] if done["turns"] else [done["text"]]
    if on_history:
        return [
            (sample_id(*key, k, variant), turn_on_history(messages, k, answer, spec.think, parser, tools))
            for k, answer in enumerate(answers)
        ]
    return [(sample_id(*key, variant=variant), conversation(messages, answers, spec.think, parser, tools))]


def _conversations(
    files: list[Path],
    stores: Mapping[str, list[tuple[Path, Path]]],
    spec: ExportSpec,
    out: JsonlShards,
    sources: Mapping[str, SourceSpec],
) -> dict[str, Any]:
    """Shard by shard of each source's prompts and completions (memory holds one shard), the rows of the
    dataset they hold: a conversation each, or, for a ``history: source`` source, each turn on the
    history it was asked on; a sampling variant's ids end with it."""
    wanted: dict[str, set[tuple[str, int]]] = {}
    for row in _samples(files, ["source", "prompt_id", "sample_idx"]):
        wanted.setdefault(row["source"], set()).add((row["prompt_id"], row["sample_idx"]))
    counts: Counter[str] = Counter()
    for source in sorted(wanted):
        paths = stores.get(source)
        if paths is None:
            raise ValueError(f"the dataset has rows of source '{source}', which the config no longer has")
        todo = wanted[source]
        for prompts_path, completions_path in paths:
            prompts = {
                r["prompt_id"]: r
                for r in pq.read_table(prompts_path, columns=["prompt_id", "messages", "tools"]).to_pylist()
            }
            columns = ["prompt_id", "sample_idx", "text", "turns"]
            for done in pq.read_table(completions_path, columns=columns).to_pylist():
                key = (done["prompt_id"], done["sample_idx"])
                if key not in todo:
                    continue
                todo.discard(key)
                prompt = prompts[done["prompt_id"]]
                tools = json.loads(prompt["tools"]) if prompt["tools"] else None
                on_history = sources[source].history == "source" and bool(done["turns"])
                variant = sources[source].variant
                records = _records(json.loads(prompt["messages"]), done, tools, spec, on_history, variant)
                counts["turns"] += len(done["turns"] or [None])
                for record_id, turns in records:
                    out.write({"id": record_id, "conversations": turns, "tools": tools})
                    counts["rows"] += 1
                    counts["with_reasoning"] += any("reasoning_content" in t for t in turns)
                    # the target's calls (a history's earlier calls are the dataset's)
                    calls = sum(len(t.get("tool_calls", ())) for t in (turns[-1:] if on_history else turns))
                    counts["with_tool_calls"] += bool(calls)
                    counts["tool_calls"] += calls
        if todo:
            example = sorted(todo)[0]
            raise ValueError(
                f"{len(todo)} rows of source '{source}' are in the dataset but not in its completion shards "
                f"(e.g. prompt {example[0]}, sample {example[1]}): the store changed under the dataset; rebuild it"
            )
    return {
        "samples_in": counts["rows"],
        "rows": counts["rows"],
        "regenerated_turns": counts["turns"],
        "rows_with_reasoning": counts["with_reasoning"],
        "rows_with_tool_calls": counts["with_tool_calls"],  # the target's calls, read by export.tool_call_parser
        "tool_calls": counts["tool_calls"],
    }


# -- what it says ----------------------------------------------------------------------------------
def warnings(manifest: dict[str, Any]) -> list[str]:
    """What the trainer loses: said loudly in the log, the card and the build summary."""
    spec = manifest["export"]
    lines = []
    long = manifest.get("kept_longer_than_max_length", 0)
    lost = _share(manifest.get("trainer_cuts_loss_tokens", 0), manifest.get("loss_tokens", 0))
    if long and spec["long"] == "warn":
        lines.append(
            f"{manifest['dataset']}: {long} of the {manifest['rows']} rows are longer than max_length "
            f"{spec['max_length']}; the trainer cuts them and loses {manifest['trainer_cuts_loss_tokens']} of "
            f"{manifest['loss_tokens']} loss tokens ({lost}). "
            f"Set export.{spec['format']}.long to cut, drop or split to decide here"
        )
    dropped = manifest.get("dropped") or {}
    if dropped:
        reasons = ", ".join(f"{n} {why}" for why, n in dropped.items())
        left_out = sum(dropped.values())
        lines.append(
            f"{manifest['dataset']}: {left_out} sample{'s' * (left_out != 1)} left out ({reasons}), "
            f"{manifest['dropped_loss_tokens']} loss tokens, as the trainer's loader would leave them out"
        )
    return lines


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0%"


def summary(manifest: dict[str, Any], where: Path) -> str:
    rows, fmt = manifest["rows"], manifest["format"]
    if fmt == "conversations":
        parser = manifest["export"].get("tool_call_parser")
        calls = f", {manifest['tool_calls']} tool calls read by {parser}" if parser else ""
        return f"export {fmt}: {where} ({rows} conversations, {manifest['regenerated_turns']} regenerated turns{calls})"
    limit = manifest["export"]["max_length"]
    window = f", max_length {limit} ({manifest['export']['long']})" if limit else ""
    tokens = f"{manifest['tokens']} tokens, {manifest['loss_tokens']} loss tokens"
    return f"export {fmt}: {where} ({rows} rows, {tokens}{window})"


def card(manifest: dict[str, Any]) -> str:
    fmt, spec = manifest["format"], manifest["export"]
    lines = [f"# {manifest['dataset']}", "", f"The `{fmt}` export of `{manifest['exported_from']}` (dflash-build).", ""]
    lines += [f"- files: {len(manifest['files'])} JSONL in `{DATA_DIR}/`, {manifest['rows']} rows"]
    if fmt == "conversations":
        lines += [
            f"- regenerated turns: {manifest['regenerated_turns']}; "
            f"rows with reasoning: {manifest['rows_with_reasoning']}",
            f"- reasoning markers: `{spec['think'][0]}` … `{spec['think'][1]}` → `reasoning_content`",
            f"- tool calls: {manifest['tool_calls']} in {manifest['rows_with_tool_calls']} rows, read by "
            f"`{spec['tool_call_parser']}` into `tool_calls`"
            if spec.get("tool_call_parser")
            else "- tool calls: left in the text (model.tool_call_parser is not set)",
        ]
    else:
        lines += [
            f"- tokens: {manifest['tokens']}, loss tokens: {manifest['loss_tokens']} of {manifest['loss_tokens_in']}",
            f"- max_length: {spec['max_length']} (long samples: {spec['long']}); longer samples: "
            f"{manifest['longer_than_max_length']}",
            f"- filters: min_loss_tokens {spec['min_loss_tokens']}, two adjacent loss tokens: {spec['consecutive']}",
        ]
    lines += [f"- warning: {line}" for line in warnings(manifest)]
    lines += ["", f"export key `{manifest['export_key']}`, scheme {manifest['scheme']}", ""]
    return "\n".join(lines)
