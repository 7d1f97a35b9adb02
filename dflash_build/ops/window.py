"""Which turns the trainer's window leaves out, counted before any GPU time (``plan``).

A prompt that leaves fewer than ``trainer.min_new_tokens`` of ``trainer.max_length`` is skipped (turn
0) or ends its conversation (a later turn): a selection, never a failure. Each prepared prompt is
rendered by the chat template at each of its answer slots, as generate renders it, and counted at the
first turn position the window leaves out. Under ``history: source`` (and for turn 0) that prompt is
exact; under ``history: regenerated`` a later turn's history holds the target's answers, not written
yet, so the count is a lower bound: rendered with the dataset's answer slots empty.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from dflash_build.plan import Plan
from dflash_build.stages.common import chat
from dflash_build.store import records as R

log = logging.getLogger(__name__)
SAMPLE_PROMPTS = 2000  # prompts rendered per source, from its first shards (scaled to the source's rows)


@dataclass
class TurnWindow:
    """One source's prompts outside the window, by the turn position where each first is."""

    source: str
    sampled: int = 0  # prompts rendered
    rows: int = 0  # the source's prepared prompts
    outside: dict[int, int] = field(default_factory=dict)  # turn position -> prompts, in the sample
    lower_bound: bool = False  # later turns of regenerated history: at least this many

    def scaled(self, turn: int) -> float:
        return self.outside.get(turn, 0) * self.rows / self.sampled if self.sampled else 0.0

    def line(self) -> str:
        where = ", ".join(
            f"turn {k}: {self.scaled(k):.0f}{'+' if self.lower_bound and k else ''}" for k in sorted(self.outside)
        )
        sample = "" if self.sampled == self.rows else f", from {self.sampled} of them"
        return f"{self.source} {where or 'none'} of {self.rows} prompts{sample}"


def turn_window(plan: Plan, source: str, tokenizer: Any, limit: int = SAMPLE_PROMPTS) -> TurnWindow | None:
    """``source``'s prompts the window leaves out, by turn position; None before it is prepared."""
    sp, trainer = plan.sources[source], plan.config.trainer
    manifest = plan.prompt_manifest(source)
    if trainer.max_length is None or not manifest.exists():
        return None
    counted = TurnWindow(source, rows=json.loads(manifest.read_text())[R.PROMPTS_ROWS_OUT])
    counted.lower_bound = sp.spec.turns == "all" and sp.spec.history == "regenerated"
    kwargs = dict(sp.gen_components["chat_template_kwargs"])
    for shard in plan.prompt_shards(source):
        if counted.sampled >= limit or not shard.exists():
            break
        for p in pq.read_table(shard).to_pylist()[: limit - counted.sampled]:
            counted.sampled += 1
            messages = json.loads(p["messages"])
            tools = json.loads(p["tools"]) if p["tools"] else None
            row_kwargs = {**kwargs, **json.loads(p.get("template_kwargs") or "{}")}
            for turn, slot in enumerate(chat.answer_slots(messages, sp.spec.turns)):
                try:
                    prompt = chat.render(tokenizer, messages[:slot], tools, row_kwargs)
                except Exception:  # the template refuses it: generate's error row, not the window's
                    break
                if trainer.leaves_too_little(trainer.budget(sp.spec.sampling.max_new_tokens, len(prompt))):
                    counted.outside[turn] = counted.outside.get(turn, 0) + 1
                    break  # a skipped prompt, or a conversation that ends here: no later turn
    return counted


def turn_windows(plan: Plan) -> list[TurnWindow]:
    """Every prepared source's prompts outside the window (empty without ``trainer.max_length``)."""
    if plan.config.trainer.max_length is None or not any(plan.prompt_manifest(s).exists() for s in plan.sources):
        return []
    try:
        tokenizer = chat.load_tokenizer(plan.config.model, plan.tokenizer_cache())
    except Exception as e:  # inspection goes on: the model may not be on this machine yet
        log.warning("the prompts outside trainer.max_length are not counted: the tokenizer did not load (%s)", e)
        return []
    found = [turn_window(plan, name, tokenizer) for name in plan.sources]
    return [w for w in found if w is not None]
