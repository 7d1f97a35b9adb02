"""The parity guard for ``engine.drafter`` (issue 79): a drafter must not change the target's answers.

Preflight sends the pilot's first-turn requests (``preflight.rows`` prompts of each source, their own seeds and
sampling, as the build asks them) to the engine serving the drafter and to the same engine without it, each a
server of its own, one after the other (two never share a GPU's memory). Then:

- **temperature 0**: the share of answers identical token for token, and where each differing pair first
  parts. The engine without the drafter answers its temperature-0 requests a second time, in reversed order
  (another batch): its agreement with itself is the nondeterminism the engine has of its own. The guard fails
  where the drafted share is below that agreement minus ``preflight.parity_allowance`` (default 0.125). Why an
  allowance at all: the drafted engine verifies k + 1 positions in one forward pass, another kernel shape than
  one-token decoding, so its logits differ in rounding; at a step whose top two logits are within that
  rounding the argmax can flip and the answers part there (late in an answer, and rarely at pilot lengths).
  One answer in eight, the default pilot's rows, may do that; a drafter that breaks the answers (lossy
  acceptance, a wrong vocabulary, an engine bug) changes most of them, mostly within their first tokens.
- **temperature > 0**: a drafter consumes the sampler's random numbers, so the same seed draws another answer;
  only the distributions compare. Each of the mean output length (Welch's difference over its standard error,
  at least one token), the share of every finish reason and the degenerate share (two proportions over their
  pooled standard error) must lie within :data:`SIGMAS` standard errors: a false alarm in about 1 of 370
  comparisons under the normal approximation, and loose at pilot sizes on purpose (the guard catches a
  drafter that changes what the target writes, not a shift of a few tokens).

The verdict is recorded in the preflight summary under the engine's identity (:func:`identity`); generate
refuses a drafter whose verdict failed or is not there for that identity (:func:`require`), unless
``preflight.skip_parity`` says to build anyway (a warning, and a line in the dataset's card).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from dflash_build import engines
from dflash_build.engines import Request, Result, gpus, registry
from dflash_build.engines import host as engine_host
from dflash_build.plan import Plan
from dflash_build.spec import EngineSpec
from dflash_build.stages import generate
from dflash_build.stages.common import chat, crosssource
from dflash_build.stages.generate.gate import identity, identity_key
from dflash_build.stages.generate.work import ShardPaths
from dflash_build.stages.preflight.checks import FAIL, Problem
from dflash_build.stages.registry import planned

log = logging.getLogger(__name__)

SIGMAS = 3.0  # how many standard errors a sampled figure may move with the drafter (temperature > 0)
SHOWN = 5  # differing positions a line names


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first token position where two answers differ (the shorter one's end where one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identical(drafted: Sequence[Sequence[int]], plain: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How many answers are identical, their share, and where each differing pair first parts."""
    parts = [first_difference(a, b) for a, b in zip(drafted, plain, strict=True)]
    differ = [p for p in parts if p is not None]
    n = len(parts)
    return {
        "answers": n,
        "identical": n - len(differ),
        "share": (n - len(differ)) / n if n else 1.0,
        "first_differ": differ,
    }


def greedy_problem(name: str, drafted: dict[str, Any], itself: dict[str, Any], allowance: float) -> str | None:
    """The temperature-0 line, or None where the drafted share is within the engine's own agreement."""
    bound = itself["share"] - allowance
    if drafted["share"] >= bound:
        return None
    where = ", ".join(str(p) for p in drafted["first_differ"][:SHOWN])
    more = ", ..." if len(drafted["first_differ"]) > SHOWN else ""
    return (
        f"{drafted['identical']} of {drafted['answers']} temperature-0 pilot answers are identical with and without "
        f"it ({drafted['share']:.0%}; the engine without it agrees with itself on {itself['share']:.0%}, less "
        f"preflight.parity_allowance {allowance:g}: at least {max(bound, 0):.0%}); they first differ at token "
        f"{where}{more}"
    )


def _proportion_z(a: int, b: int, n: int) -> float:
    """Two shares of ``n`` each over their pooled standard error (0 where both are 0 or both are n)."""
    pooled = (a + b) / (2 * n)
    se = math.sqrt(pooled * (1 - pooled) * 2 / n)
    return abs(a - b) / n / se if se else 0.0


@dataclasses.dataclass(frozen=True)
class Sample:
    """What the guard compares of sampled answers: their lengths, finish reasons and degenerate flags."""

    lengths: list[int]
    finishes: list[str]
    degenerate: list[bool]


def sampled_problem(drafted: Sample, plain: Sample) -> str | None:
    """The temperature > 0 line: each figure that moved more than SIGMAS standard errors, or None."""
    n = len(drafted.lengths)
    if n < 2 or n != len(plain.lengths):
        return None
    moved = []
    md, mp = sum(drafted.lengths) / n, sum(plain.lengths) / n
    var = lambda xs, m: sum((x - m) ** 2 for x in xs) / (n - 1)  # noqa: E731
    se = max(math.sqrt(var(drafted.lengths, md) / n + var(plain.lengths, mp) / n), 1.0)
    if abs(md - mp) / se > SIGMAS:
        moved.append(f"mean length {md:.1f} against {mp:.1f} tokens ({abs(md - mp) / se:.1f} standard errors)")
    fd, fp = Counter(drafted.finishes), Counter(plain.finishes)
    for reason in sorted(set(fd) | set(fp)):
        if _proportion_z(fd[reason], fp[reason], n) > SIGMAS:
            moved.append(f"finish reason {reason} {fd[reason]} against {fp[reason]} of {n}")
    dd, dp = sum(drafted.degenerate), sum(plain.degenerate)
    if _proportion_z(dd, dp, n) > SIGMAS:
        moved.append(f"degenerate {dd} against {dp} of {n}")
    if not moved:
        return None
    return f"its sampled pilot answers differ beyond {SIGMAS:g} standard errors: " + "; ".join(moved)


