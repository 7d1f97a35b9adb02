"""Engines behind one small interface.

A backend takes requests (prompt token ids, sampling params, the row's own seed) and yields results as
they finish. The generation driver (``dflash_build.generate``) owns rendering, batching order,
accounting and publishing; a backend owns only the engine call. Backends import their engine library
inside their own module, so an optional engine is never needed to parse the workflow.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


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


class Engine(Protocol):
    """What a backend implements."""

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Yield one result per request, in any order, as each finishes."""
        ...

    def close(self) -> None:
        """Release the engine (GPU memory, worker processes)."""
        ...


BACKENDS = ("transformers",)


def uses_gpu(backend: str, options: Mapping[str, Any]) -> bool:
    """Whether a generation job of this backend holds a GPU (so the rule asks for ``gpu=1``)."""
    if backend == "transformers":
        return str(options.get("device", "cpu")).startswith("cuda")
    return True


def load(backend: str, model_path: str, options: Mapping[str, Any], stop_token_ids: list[int]) -> Engine:
    if backend == "transformers":
        from dflash_build.engines.transformers_backend import TransformersEngine

        return TransformersEngine(model_path, options, stop_token_ids)
    raise ValueError(f"config key 'engine.backend': unknown backend '{backend}' (known: {', '.join(BACKENDS)})")
