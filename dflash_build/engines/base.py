"""What every engine backend shares: requests, results, the Engine protocol, and their errors."""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from dflash_build.spec import LoopRule, Sampling


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks an engine for. A source's settings are :class:`~dflash_build.spec.Sampling`
    (with the seed each row's seed derives from, and samples per prompt); :meth:`of` is the one mapping."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int

    @classmethod
    def of(cls, sampling: Sampling) -> SamplingParams:
        return cls(**{f.name: getattr(sampling, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Request:
    prompt_id: str
    sample_idx: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    # stop the row when this loop rule fires (finish reason loop): backends whose descriptor says stops_loops
    stop_loops: LoopRule | None = None


@dataclass(frozen=True)
class Acceptance:
    """One request's speculative decoding as its engine counted it: verify steps, draft tokens proposed
    and accepted, and the steps by how many drafted tokens each accepted (``histogram[i]``: steps that
    accepted exactly i; absent where the engine does not report it). Each step also yields the target's
    own (bonus) token, so the tokens per step are ``1 + accepted / steps``."""

    steps: int
    drafted: int
    accepted: int
    histogram: tuple[int, ...] = ()
    # each verify step's accepted and drafted counts in order, where the engine reports them (vLLM's
    # per_request_spec_decode_metrics detailed); empty otherwise
    accepted_steps: tuple[int, ...] = ()
    drafted_steps: tuple[int, ...] = ()

    @property
    def per_position(self) -> tuple[int, ...]:
        return tuple(per_position(self.histogram))

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "histogram": list(self.histogram),
            "accepted_steps": list(self.accepted_steps),
            "drafted_steps": list(self.drafted_steps),
        }

    @classmethod
    def of(cls, d: Mapping[str, Any] | None) -> Acceptance | None:
        if not d:
            return None
        lists = {k: tuple(int(n) for n in d.get(k) or ()) for k in ("histogram", "accepted_steps", "drafted_steps")}
        return cls(int(d["steps"]), int(d["drafted"]), int(d["accepted"]), **lists)

    def marks(self, n_tokens: int) -> list[int] | None:
        """Each of an answer's first ``n_tokens`` tokens (its stop token included) as the verify steps made
        it: ``MARK_ACCEPTED`` a draft token the target accepted, ``MARK_REJECTED`` the target's own token
        where it turned the draft down (the drafter's error), ``MARK_NONE`` no draft judged it (the first
        token, from the prompt's prefill; a step's bonus token after all its drafts passed). None where the
        steps cannot be placed: no per-step counts, or fewer tokens from drafted steps than the answer has
        (a step that proposed nothing, as ngram's without a match, is not reported, so the rest would slip)."""
        if not self.accepted_steps or len(self.accepted_steps) != len(self.drafted_steps):
            return None
        out = [MARK_NONE]
        for accepted, drafted in zip(self.accepted_steps, self.drafted_steps, strict=True):
            if len(out) >= n_tokens:  # a step after the answer's end: these counts are not this answer's
                return None
            out += [MARK_ACCEPTED] * accepted + [MARK_REJECTED if accepted < drafted else MARK_NONE]
        # the last step may run past the answer's end (a stop token among its accepted drafts, the budget)
        return out[:n_tokens] if len(out) >= n_tokens else None


MARK_ACCEPTED, MARK_REJECTED, MARK_NONE = 1, 0, -1


def tau(steps: int, accepted: int) -> float | None:
    """Tokens per verify step, the target's own (bonus) token included; None without a step."""
    return 1 + accepted / steps if steps else None


def tau_figures(
    steps: int, drafted: int, accepted: int, per_request: tuple[float, int], per_position_steps: list[int]
) -> dict[str, Any]:
    """A group of requests' figures from their summed counts: τ per token (its steps summed), τ per request
    (``per_request``: the sum and number of the requests' own τ, those with a step), the acceptance rate, and
    per draft position the steps that accepted it and their share."""
    total, counted = per_request
    per_token = tau(steps, accepted)
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "tau": None if per_token is None else round(per_token, 4),
        "tau_per_request": round(total / counted, 4) if counted else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "per_position_steps": per_position_steps,
        "per_position": [round(n / steps, 4) for n in per_position_steps] if steps else [],
    }


def per_position(histogram: Sequence[int]) -> list[int]:
    """Steps that accepted draft position i (0-based), from a histogram of steps by drafts accepted: those
    that accepted more than i tokens."""
    return [sum(histogram[i + 1 :]) for i in range(len(histogram) - 1)]


def summed_histogram(histograms: Iterable[Iterable[int]]) -> list[int]:
    """Histograms of steps by drafts accepted, added index by index (a shorter one counts 0 beyond its end)."""
    out: list[int] = []
    for h in histograms:
        for i, n in enumerate(h):
            out += [0] * (i + 1 - len(out))
            out[i] += int(n)
    return out


@dataclass(frozen=True)
class Result:
    prompt_id: str
    sample_idx: int
    output_ids: list[int]  # without the stop token
    finish_reason: str  # stop | length | loop | abort | error
    stop_token_id: int | None = None
    error: str | None = None
    # Set by backends that only get text back: output_ids then come from re-tokenizing it, and the
    # server's own token count tells whether that drifted.
    retokenized: bool = False
    engine_output_tokens: int | None = None
    acceptance: Acceptance | None = None  # a speculative server's own count for this request


class EngineFailed(RuntimeError):
    """The engine itself failed (not one request): the job fails, its journal stays."""


class EngineStalled(EngineFailed):
    """The engine held requests and made no progress for ``engine.stall_timeout``."""


class EngineDied(EngineFailed):
    """A served engine exited on an error of its own (its log's last exception, quoted in the message,
    which states the whole story): the same requests would fail the same way, so it is not replaced."""


class Engine(Protocol):
    """What a backend implements."""

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Yield one result per request, in any order, as each finishes.

        After :meth:`interrupt`, stop taking requests and return soon; the requests cut short are not
        yielded (the next run generates them).
        """
        ...

    def interrupt(self) -> None:
        """Make a running :meth:`generate` return soon. Called from a signal handler in the main
        thread: sets flags and schedules work, never blocks."""
        ...

    def close(self) -> None:
        """Release the engine (GPU memory, worker processes)."""
        ...

    # Optional: ``steps``, a count of the engine's decoding steps so far. An in-process engine that has it
    # is stopped when it stays unchanged for engine.stall_timeout while requests are in flight.


def position_seed(row_seed: int, position: int) -> int:
    """The seed of one sampled position: (row seed, absolute position in the sequence), 63 bits.

    Keyed by position like SGLang's seeded sampler (hash of seed and position), so an answer continued
    from its own prefix samples the same tokens as the answer generated in one go.
    """
    digest = hashlib.blake2b(f"{row_seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def closest(name: str, known: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the nearest known names, or nothing."""
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