def judge(plan: Plan, figures: dict[str, Any]) -> list[Problem]:
    """One FAIL line naming the drafter where either comparison fails."""
    cfg = plan.config
    drafter = cfg.engine.drafter
    assert drafter is not None
    found = []
    if "temperature_0" in figures:
        t0 = figures["temperature_0"]
        found.append(greedy_problem(drafter.name, t0["drafted"], t0["itself"], cfg.preflight.parity_allowance))
    if "sampled" in figures:
        s = figures["sampled"]
        found.append(sampled_problem(Sample(**s["drafted_sample"]), Sample(**s["plain_sample"])))
    said = [line for line in found if line is not None]
    if not said:
        return []
    served = drafter.method + (f" {drafter.path}" if drafter.path else "")
    line = f"engine.drafter ({served}) changes the target's answers on {cfg.engine.backend}: " + "; ".join(said)
    line += (
        ": the rows would not be the target's; fix or remove engine.drafter (preflight.skip_parity: true builds anyway)"
    )
    return [Problem(FAIL, "parity", line)]


def guard(plan: Plan) -> tuple[dict[str, Any], list[Problem]]:
    """The pilot's requests with the drafter and without, compared; the verdict under the engine's identity."""
    requests, detectors = pilot_requests(plan)
    cfg = plan.config
    if not requests:  # every pilot prompt skipped (a copy, too long): nothing shows the drafter harmless
        line = (
            "engine.drafter: no pilot request to compare with and without it (each one skipped): raise preflight.rows"
        )
        return {"identity": identity(plan), "key": identity_key(plan), "requests": 0, "verdict": "FAIL"}, [
            Problem(FAIL, "parity", line)
        ]
    drafted_engine = dataclasses.replace(registry.for_generation(cfg.engine), shared=False, drafter=None)
    plain_engine = dataclasses.replace(cfg.engine, shared=False, drafter=None)
    greedy = [i for i, r in enumerate(requests) if r.params.temperature == 0]
    [drafted] = answers(plan, drafted_engine, [requests])
    plain, again = answers(plan, plain_engine, [requests, [requests[i] for i in reversed(greedy)]])
    figures: dict[str, Any] = {"identity": identity(plan), "key": identity_key(plan), "requests": len(requests)}
    if greedy:
        pick = lambda got, ids: [got[i].output_ids for i in ids]  # noqa: E731
        figures["temperature_0"] = {
            "drafted": identical(pick(drafted, greedy), pick(plain, greedy)),
            "itself": identical(pick(again, greedy), pick(plain, greedy)),
        }
    if sampled := [i for i in range(len(requests)) if i not in set(greedy)]:
        figures["sampled"] = {
            f"{side}_sample": dataclasses.asdict(_sample(got, requests, detectors, sampled))
            for side, got in (("drafted", drafted), ("plain", plain))
        }
    problems = judge(plan, figures)
    figures["verdict"] = "FAIL" if problems else "PASS"
    return figures, problems


def _sample(got: dict[int, Result], requests: list[Request], detectors: list[Any], ids: list[int]) -> Sample:
    return Sample(
        [len(got[i].output_ids) for i in ids],
        [got[i].finish_reason for i in ids],
        [detectors[i].reason(requests[i].prompt_ids, got[i].output_ids, got[i].finish_reason) is not None for i in ids],
    )


def pilot_requests(plan: Plan) -> tuple[list[Request], list[Any]]:
    """The first-turn requests of each source's pilot prompts, as its generate job builds them (numbered: two
    sources may share a prompt id), and each one's degenerate detector."""
    requests, detectors = [], []
    for source in sorted(plan.sources):
        shard = plan.sources[source].shards[0]
        job = planned(plan, "generate", source, shard)
        work = generate.open_shard(plan, source, shard, ShardPaths.of(job))
        for key in list(work.convs)[plan.config.preflight.rows :]:
            del work.convs[key]
        generate.skip_copies(work, crosssource.skipped_copies(job, sorted({c.prompt_id for c in work.convs.values()})))
        progress = generate.Progress(len(work.convs), 0, f"parity {source}")
        try:
            asked, _ = generate.next_requests(work, progress)
        finally:
            progress.close()
        for r in asked:
            requests.append(dataclasses.replace(r, prompt_id=str(len(requests)), sample_idx=0))
            detectors.append(work.detector)
    return requests, detectors


def answers(plan: Plan, engine: EngineSpec, rounds: list[list[Request]]) -> list[dict[int, Result]]:
    """Each round's results by request number, from one engine of its own (stopped at the end)."""
    cfg = plan.config
    tokenizer = chat.load_tokenizer(cfg.model, plan.tokenizer_cache())
    stop_ids = chat.stop_token_ids(tokenizer, cfg.model.path)
    out = []
    with gpus.pinned(engine) if engines.uses_gpu(engine) else contextlib.nullcontext() as lease:
        if engine_host.through_server(engine):
            context = chat.context_length(cfg.model)
            opened = engine_host.open_engine(cfg, stop_ids, lease, tokenizer, plan.model_fingerprint, context, engine)
        else:
            opened = engines.load(engine, cfg.model, stop_ids, lease, tokenizer)
        try:
            for requests in rounds:
                out.append({int(r.prompt_id): r for r in opened.generate(requests)} if requests else {})
        finally:
            opened.close()
    return out
