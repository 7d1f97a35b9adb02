"""The conversation model of a generate job: each (prompt, sample) as its turns so far, and the
renderer that gives each next turn's prompt ids (see the package docstring for the two sample forms)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_build import toolcalls
from dflash_build.engines.base import Acceptance
from dflash_build.stages.common import chat
from dflash_build.store import records as R


@dataclass
class Turn:
    context_ids: list[int]  # ids added before this turn's answer (the whole prompt for turn 0)
    output_ids: list[int]
    finish_reason: str
    stop_token_id: int | None = None
    error: str | None = None
    retokenized: bool = False
    drifted: bool = False  # re-tokenized length differs from the server's own count
    reused_from: str | None = None  # "gen_key/shard" of the completion this row was taken from
    continued: bool = False  # the engine extended the reused (truncated) answer
    across: bool = False  # reused from a generation under other settings (template, prepare, scheme)
    history_retokenized: bool = False  # the prompt holds earlier answers as text the template wrote
    tool_calls: str | None = None  # a tool conversation's turn: "matched" the dataset's calls, or "mismatched"
    acceptance: Acceptance | None = None  # what a speculative engine counted of this answer (engine.drafter)

    @property
    def generated_ids(self) -> list[int]:
        return self.output_ids + ([self.stop_token_id] if self.stop_token_id is not None else [])


@dataclass
class Conversation:
    prompt_id: str
    sample_idx: int
    messages: list[dict[str, Any]]  # for turns=all: with the source's assistant turns as slots
    tools: list[dict[str, Any]] | None
    slots: list[int]  # message index of each assistant answer to generate
    turns: list[Turn] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # an earlier truncated answer to continue
    prefix_from: str | None = None
    prefix_across: bool = False  # the prefix comes from a generation under other settings
    finish_reason: str | None = None  # set when the conversation is finished
    error: str | None = None
    template_kwargs: dict[str, Any] | None = None  # this row's own (chat_template_kwargs_from)
    per_turn: bool = False  # each turn is a sample; its context_ids are its whole prompt
    attempt: int = 0  # degenerate policy regenerate: which attempt's seed its answer comes from

    @property
    def key(self) -> tuple[str, int]:
        return self.prompt_id, self.sample_idx

    @property
    def all_ids(self) -> list[int]:
        """The sequence so far (one-sequence form): every turn's context, answer and stop token."""
        ids: list[int] = []
        for t in self.turns:
            ids += t.context_ids + t.generated_ids
        return ids

    def split_turns(self) -> None:
        """Make each turn a sample of its own: its context becomes the whole prompt the engine saw."""
        prompt: list[int] = []
        for t in self.turns:
            t.context_ids = prompt = prompt + t.context_ids
            prompt = prompt + t.generated_ids
        self.per_turn = True

    def request_ids(self, context_ids: list[int]) -> list[int]:
        """The engine's prompt for the next turn, whose new context is ``context_ids``."""
        return context_ids if self.per_turn else self.all_ids + context_ids

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error = reason, error


class HistoryRewritten(ValueError):
    """The template does not write a conversation's history as a prefix of its next prompt."""


class Renderer:
    """Prompt ids for each turn of a conversation, never re-tokenizing generated ids but the history
    text a template rewrites (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any],
        turn_samples: str = "auto",
        tool_call_parser: str | None = None,
        tool_match: str = "arguments",
        history: str = "regenerated",
    ) -> None:
        self.tokenizer, self.kwargs, self.turn_samples = tokenizer, template_kwargs, turn_samples
        self.parser, self.tool_match = tool_call_parser, tool_match
        self.source_history = history == "source"  # later turns follow the dataset's answers (spec.HISTORIES)

    def reads_calls(self, conv: Conversation) -> bool:
        """Whether this conversation's answers are read for tool calls (a parser, and tools declared)."""
        return self.parser is not None and bool(conv.tools)

    def answer_message(self, conv: Conversation, turn: Turn) -> dict[str, Any]:
        """A regenerated answer as the next prompt's history holds it: its text, or, in a tool
        conversation, what a server hands the agent: the text before its calls and the calls, structured
        (the template writes them as it writes calls)."""
        text = self.decode(turn.output_ids)
        if self.parser is None or not self.reads_calls(conv):
            return {"role": "assistant", "content": text}
        content, parsed = toolcalls.read_answer(self.parser, text, conv.tools)
        calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def end_on_mismatch(self, conv: Conversation) -> None:
        """After a turn of a tool conversation with more to come: go on when its calls are the dataset's
        at that point (the dataset's results follow), else end the conversation after it (counted as
        tool_call_mismatch; the turn stays a sample)."""
        if self.parser is None or not self.reads_calls(conv) or conv.finish_reason is not None:
            return
        turn, slot = conv.turns[-1], conv.slots[len(conv.turns) - 1]
        theirs = conv.messages[slot].get("tool_calls") or [] if slot < len(conv.messages) else []
        _, parsed = toolcalls.read_answer(self.parser, self.decode(turn.output_ids), conv.tools)
        if toolcalls.same_calls(parsed.calls, theirs, self.tool_match):
            turn.tool_calls = "matched" if theirs else None
            return
        turn.tool_calls = "mismatched"
        if self.source_history:  # the next turn follows the dataset's calls whatever the target called
            return
        conv.finish(
            turn.finish_reason,
            f"{R.TOOL_CALL_MISMATCH}: turn {len(conv.turns) - 1} {toolcalls.call_difference(parsed.calls, theirs)} "
            f"(tool_match: {self.tool_match})",
        )

    def kwargs_of(self, conv: Conversation) -> dict[str, Any]:
        return {**self.kwargs, **(conv.template_kwargs or {})}

    def history(self, conv: Conversation) -> list[dict[str, Any]]:
        """The conversation up to the next answer, with earlier answers replaced by generated ones (under
        history: source, the dataset's own)."""
        slot = conv.slots[len(conv.turns)]
        messages = [dict(m) for m in conv.messages[:slot]]
        if self.source_history:
            return messages
        for turn, s in zip(conv.turns, conv.slots, strict=False):
            messages[s] = self.answer_message(conv, turn)
        return messages

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def next_context(self, conv: Conversation) -> list[int]:
        """Ids to add before the next answer (the whole prompt once turns are samples of their own).

        Under ``auto`` a conversation whose template rewrites its history becomes per-turn here (the
        same turn on every replay, as rendering is deterministic); under ``sequence`` that raises
        :class:`HistoryRewritten`.
        """
        history = self.history(conv)
        kwargs = self.kwargs_of(conv)
        text = chat.render_text(self.tokenizer, history, conv.tools, kwargs)
        if not conv.turns or conv.per_turn:
            return chat.encode(self.tokenizer, text)
        # What the template wrote up to the end of the last answer must be a prefix of the new render.
        seen = chat.render_text(self.tokenizer, history[: conv.slots[len(conv.turns) - 1]], conv.tools, kwargs)
        seen += self.decode(conv.turns[-1].generated_ids)
        if text.startswith(seen):
            return chat.encode(self.tokenizer, text[len(seen) :])
        if self.turn_samples == "sequence":
            raise HistoryRewritten(
                "chat template rewrites earlier turns (not prefix-stable); set turn_samples: auto or per_turn"
            )
        conv.split_turns()
        return chat.encode(self.tokenizer, text)
