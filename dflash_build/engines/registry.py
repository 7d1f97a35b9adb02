"""Every backend, one descriptor each: what it is, how it loads, how a host serves it, how jobs talk to it.

A new backend is its module plus one entry in :data:`BACKENDS` (and its option decisions in
``keys.ENGINE_OPTIONS``, which ``tests/test_keys.py`` requires). Each descriptor imports its engine
library only inside its functions, so parsing the workflow never needs an optional engine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_build import hashing
from dflash_build.engines.base import Engine, closest
from dflash_build.engines.options import check_options as known_names
from dflash_build.spec import ConfigError

if TYPE_CHECKING:
    from dflash_build.engines.gpus import GpuLease
    from dflash_build.spec import EngineSpec, ModelSpec


@dataclass(frozen=True)
class Serve:
    """The command a host runs for one engine server: ``argv(model, options, stop_ids, port, context, lease)``."""

    argv: Callable[[ModelSpec, Mapping[str, Any], list[int], int, int | None, GpuLease | None], list[str]]
    health_path: str = "/health"
    api: str = "generate"  # the openai client's API for it (dflash_build.engines.openai_backend.APIS)
    concurrency: Callable[[Mapping[str, Any]], int] = lambda options: 2


@dataclass(frozen=True)
class Backend:
    name: str
    # In-process: load(engine, model, stop_ids, lease, tokenizer) -> Engine; None where it only runs served.
    load: Callable[[EngineSpec, ModelSpec, list[int], GpuLease | None, Any], Engine] | None
    serve: Serve | None  # how a host runs it as a server (engine.shared); None: it cannot be served
    uses_gpu: Callable[[EngineSpec], bool]  # whether its jobs take a GPU (rule resource gpu=1)
    always_through_server: bool = False  # no in-process engine: every job talks to a host's server
    remote: bool = False  # a client of servers over HTTP: their health check, not a step count, tells a stall
    conda_env: str = "generate"  # envs/NAME.yaml of its generate jobs
    check_options: Callable[[Mapping[str, Any]], None] | None = None  # beyond keys.ENGINE_OPTIONS' names


def check_options(backend: str, options: Mapping[str, Any]) -> None:
    """Refuse what the backend does not accept, before any job: its own check, else the option names
    its decisions list (keys.ENGINE_OPTIONS)."""
    own = get(backend).check_options
    if own is not None:
        own(options)
    else:
        known_names(backend, options)


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError("engine.backend", f"unknown backend '{name}'{closest(name, BACKENDS)}") from None


# -- transformers: the reference engine, in the job or as a server (dflash_build.engines.server) ------
def _transformers_load(
    engine: EngineSpec, model: ModelSpec, stop_ids: list[int], lease: GpuLease | None, tokenizer: Any
) -> Engine:
    from dflash_build.engines.transformers_backend import TransformersEngine

    return TransformersEngine(model.path, engine.options, stop_ids, model.revision)


def _transformers_argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    return [
        *(sys.executable, "-m", "dflash_build.engines.server", "--model", model.path),
        *("--options", hashing.canonical_json(dict(options)), "--stop-ids", ",".join(map(str, stop_ids))),
        *("--port", str(port), *(("--revision", model.revision) if model.revision else ())),
    ]


def _transformers_gpu(engine: EngineSpec) -> bool:
    return engine.gpus is not None or str(engine.options.get("device", "cpu")).startswith("cuda")


# -- sglang: one engine per GPU, in the job or as SGLang's own HTTP server ---------------------------
def _sglang_load(
    engine: EngineSpec, model: ModelSpec, stop_ids: list[int], lease: GpuLease | None, tokenizer: Any
) -> Engine:
    from dflash_build.engines.sglang_backend import SGLangEngine

    return SGLangEngine(model, engine.options, stop_ids, lease)


def _sglang_argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    from dflash_build.engines.sglang_backend import server_kwargs

    kwargs = server_kwargs(model, options, lease, port)
    return [sys.executable, "-m", "dflash_build.engines.sglang_backend", "serve", hashing.canonical_json(kwargs)]


def _sglang_concurrency(options: Mapping[str, Any]) -> int:
    from dflash_build.engines.sglang_backend import DEFAULT_MAX_INFLIGHT

    return int(options.get("max_inflight", DEFAULT_MAX_INFLIGHT))


def _sglang_check(options: Mapping[str, Any]) -> None:
    from dflash_build.engines.sglang_backend import check_options

    check_options(options)


# -- openai: servers someone else runs (vLLM, SGLang, llama.cpp), over HTTP ---------------------------
def _openai_load(
    engine: EngineSpec, model: ModelSpec, stop_ids: list[int], lease: GpuLease | None, tokenizer: Any
) -> Engine:
    from dflash_build.engines.openai_backend import OpenAIEngine

    return OpenAIEngine(engine.options, stop_ids, tokenizer, model.path, engine.stall_timeout)


# -- llamacpp: llama-cpp-python's OpenAI server on a GGUF, started by a host, on the CPU -------------
def _llamacpp_argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    return [
        *(sys.executable, "-m", "llama_cpp.server", "--model", model.path, "--host", "127.0.0.1"),
        *("--port", str(port), "--n_ctx", str(context or 4096)),
        *("--n_threads", str(int(options.get("threads", 1)))),
    ]


BACKENDS: dict[str, Backend] = {
    "transformers": Backend(
        "transformers",
        load=_transformers_load,
        serve=Serve(_transformers_argv, concurrency=lambda options: int(options.get("batch_size", 8))),
        uses_gpu=_transformers_gpu,
    ),
    "sglang": Backend(
        "sglang",
        load=_sglang_load,
        serve=Serve(_sglang_argv, concurrency=_sglang_concurrency),
        uses_gpu=lambda engine: True,
        conda_env="sglang",
        check_options=_sglang_check,
    ),
    # servers someone else runs own their GPUs
    "openai": Backend("openai", load=_openai_load, serve=None, uses_gpu=lambda engine: False, remote=True),
    "llamacpp": Backend(
        "llamacpp",
        load=None,
        # llama-cpp-python's server has no /health, and answers one request at a time: one waits while one runs
        serve=Serve(_llamacpp_argv, health_path="/v1/models", api="completions"),
        uses_gpu=lambda engine: False,  # on the CPU here
        always_through_server=True,
    ),
}
