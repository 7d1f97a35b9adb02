"""SGLang 0.5.23's own ``/generate`` route, run under uvicorn around a stand-in tokenizer manager.

SGLang's HTTP server cannot be imported here (it needs its GPU dependencies), so :func:`serve` takes the
route's own code out of the installed package's source, ``serve_generate_request`` (http_server.py) and
``TokenizerManager.create_abort_task`` (tokenizer_manager.py), and runs it as SGLang does: Starlette's
``StreamingResponse`` under uvicorn, SGLang's ``dumps_json`` framing each chunk. The tokenizer manager
behind it (:class:`Manager`) yields SGLang's chunks (``output_ids`` and ``meta_info``, its new tokens as
``incremental_streaming_output`` sends them) and, like ``TokenizerManager.generate_request``, aborts a
request whose generator is ended before its answer is (its ``except BaseException``, checked against the
source in tests/test_sglang_contract.py). ``create_abort_task``'s 2 s wait is shortened (``ABORT_WAIT``).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import logging
import socket
import textwrap
import threading
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.standin_server import generate_answer

ABORT_WAIT = 0.05  # create_abort_task's sleep of 2 s, scaled down 40 times
TOKEN_SECONDS = 0.002


def _installed(relative: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "make setup installs the pinned sglang wheel"
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _function(relative: str, name: str, cls: str | None = None) -> str:
    """The source of a function (or a method of ``cls``) of the installed SGLang, dedented."""
    source = _installed(relative).read_text()
    for node in ast.walk(ast.parse(source)):
        body = node.body if isinstance(node, ast.ClassDef) and node.name == cls else []
        if cls is None and isinstance(node, ast.Module):
            body = node.body
        for item in body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return textwrap.dedent(ast.get_source_segment(source, item) or "")
    raise AssertionError(f"the installed SGLang has no {cls or relative}.{name}")


def _dumps_json() -> Any:
    """SGLang's ``dumps_json`` (srt/utils/json_response.py), loaded from its file alone."""
    spec = importlib.util.spec_from_file_location("_sglang_json_response", _installed("srt/utils/json_response.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dumps_json


class Manager:
    """The tokenizer manager behind the route: SGLang's chunks, one per ``stream_interval`` tokens."""

    def __init__(self) -> None:
        self.rid_to_state: dict[str, Any] = {}
        self.aborted: list[str] = []  # abort_request's rids, in order
        self.generated: dict[str, int] = {}  # tokens per rid when it ended
        self.spec_versions: set[str] = set()  # the ASGI spec version uvicorn gave each request
        self.create_abort_task = types.MethodType(_create_abort_task(), self)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)

    async def generate_request(self, obj: Any, request: Any) -> AsyncIterator[dict[str, Any]]:
        self.rid_to_state[obj.rid] = obj  # kept after an abort until the scheduler answers it, as SGLang does
        ids, finish = generate_answer(obj.body)
        interval, sent = int(obj.body["sampling_params"].get("stream_interval") or 1), 0
        try:
            for i in range(1, len(ids) + 1):
                await asyncio.sleep(TOKEN_SECONDS)
                self.generated[obj.rid] = i
                if i == len(ids) or i - sent >= interval or not sent:
                    meta = {"id": obj.rid, "finish_reason": finish if i == len(ids) else None, "completion_tokens": i}
                    yield {"output_ids": ids[sent:i], "meta_info": meta}
                    sent = i
        except BaseException:  # tokenizer_manager.py:958-967: _release_req_states_on_failure aborts it
            self.abort_request(obj.rid)
            raise
        del self.rid_to_state[obj.rid]


def _create_abort_task() -> Any:
    quick = types.SimpleNamespace(sleep=lambda seconds: asyncio.sleep(seconds * ABORT_WAIT / 2))
    from fastapi import BackgroundTasks

    namespace: dict[str, Any] = {"asyncio": quick, "BackgroundTasks": BackgroundTasks}
    exec(_function("srt/managers/tokenizer_manager.py", "create_abort_task", "TokenizerManager"), namespace)
    return namespace["create_abort_task"]


def _route(manager: Manager) -> Any:
    from fastapi.responses import ORJSONResponse, StreamingResponse

    never = types.SimpleNamespace(get=lambda: False)
    namespace: dict[str, Any] = {
        "envs": types.SimpleNamespace(SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=never),
        "_global_state": types.SimpleNamespace(tokenizer_manager=manager),
        "AsyncIterator": AsyncIterator,
        "dumps_json": _dumps_json(),
        "logger": logging.getLogger("sglang_route"),
        "StreamingResponse": StreamingResponse,
        "ORJSONResponse": ORJSONResponse,
    }
    exec(_function("srt/entrypoints/http_server.py", "serve_generate_request"), namespace)
    return namespace["serve_generate_request"]


@contextmanager
def serve(model_id: str) -> Iterator[tuple[str, Manager]]:
    """SGLang's route on 127.0.0.1 (its URL and its tokenizer manager), with ``/v1/models`` naming ``model_id``."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    manager = Manager()
    route = _route(manager)

    async def generate(request: Any) -> Any:
        body = await request.json()
        manager.spec_versions.add(request.scope["asgi"].get("spec_version", "2.0"))
        obj = types.SimpleNamespace(stream=bool(body.get("stream")), rid=uuid.uuid4().hex, is_single=True, body=body)
        return await route(obj, request)

    async def models(request: Any) -> Any:
        return JSONResponse({"data": [{"id": model_id}]})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/v1/models", models)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", manager
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
