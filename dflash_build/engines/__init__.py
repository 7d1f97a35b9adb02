"""Engines behind one small interface.

A backend takes requests (prompt token ids, sampling params, the row's own seed) and yields results as
they finish. The generation driver (``dflash_build.generate``) owns rendering, batching order,
accounting and publishing; a backend owns only the engine call. Backends import their engine library
inside their own module, so an optional engine is never needed to parse the workflow.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dflash_build.config import EngineSpec, ModelSpec
    from dflash_build.gpus import GpuLease


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int


@dataclass(frozen=True)
class Request:
    prompt_id: str
    sample_idx: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class Result:
    prompt_id: str
    sample_idx: int
    output_ids: list[int]  # without the stop token
    finish_reason: str  # stop | length | abort | error
    stop_token_id: int | None = None
    error: str | None = None
    # Set by backends that only get text back: output_ids then come from re-tokenizing it, and the
    # server's own token count tells whether that drifted.
    retokenized: bool = False
    engine_output_tokens: int | None = None


class EngineFailed(RuntimeError):
    """The engine itself failed (not one request): the job fails, its journal stays."""


class EngineStalled(EngineFailed):
    """The engine held requests and made no progress for ``engine.stall_timeout``."""


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


BACKENDS = ("transformers", "sglang", "openai", "llamacpp")


def position_seed(row_seed: int, position: int) -> int:
    """The seed of one sampled position: (row seed, absolute position in the sequence), 63 bits.

    Keyed by position like SGLang's seeded sampler (hash of seed and position), so an answer continued
    from its own prefix samples the same tokens as the answer generated in one go.
    """
    digest = hashlib.blake2b(f"{row_seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_options(backend: str, options: Mapping[str, Any]) -> None:
    """Refuse an engine option the backend does not know, naming the closest known one (at parse time:
    no engine library is imported, so a typo stops the run before any job)."""
    if backend == "sglang":
        from dflash_build.engines.sglang_backend import check_options as check_sglang

        check_sglang(options)
        return
    from dflash_build.config import ConfigError
    from dflash_build.keys import ENGINE_OPTIONS

    known = sorted(ENGINE_OPTIONS.get(backend, {}))
    for name in sorted(options):
        if name not in known:
            raise ConfigError(
                f"engine.options.{name}", f"the {backend} backend has no such option{closest(name, known)}"
            )


def closest(name: str, known: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the nearest known names, or nothing."""
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def uses_gpu(engine: EngineSpec) -> bool:
    """Whether a generation job is pinned to a GPU (the rule asks for ``gpu=1``, or ``gpu_jobs=1`` with
    shared engines, and the job takes a free GPU or a free place on one)."""
    if engine.backend in ("openai", "llamacpp"):
        return False  # the servers own their GPUs; llama.cpp runs on the CPU here
    if engine.backend == "sglang":
        return True
    return engine.gpus is not None or str(engine.options.get("device", "cpu")).startswith("cuda")


def load(
    engine: EngineSpec, model: ModelSpec, stop_token_ids: list[int], lease: GpuLease | None, tokenizer: Any = None
) -> Engine:
    """Start the configured backend; its library is imported here, never at parse time.

    ``tokenizer`` is the driver's (the openai backend needs it for text-only servers).
    """
    if engine.backend == "transformers":
        from dflash_build.engines.transformers_backend import TransformersEngine

        return TransformersEngine(model.path, engine.options, stop_token_ids, model.revision)
    if engine.backend == "sglang":
        from dflash_build.engines.sglang_backend import SGLangEngine

        return SGLangEngine(model, engine.options, stop_token_ids, lease)
    if engine.backend == "openai":
        from dflash_build.engines.openai_backend import OpenAIEngine

        return OpenAIEngine(engine.options, stop_token_ids, tokenizer, model.path, engine.stall_timeout)
    if engine.backend == "llamacpp":
        raise ValueError("the llamacpp backend runs as a server: dflash_build.engine_host starts it")
    raise ValueError(f"config key 'engine.backend': unknown backend '{engine.backend}' (known: {', '.join(BACKENDS)})")
