"""Engines behind one small interface.

A backend takes requests (prompt token ids, sampling params, the row's own seed) and yields results as
they finish. The generation driver (``dflash_build.stages.generate``) owns rendering, batching order,
accounting and publishing; a backend owns only the engine call. Backends import their engine library
inside their own module, so an optional engine is never needed to parse the workflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_build.engines.gpus import GpuLease
    from dflash_build.spec import EngineSpec, ModelSpec


from dflash_build.engines import registry
from dflash_build.engines.base import (
    Engine as Engine,
)
from dflash_build.engines.base import (
    EngineDied as EngineDied,
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
from dflash_build.engines.registry import check_options as check_options

BACKENDS = tuple(registry.BACKENDS)


def uses_gpu(engine: EngineSpec) -> bool:
    """Whether a generation job is pinned to a GPU (the rule asks for ``gpu=1``, or ``gpu_jobs=1`` with
    shared engines, and the job takes a free GPU or a free place on one)."""
    return registry.get(engine.backend).uses_gpu(engine)


def load(
    engine: EngineSpec, model: ModelSpec, stop_token_ids: list[int], lease: GpuLease | None, tokenizer: Any = None
) -> Engine:
    """Start the configured backend in this process; its library is imported here, never at parse time.

    ``tokenizer`` is the driver's (the openai backend needs it for text-only servers).
    """
    backend = registry.get(engine.backend)
    if backend.load is None:
        raise ValueError(f"the {backend.name} backend runs as a server: dflash_build.engines.host starts it")
    return backend.load(engine, model, stop_token_ids, lease, tokenizer)
