"""One generation job's shard and its rows: where it reads and writes, the conversations it holds, and
how a turn's result becomes a journal row and a completion row."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.engines import Result, SamplingParams
from dflash_build.engines.base import Acceptance, summed_histogram
from dflash_build.engines.registry import loop_stop
from dflash_build.plan import Plan
from dflash_build.spec import LoopRule, SourceSpec
from dflash_build.stages.common import chat, degenerate
from dflash_build.stages.common.job import Job
from dflash_build.stages.generate.conversation import Conversation, Renderer, Turn
from dflash_build.store import records as R

# Row seeds are 31-bit, so every engine takes them as they are: SGLang 0.5.5 built its seed tensor as
# int32 (a larger seed overflowed and killed the engine), llama.cpp's server keeps a uint32 and vLLM,
# SGLang 0.5.23 and the transformers backend take anything up to int64.
SEED_BITS = 31


def row_seed(base_seed: int, prompt_id: str, sample_idx: int, turn: int = 0, attempt: int = 0) -> int:
    """The seed of one (prompt, sample, turn), and of a degenerate row's next ``attempt``: independent of
    batch, shard and order; in [0, 2**31)."""
    parts: dict[str, Any] = {"seed": base_seed, "prompt_id": prompt_id, "sample_idx": sample_idx}
    if turn:
        parts["turn"] = turn
    if attempt:
        parts["attempt"] = attempt
    return int(hashing.digest(parts)[:16], 16) >> (64 - SEED_BITS)


def fits_context(prompt_tokens: int, max_new_tokens: int, context: int | None) -> bool:
    """Whether a prompt leaves room for ``max_new_tokens`` in the context: SGLang's own rule (it refuses
    ``prompt + max_new_tokens > context``), applied before any engine call so no backend sees a refusal."""
    return context is None or prompt_tokens + max_new_tokens <= context


def journal_row(conv: Conversation, turn: Turn) -> dict[str, Any]:
    return {
        "prompt_id": conv.prompt_id,
        "sample_idx": conv.sample_idx,
        "turn": len(conv.turns) - 1,
        "output_ids": turn.output_ids,
        "finish_reason": turn.finish_reason,
        "stop_token_id": turn.stop_token_id,
        "error": turn.error,
        "retokenized": turn.retokenized,
        "drifted": turn.drifted,
        "reused_from": turn.reused_from,
        "continued": turn.continued,
        "across": turn.across,
        "attempt": conv.attempt,
        "acceptance": turn.acceptance.as_dict() if turn.acceptance is not None else None,
        "at": round(time.time(), 1),  # when it finished: `dflash-build status` reads rates from it
    }


@dataclass(frozen=True)
class ShardPaths:
    """Where one generation job reads and writes: its prompt shard and outputs, and its journal."""

    prompts: Path
    data: Path
    stats: Path
    journal: Path  # a folder, never a Snakemake output: it survives failed and killed jobs

    @classmethod
    def of(cls, job: Job) -> ShardPaths:
        assert job.source is not None and job.shard is not None
        journal = job.plan.journal_dir(job.source, job.shard)
        return cls(job.prompt_shard(), job.output("data"), job.output("stats"), journal)


@dataclass
class ShardWork:
    """One shard's conversations and everything needed to render and account for them."""

    plan: Plan
    source: str
    shard: str
    paths: ShardPaths
    tokenizer: Any
    renderer: Renderer
    context: int | None
    params: SamplingParams
    convs: dict[tuple[str, int], Conversation]

    @property
    def spec(self) -> SourceSpec:
        return self.plan.sources[self.source].spec

    @property
    def label(self) -> str:
        return f"{self.source}/{self.shard}"

    def pending(self) -> list[Conversation]:
        return [c for c in self.convs.values() if c.finish_reason is None]

    @functools.cached_property
    def stop_ids(self) -> list[int]:
        """The token ids the engine stops on: the target's end of turn and its generation config's."""
        return chat.stop_token_ids(self.tokenizer, self.plan.config.model.path)

    @functools.cached_property
    def regenerating(self) -> bool:
        return self.plan.config.degenerate.regenerating() is not None

    @functools.cached_property
    def detector(self) -> degenerate.Detector:
        return degenerate.Detector.for_tokenizer(self.plan.config.degenerate, self.tokenizer)

    def retry(self, conv: Conversation) -> str | None:
        """Under a degenerate policy regenerate, ask a finished one-turn row again with the next attempt's
        seed when its answer is degenerate for a reason of that policy and attempts are left: the row is
        pending again, and the reason is returned (else None). Conversations of several turns are judged
        by tokenize alone."""
        policy = self.plan.config.degenerate
        if not self.regenerating or len(conv.slots) != 1 or len(conv.turns) != 1 or conv.attempt >= policy.retries:
            return None
        turn = conv.turns[0]
        why = self.detector.reason(turn.context_ids, turn.output_ids, turn.finish_reason)
        if why is None or policy.policy(why) != "regenerate":
            return None
        conv.attempt += 1
        conv.turns.clear()
        conv.prefix, conv.prefix_from, conv.prefix_across = [], None, False
        conv.finish_reason = conv.error = None
        return why

    @functools.cached_property
    def stop_loops(self) -> LoopRule | None:
        """The loop rule the engine stops rows on (plan.loop_stop), sent with every request."""
        return loop_stop(self.plan.config.engine, self.plan.config.degenerate)

    def budget(self, prompt_tokens: int) -> int:
        """New tokens an answer after ``prompt_tokens`` may have (the window's rule: TrainerSpec.budget)."""
        return self.plan.config.trainer.budget(self.spec.sampling.max_new_tokens, prompt_tokens)

    def apply(self, conv: Conversation, context_ids: list[int], result: Result) -> Turn:
        """Record one answer (:func:`apply_result`); a tool conversation whose calls are not the dataset's
        ends after it (:meth:`Renderer.end_on_mismatch`)."""
        turn = apply_result(conv, context_ids, result, self.renderer.source_history)
        self.renderer.end_on_mismatch(conv)
        return turn

    def ran_out(self, budget: int) -> str:
        """How an answer that used up ``budget`` ended: at the trainer's window when the window made the
        budget shorter than max_new_tokens, else truncated."""
        return R.FINISH_WINDOW if budget < self.spec.sampling.max_new_tokens else R.FINISH_LENGTH


