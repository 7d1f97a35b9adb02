"""SGLang backend: one in-process ``sglang.Engine`` per GPU job, token ids in and out.

Written against SGLang's own code at the pinned version (``SGLANG_VERSION``, the one the ``sglang``
extra and ``envs/sglang.yaml`` install); ``tests/test_sglang_contract.py`` checks every name we pass
against that installed package.

- The engine starts with ``skip_tokenizer_init=True``: the driver renders prompts, so the ids the model
  sees are exactly the ids the sample holds. ``max_new_tokens`` is always sent (SGLang's default is 128).
- Engine options: any field of the installed ``ServerArgs`` passes through, except the few the driver
  sets itself; an unknown one is refused at parse time with the closest real field (the descriptor,
  :mod:`dflash_build.engines.backends.sglang`, decides each).
- Each row's seed goes out as ``sampling_seed``; SGLang honours it only when the engine runs with
  ``enable_deterministic_inference`` (it costs throughput), otherwise rows are sampled from the
  engine's own random state and a rerun is not bit-identical.
- Results (``parse_output``): ``output_ids`` end with the matched stop token (SGLang returns
  ``output_ids_through_stop``); a stop that "matched" a string is an engine fault (SGLang reports NaN
  logits that way); a request refused or aborted with a status code is raised by SGLang, not returned,
  and a refusal that says "retry later" (503, 429) is retried before it becomes an abort row.
- Loops (``Request.stop_loops``, config ``degenerate.loop.stop_early``): such a request is streamed, one
  chunk per loop check, and where the rule fires the answer is cut there (finish reason ``loop``), the
  stream closed and the request aborted (``abort_request``, as SGLang does itself on a closed stream:
  :mod:`dflash_build.engines.sglang_wire` says where); others are answered whole. A streamed answer
  ends as a whole one would, its speculative counts read from its last chunk.
- Signals: SGLang puts its own SIGTERM/SIGQUIT handlers on the driver's event loop (drain, then kill the
  whole process tree, driver included). The backend takes them back: the driver's handlers stay in
  charge, a SIGQUIT from a failing SGLang child fails the job cleanly, and ``close`` stops only the
  processes this engine started (``Engine.shutdown`` kills every child of the driver).

SGLang cannot run on a CPU-only machine; the engine call itself is the untested surface (docs/generation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import uuid
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

from dflash_build.engines import registry
from dflash_build.engines.base import EngineFailed, Request, Result
from dflash_build.engines.gpus import GpuLease
from dflash_build.engines.sglang_wire import GenerateStream
from dflash_build.engines.sglang_wire import abort as _abort
from dflash_build.engines.sglang_wire import parse_output as parse_output
from dflash_build.engines.sglang_wire import sampling_params as sampling_params
from dflash_build.spec import ModelSpec

log = logging.getLogger(__name__)
BACKEND = registry.get("sglang")

# The release whose model registry has Qwen3.5/Qwen3.6 (Qwen3_5ForConditionalGeneration, a hybrid GDN +
# attention model) and whose seeded sampler takes int64 seeds. Keep in step with pyproject.toml's
# `sglang` extra and envs/sglang.yaml (tests/test_sglang_contract.py checks all three agree).
SGLANG_VERSION = "0.5.23"

_RETRY_STATUS = frozenset({429, 503})
_RETRY_DELAY_SECONDS = 2.0


def server_args(model: ModelSpec, options: Mapping[str, Any], lease: GpuLease | None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for one single-GPU engine."""
    BACKEND.check(options)
    args: dict[str, Any] = {
        "log_level": BACKEND.value(options, "log_level"),
        **BACKEND.engine_options(options),
        "model_path": model.path,
        "tokenizer_path": model.tokenizer or model.path,
        "skip_tokenizer_init": True,
        "tp_size": 1,
        # a streamed answer's chunks hold its new tokens, not the whole answer again (sglang_wire)
        "incremental_streaming_output": True,
        # CUDA_VISIBLE_DEVICES holds exactly the pinned GPU, so it is device 0 in this process.
        "base_gpu_id": 0,
    }
    if model.revision is not None:
        args["revision"] = model.revision
    if model.context_length is not None:
        args["context_length"] = model.context_length  # the driver skipped what does not fit
    if lease is not None:
        # Own ports per GPU slot: SGLang picks its NCCL port near its port unless told, and two
        # engines on one machine must not collide.
        args["port"] = lease.port
        args["nccl_port"] = lease.port + 1
    return args


