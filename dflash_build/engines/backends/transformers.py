"""transformers: the reference engine, in the job or as a server of ours (dflash_build.engines.server)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dflash_build import hashing
from dflash_build.engines.registry import FAULTS, NUMERICS, SPEED, Backend, Derived, Option, Preflight, Serve
from dflash_build.keys import GEN

if TYPE_CHECKING:
    from dflash_build.engines.base import Engine
    from dflash_build.engines.gpus import GpuLease
    from dflash_build.spec import EngineSpec, ModelSpec


def _dtype(options: Mapping[str, Any]) -> str:
    """float32 on the CPU, bfloat16 on a GPU."""
    return "float32" if str(BACKEND.value(options, "device")) == "cpu" else "bfloat16"


def _load(engine: EngineSpec, model: ModelSpec, stop_ids: list[int], lease: GpuLease | None, tokenizer: Any) -> Engine:
    from dflash_build.engines.transformers_backend import TransformersEngine

    return TransformersEngine(model.path, engine.options, stop_ids, model.revision)


def _argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    return [
        *(sys.executable, "-m", "dflash_build.engines.server", "--model", model.path),
        *("--options", hashing.canonical_json(BACKEND.engine_options(options))),
        *("--stop-ids", ",".join(map(str, stop_ids))),
        *("--port", str(port), *(("--revision", model.revision) if model.revision else ())),
    ]


def _uses_gpu(engine: EngineSpec) -> bool:
    return engine.gpus is not None or str(BACKEND.value(engine.options, "device")).startswith("cuda")


BACKEND = Backend(
    "transformers",
    options={
        "dtype": Option(GEN, NUMERICS, default=Derived(_dtype)),
        "device": Option(None, "the same computation on another device; dtype is keyed", default="cpu"),
        "batch_size": Option(None, "each row samples from its own seeds, whatever its batch", default=8),
        "threads": Option(None, SPEED),  # torch's own unless set
        "retries": Option(None, FAULTS + ": a request to a shared engine, sent again", default=3, driver=True),
    },
    load=_load,
    serve=Serve(_argv, concurrency=lambda options: int(BACKEND.value(options, "batch_size")), loops_in_request=True),
    uses_gpu=_uses_gpu,
    threads=lambda options: int(options.get("threads") or 1),
    stops_loops=True,
    preflight=Preflight("transformers", lambda options: sys.executable),
)