@dataclass
class EngineRun:
    """What the engine did in this run: rows journaled and tokens it produced."""

    journaled: int = 0
    engine_tokens: int = 0
    in_flight: int = 0  # requests sent in this round and not answered yet (the heartbeat reads it)
    regenerated: int = 0  # degenerate answers asked again (a degenerate policy regenerate)
    engine_identity: Any = None  # what the engine says it serves (openai backend: per server), for the sidecar


def result_of(row: dict[str, Any]) -> Result:
    return Result(
        row["prompt_id"],
        row["sample_idx"],
        row["output_ids"],
        row["finish_reason"],
        row["stop_token_id"],
        row["error"],
        retokenized=row.get("retokenized", False),
        # a journaled drift is replayed as a count that cannot match
        engine_output_tokens=-1 if row.get("drifted") else None,
        acceptance=Acceptance.of(row.get("acceptance")),
    )


def apply_result(conv: Conversation, context_ids: list[int], result: Result, source_history: bool = False) -> Turn:
    """Record one answer; the conversation ends unless it stopped cleanly and has more slots (or, under
    history: source, whose later turns do not follow it, ran out of its budget)."""
    drifted = result.engine_output_tokens is not None and result.engine_output_tokens != len(result.output_ids)
    turn = Turn(
        context_ids,
        list(result.output_ids),
        result.finish_reason,
        result.stop_token_id,
        result.error,
        result.retokenized,
        result.retokenized and drifted,
        acceptance=result.acceptance,
    )
    turn.history_retokenized = conv.per_turn and bool(conv.turns)
    conv.turns.append(turn)
    goes_on = result.finish_reason == R.FINISH_STOP or (source_history and result.finish_reason in R.RAN_OUT)
    if not goes_on:
        conv.finish(result.finish_reason, result.error)
    elif len(conv.turns) == len(conv.slots):
        conv.finish(result.finish_reason)
    return turn


def completion_row(conv: Conversation, renderer: Renderer, base_seed: int) -> dict[str, Any]:
    turns = conv.turns
    first = turns[0] if turns else None
    last = turns[-1] if turns else None
    multi = len(conv.slots) > 1
    return {
        "prompt_id": conv.prompt_id,
        "sample_idx": conv.sample_idx,
        "seed": row_seed(base_seed, conv.prompt_id, conv.sample_idx, attempt=conv.attempt),
        "prompt_ids": first.context_ids if first else [],
        "output_ids": last.output_ids if last else [],
        "stop_token_id": last.stop_token_id if last and conv.finish_reason == R.FINISH_STOP else None,
        "text": renderer.decode(last.output_ids) if last else "",
        "finish_reason": conv.finish_reason,
        "error": conv.error,
        "n_prompt_tokens": len(first.context_ids) if first else 0,
        "n_output_tokens": sum(len(t.output_ids) for t in turns),
        "reused_from": first.reused_from if first else None,
        "continued": bool(first and first.continued),
        "per_turn": conv.per_turn if multi else None,
        "acceptance": row_acceptance(turns),
        "turns": [
            {
                "context_ids": t.context_ids,
                "output_ids": t.output_ids,
                "stop_token_id": t.stop_token_id,
                "finish_reason": t.finish_reason,
                "text": renderer.decode(t.output_ids),
                "history_retokenized": t.history_retokenized,
                "acceptance": t.acceptance.as_dict() if t.acceptance is not None else None,
            }
            for t in turns
        ]
        if multi
        else None,
    }


def row_acceptance(turns: list[Turn]) -> dict[str, Any] | None:
    """A row's acceptance: its one turn's counts (with the per-step counts), or the sums over turns (the
    steps are in each turn's own); None unless every turn was measured."""
    if not turns or any(t.acceptance is None for t in turns):
        return None
    if len(turns) == 1:
        return turns[0].acceptance.as_dict()  # type: ignore[union-attr]
    measured = [t.acceptance for t in turns if t.acceptance is not None]
    steps, drafted, accepted = (sum(getattr(a, f) for a in measured) for f in ("steps", "drafted", "accepted"))
    return Acceptance(steps, drafted, accepted, tuple(summed_histogram(a.histogram for a in measured))).as_dict()