def refusal_status(error: BaseException) -> int | None:
    """The HTTP status of a request SGLang raised instead of answering, None for any other exception.

    SGLang raises ``ValueError`` for a 400 (a prompt over the context, a bad parameter) and
    ``fastapi.HTTPException`` for any other status (e.g. 503 "retry later" under memory pressure).
    """
    status = getattr(error, "status_code", None)
    if isinstance(status, int):
        return status
    if isinstance(error, ValueError):
        return 400
    return None


class SGLangEngine:
    def __init__(
        self, model: ModelSpec, options: Mapping[str, Any], stop_token_ids: list[int], lease: GpuLease | None
    ) -> None:
        import psutil
        import sglang

        self.stop_token_ids = stop_token_ids
        self.max_inflight = int(BACKEND.value(options, "max_inflight"))
        self.retries = int(BACKEND.value(options, "retries"))
        self.failure: str | None = None
        self._stopping = False
        self._rids: dict[asyncio.Task[Result | None], str] = {}
        args = server_args(model, options, lease)
        driver = psutil.Process()
        before = {p.pid for p in driver.children(recursive=True)}
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        log.info("starting sglang.Engine(%s)", args)
        self.engine = sglang.Engine(**args)
        # SGLang's own processes: what appeared under the driver while the engine started.
        self._own = [p for p in driver.children(recursive=False) if p.pid not in before]
        self.loop: asyncio.AbstractEventLoop = self.engine.loop
        self._take_back_signals(saved)

    def _take_back_signals(self, saved: Mapping[signal.Signals, Any]) -> None:
        """Remove SGLang's loop handlers (drain-then-kill-all on SIGTERM, kill-all on SIGQUIT).

        The tokenizer manager installs them lazily with its request loop; creating that loop now makes
        the later lazy call a no-op, so the handlers removed here stay removed.
        """
        self.engine.tokenizer_manager.auto_create_handle_loop()
        for sig in (signal.SIGTERM, signal.SIGQUIT):
            self.loop.remove_signal_handler(sig)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        # SGLang's children send SIGQUIT to the driver when they fail.
        signal.signal(signal.SIGQUIT, self._child_failed)

    def _child_failed(self, signum: int, frame: Any) -> None:
        self.failure = "an SGLang process failed (it sent SIGQUIT to the driver); see the engine log above"
        self.interrupt()

    def interrupt(self) -> None:
        """Called from a signal handler: stop sending, abort what is in flight, let generate() return."""
        self._stopping = True
        self.loop.call_soon_threadsafe(self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        for task, rid in list(self._rids.items()):
            self.engine.tokenizer_manager.abort_request(rid)
            task.cancel()

    async def _one(self, request: Request) -> Result | None:
        """One request; None when it was cut short by interrupt() (nothing to journal)."""
        params = sampling_params(request, self.stop_token_ids)
        task = asyncio.current_task()
        for attempt in range(self.retries + 1):
            rid = f"{request.prompt_id}/{request.sample_idx}/{uuid.uuid4().hex[:12]}"
            if task is not None:
                self._rids[task] = rid
            try:
                out = await self._answer(request, params, rid)
            except asyncio.CancelledError:
                return None
            except Exception as e:  # one bad request must not fail the shard
                status = refusal_status(e)
                why = f"{type(e).__name__}: {getattr(e, 'detail', None) or e}"
                if status in _RETRY_STATUS and attempt < self.retries and not self._stopping:
                    log.warning("request %s turned away (%s); retry %d/%d", rid, why, attempt + 1, self.retries)
                    await asyncio.sleep(_RETRY_DELAY_SECONDS * (attempt + 1))
                    continue
                if status is not None:
                    return _abort(request, f"engine refused the request ({status}): {why}")
                return Result(request.prompt_id, request.sample_idx, [], "error", error=why)
            finally:
                if task is not None:
                    self._rids.pop(task, None)
            finish = (out.get("meta_info") or {}).get("finish_reason") or {}
            if self._stopping and isinstance(finish, Mapping) and finish.get("type") == "abort":
                return None  # aborted by interrupt(): generated again on the next run
            return parse_output(request, out, self.stop_token_ids)
        raise AssertionError("unreachable")

    async def _answer(self, request: Request, params: dict[str, Any], rid: str) -> Mapping[str, Any]:
        """One attempt's output: whole, or streamed where the loop rule stops the row and, where it fires,
        cut there and the request aborted."""
        kwargs = {"input_ids": request.prompt_ids, "sampling_params": params, "rid": rid}
        if request.stop_loops is None:
            return await self.engine.async_generate(**kwargs)  # type: ignore[no-any-return]
        stream = GenerateStream(request.stop_loops)
        chunks = await self.engine.async_generate(**GenerateStream.streamed(kwargs))
        try:
            async for chunk in chunks:
                cut = stream.read(chunk)
                if cut is not None:
                    self.engine.tokenizer_manager.abort_request(rid)
                    return cut
        finally:
            await chunks.aclose()  # SGLang's generate_request aborts a request it is closed on, too
        return stream.whole()

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Keep ``max_inflight`` requests in the engine; yield each as it finishes."""
        todo = iter(requests)
        pending = {self.loop.create_task(self._one(r)) for r in islice(todo, self.max_inflight)}
        while pending:
            done, pending = self.loop.run_until_complete(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            for task in done:
                result = None if task.cancelled() else task.result()
                if result is not None and not self._stopping:
                    yield result
                nxt = None if self._stopping else next(todo, None)
                if nxt is not None:
                    pending.add(self.loop.create_task(self._one(nxt)))
        if self.failure is not None:
            raise EngineFailed(self.failure)

    def close(self) -> None:
        """Stop the processes this engine started, and only those (``Engine.shutdown`` kills every child)."""
        import psutil

        watchdog = getattr(self.engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # else it reports the processes stopped below as crashed (SIGQUIT)
        doomed = []
        for proc in self._own:
            try:
                doomed += [*proc.children(recursive=True), proc]
            except psutil.NoSuchProcess:
                continue
        for proc in doomed:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _, alive = psutil.wait_procs(doomed, timeout=60)  # the GPU is free once they are gone
        if alive:
            log.warning("SGLang processes %s outlived SIGKILL for 60 s", [p.pid for p in alive])
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


# -- a long-lived server (engine.shared) -----------------------------------------------------------
def server_kwargs(model: ModelSpec, options: Mapping[str, Any], lease: GpuLease | None, port: int) -> dict[str, Any]:
    """``ServerArgs`` of the HTTP server that engine_host keeps on one GPU: the in-process engine's, on
    localhost at the GPU slot's port (server_args leaves out the options the driver keeps for itself)."""
    return {**server_args(model, options, lease), "host": "127.0.0.1", "port": port}


def serve(kwargs: Mapping[str, Any]) -> None:
    """SGLang's HTTP server for ``ServerArgs(**kwargs)`` (the in-process engine's arguments plus host and
    port), started as ``python -m sglang.launch_server`` starts it; dflash_build.engines.host runs this in
    the server process it keeps per GPU, and jobs talk to it with token ids through ``/generate``."""
    import os

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    try:
        run_server(ServerArgs(**kwargs))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python -m dflash_build.engines.sglang_backend serve SERVER_ARGS_JSON")
    serve(json.loads(sys.argv[2]))
