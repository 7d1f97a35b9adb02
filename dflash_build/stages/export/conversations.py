"""``conversations``: ``{id, conversations: [{role, content, reasoning_content?}], tools}``, the source's
messages with every regenerated answer as text (its reasoning, between the template's think markers, in
``reasoning_content``; with ``model.tool_call_parser`` its calls as structured ``tool_calls``), for
trainers that render and mask themselves. It reads each source's prompt and completion shards, and writes
only the answers the dataset trains on (:func:`trained_answers`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import takewhile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_build import toolcalls
from dflash_build.spec import ExportSpec, SourceSpec
from dflash_build.stages.common.chat import answer_slots
from dflash_build.stages.export.formats import ExportFormat, Written
from dflash_build.stages.export.jsonl import JsonlShards, sample_id, samples


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


def trained_answers(done: dict[str, Any], trained: set[int | None], on_history: bool) -> list[tuple[int, str]]:
    """(turn, text) of each answer of a completion row that the export writes: those the dataset trains on.

    ``trained``: the dataset's samples of the row by turn; {None} for a row that is one sample, trained on
    whole. A row whose turns are samples of their own has only some in the dataset when tokenize dropped
    a turn (degenerate, truncated) or the mix took some: on the dataset's history (``history: source``)
    each turn stands alone, so the export writes those turns. On the regenerated history the conversation
    ends before the first turn the dataset leaves out, as one that ended early does: every later answer
    was asked on that one, and a trainer of this format trains on every answer a conversation holds, so
    keeping them would train on the answer the dataset dropped.
    """
    answers = [t["text"] for t in done["turns"]] if done["turns"] else [done["text"]]
    if None in trained:
        return list(enumerate(answers))
    if on_history:
        return [(k, answer) for k, answer in enumerate(answers) if k in trained]
    return list(takewhile(lambda turn: turn[0] in trained, enumerate(answers)))


def _records(
    messages: list[dict[str, Any]],
    done: dict[str, Any],
    answers: list[tuple[int, str]],
    tools: toolcalls.Tools,
    spec: ExportSpec,
    on_history: bool,
    variant: str | None = None,
) -> list[tuple[str, list[dict[str, Any]]]]:
    """A completion row's export records of ``answers`` (:func:`trained_answers`), (id, conversation): its
    conversation (none without an answer), or under ``history: source`` each turn on the history it was
    asked on."""
    key = (done["prompt_id"], done["sample_idx"])
    parser = spec.tool_call_parser
    if on_history:
        return [
            (sample_id(*key, k, variant), turn_on_history(messages, k, answer, spec.think, parser, tools))
            for k, answer in answers
        ]
    if not answers:
        return []
    texts = [answer for _, answer in answers]
    return [(sample_id(*key, variant=variant), conversation(messages, texts, spec.think, parser, tools))]


def _trained(files: Sequence[Path]) -> dict[str, dict[tuple[str, int], set[int | None]]]:
    """Each source's rows in the dataset, each with its samples' turns (None: the row is one sample)."""
    wanted: dict[str, dict[tuple[str, int], set[int | None]]] = {}
    for row in samples(files, ["source", "prompt_id", "sample_idx", "turn"]):
        key = (row["prompt_id"], row["sample_idx"])
        wanted.setdefault(row["source"], {}).setdefault(key, set()).add(row["turn"])
    return wanted


def _conversations(
    files: Sequence[Path],
    stores: Mapping[str, list[tuple[Path, Path]]],
    spec: ExportSpec,
    out: JsonlShards,
    sources: Mapping[str, SourceSpec],
) -> dict[str, Any]:
    """Shard by shard of each source's prompts and completions (memory holds one shard), the rows of the
    dataset they hold: a conversation each, or, for a ``history: source`` source, each turn on the
    history it was asked on; a sampling variant's ids end with it. Only answers the dataset trains on
    are written (:func:`trained_answers`)."""
    wanted = _trained(files)
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
                trained = todo.pop(key)
                prompt = prompts[done["prompt_id"]]
                tools = json.loads(prompt["tools"]) if prompt["tools"] else None
                on_history = sources[source].history == "source" and bool(done["turns"])
                variant = sources[source].variant
                answers = trained_answers(done, trained, on_history)
                records = _records(json.loads(prompt["messages"]), done, answers, tools, spec, on_history, variant)
                counts["turns"] += len(answers)
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


def summary(manifest: dict[str, Any], where: Path) -> str:
    rows, fmt = manifest["rows"], manifest["format"]
    parser = manifest["export"].get("tool_call_parser")
    calls = f", {manifest['tool_calls']} tool calls read by {parser}" if parser else ""
    return f"export {fmt}: {where} ({rows} conversations, {manifest['regenerated_turns']} regenerated turns{calls})"


def card(manifest: dict[str, Any]) -> list[str]:
    spec = manifest["export"]
    return [
        f"- regenerated turns: {manifest['regenerated_turns']}; rows with reasoning: {manifest['rows_with_reasoning']}",
        f"- reasoning markers: `{spec['think'][0]}` … `{spec['think'][1]}` → `reasoning_content`",
        f"- tool calls: {manifest['tool_calls']} in {manifest['rows_with_tool_calls']} rows, read by "
        f"`{spec['tool_call_parser']}` into `tool_calls`"
        if spec.get("tool_call_parser")
        else "- tool calls: left in the text (model.tool_call_parser is not set)",
    ]


def write(job: Written) -> dict[str, Any]:
    return _conversations(job.files, job.stores, job.spec, job.out, job.sources)


FORMAT = ExportFormat("conversations", write, summary, card, reads_store=True)
