"""Engines behind one small interface.

A backend takes requests (prompt token ids, sampling params, the row's own seed) and yields results as
they finish. The generation driver (``dflash_build.generate``) owns rendering, batching order,
accounting and publishing; a backend owns only the engine call. Backends import their engine library
inside their own module, so an optional engine is never needed to parse the workflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_build.gpus import GpuLease
    from dflash_build.spec import EngineSpec, ModelSpec


from dflash_build.engines.base import (
    BACKENDS as BACKENDS,
)
from dflash_build.engines.base import (
    Engine as Engine,
)
from dflash_build.engines.base import (
    EngineFailed as EngineFailed,
)
from dflash_build.engines.base import (
    EngineStalled as EngineStalled,
)
from dflash_build.engines.base import (
    Request as Request,
)
from dflash_build.engines.base import (
    Result as Result,
)
from dflash_build.engines.base import (
    SamplingParams as SamplingParams,
)
from dflash_build.engines.base import (
    closest as closest,
)
from dflash_build.engines.base import (
    position_seed as position_seed,
)
from dflash_build.engines.options import check_options as check_options


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
