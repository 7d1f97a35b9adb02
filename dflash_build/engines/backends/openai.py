"""openai: servers someone else runs (vLLM, SGLang, llama.cpp), over HTTP (dflash_build.engines.openai_backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash_build.engines.registry import FAULTS, SPEED, Backend, Option
from dflash_build.keys import GEN

if TYPE_CHECKING:
    from dflash_build.engines.base import Engine
    from dflash_build.engines.gpus import GpuLease
    from dflash_build.spec import EngineSpec, ModelSpec


def _load(engine: EngineSpec, model: ModelSpec, stop_ids: list[int], lease: GpuLease | None, tokenizer: Any) -> Engine:
    from dflash_build.engines.openai_backend import OpenAIEngine

    return OpenAIEngine(engine.options, stop_ids, tokenizer, model.path, engine.stall_timeout)


BACKEND = Backend(
    "openai",
    options={
        "prompt": Option(GEN, "token ids or re-tokenized text: what the server's model is shown", default="auto"),
        "urls": Option(None, "which servers; the model they serve is checked against model.path"),
        "api": Option(None, "the same ids and sampling params through another endpoint", default="completions"),
        "model": Option(None, "the name requests carry; the server's identity is checked against model.path"),
        "expect_model": Option(None, "the name a server reports for model.path's weights: an identity check only"),
        "concurrency": Option(None, SPEED, default=16),
        "timeout": Option(None, FAULTS, default=600),
        "retries": Option(None, FAULTS, default=5),
        "backoff": Option(None, FAULTS, default=0.5),
        "max_backoff": Option(None, FAULTS, default=30),
        # where a silent server is checked: SGLang's /health generates a token through its scheduler
        "health": Option(None, FAULTS + ": the path a stalled server is checked on"),
    },
    load=_load,
    serve=None,
    uses_gpu=lambda engine: False,  # servers someone else runs own their GPUs
    remote=True,
)
