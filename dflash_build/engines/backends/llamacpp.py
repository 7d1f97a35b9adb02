"""llamacpp: llama-cpp-python's OpenAI server on a GGUF, started by a host, on the CPU."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from dflash_build.engines.registry import FAULTS, SPEED, Backend, Option, Serve
from dflash_build.spec import ModelSpec


def _argv(
    model: ModelSpec, options: Mapping[str, Any], stop_ids: list[int], port: int, context: int | None, lease: Any
) -> list[str]:
    return [
        *(sys.executable, "-m", "llama_cpp.server", "--model", model.path, "--host", "127.0.0.1"),
        *("--port", str(port), "--n_ctx", str(context or 4096)),
        *("--n_threads", str(int(BACKEND.value(options, "threads")))),
    ]


BACKEND = Backend(
    "llamacpp",
    options={
        "threads": Option(None, SPEED, default=1),
        "retries": Option(None, FAULTS + ": a request to the server, sent again", default=3, driver=True),
    },
    load=None,  # no in-process engine
    # llama-cpp-python's server has no /health, and answers one request at a time: one waits while one runs
    serve=Serve(_argv, health_path="/v1/models", api="completions"),
    uses_gpu=lambda engine: False,  # on the CPU here
    always_through_server=True,  # every job talks to a host's server
    threads=lambda options: int(BACKEND.value(options, "threads")),
)
