"""SGLang backend: one in-process ``sglang.Engine`` per GPU job, token ids in and out.

Written against SGLang's own code at the pinned version (``SGLANG_VERSION``, the one the ``sglang``
extra and ``envs/sglang.yaml`` install); ``tests/test_sglang_contract.py`` checks every name we pass
against that installed package.

- The engine starts with ``skip_tokenizer_init=True``: the driver renders prompts, so the ids the model
  sees are exactly the ids the sample holds. ``max_new_tokens`` is always sent (SGLang's default is 128).
- Engine options: any field of the installed ``ServerArgs`` passes through, except the few the driver
  sets itself (``DRIVER_FIELDS``); an unknown one is refused at parse time with the closest real field.
- Each row's seed goes out as ``sampling_seed``; SGLang honours it only when the engine runs with
  ``enable_deterministic_inference`` (it costs throughput), otherwise rows are sampled from the
  engine's own random state and a rerun is not bit-identical.
- Results (``parse_output``): ``output_ids`` end with the matched stop token (SGLang returns
  ``output_ids_through_stop``); a stop that "matched" a string is an engine fault (SGLang reports NaN
  logits that way); a request refused or aborted with a status code is raised by SGLang, not returned,
  and a refusal that says "retry later" (503, 429) is retried before it becomes an abort row.
- Signals: SGLang puts its own SIGTERM/SIGQUIT handlers on the driver's event loop (drain, then kill the
  whole process tree, driver included). The backend takes them back: the driver's handlers stay in
  charge, a SIGQUIT from a failing SGLang child fails the job cleanly, and ``close`` stops only the
  processes this engine started (``Engine.shutdown`` kills every child of the driver).

SGLang cannot run on a CPU-only machine; the engine call itself is the untested surface (docs/generation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import uuid
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

from dflash_build.engines import sglang_fields
from dflash_build.engines.base import EngineFailed, Request, Result, closest
from dflash_build.engines.gpus import GpuLease
from dflash_build.engines.sglang_wire import abort as _abort
from dflash_build.engines.sglang_wire import parse_output as parse_output
from dflash_build.engines.sglang_wire import sampling_params as sampling_params
from dflash_build.spec import ConfigError, ModelSpec

log = logging.getLogger(__name__)

# The release whose model registry has Qwen3.5/Qwen3.6 (Qwen3_5ForConditionalGeneration, a hybrid GDN +
# attention model) and whose seeded sampler takes int64 seeds. Keep in step with pyproject.toml's
# `sglang` extra and envs/sglang.yaml (tests/test_sglang_contract.py checks all three agree).
SGLANG_VERSION = "0.5.23"

# ServerArgs fields the driver sets itself: the options cannot override them.
DRIVER_FIELDS: dict[str, str] = {
    "model_path": "set from model.path",
    "tokenizer_path": "set from model.tokenizer (or model.path)",
    "revision": "set from model.revision",
    "context_length": "set from model.context_length (the driver skips what does not fit)",
    "skip_tokenizer_init": "the driver renders and tokenizes prompts itself",
    "tp_size": "one engine per GPU job",
    "dp_size": "one engine per GPU job",
    "pp_size": "one engine per GPU job",
    "base_gpu_id": "the job's pinned GPU is device 0 of its process",
    "port": "set per GPU slot from engine.base_port",
    "nccl_port": "set per GPU slot from engine.base_port",
}
# Our own options: how many requests are in flight in the engine at once; how often a request SGLang
# turned away with "retry later" (503 under memory pressure, 429) is sent again before it is an abort row.
OWN_OPTIONS = frozenset({"max_inflight", "retries"})
DEFAULT_MAX_INFLIGHT = 1024
DEFAULT_RETRIES = 3
_RETRY_STATUS = frozenset({429, 503})
_RETRY_DELAY_SECONDS = 2.0


# -- options -------------------------------------------------------------------------------------
def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_server_fields() -> frozenset[str]:
    """The fields of the installed SGLang's ``ServerArgs`` (imports SGLang: a few seconds)."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    return frozenset(f.name for f in record_fields(ServerArgs) if not f.name.startswith("_"))  # bookkeeping


def server_fields() -> tuple[str, frozenset[str]]:
    """(version, ServerArgs field names) of the SGLang the jobs will run.

    The pinned version's fields are recorded in ``sglang_fields`` (checked against the package in CI),
    so a workflow parses without importing SGLang, or where it is not installed at all (jobs then run in
    envs/sglang.yaml). Another installed version is read from the package itself.
    """
    found = installed_version()
    if found is None or found == sglang_fields.VERSION:
        return sglang_fields.VERSION, sglang_fields.SERVER_ARGS
    return found, installed_server_fields()


def check_options(options: Mapping[str, Any]) -> None:
    """Refuse an option SGLang does not have (naming the closest field) or one the driver sets."""
    version, fields = server_fields()
    for name in sorted(options):
        if name in OWN_OPTIONS:
            continue
        if name in DRIVER_FIELDS:
            raise ConfigError(f"engine.options.{name}", f"{DRIVER_FIELDS[name]}; remove it from the options")
        if name not in fields:
            raise ConfigError(
                f"engine.options.{name}",
                f"SGLang {version} has no such ServerArgs field{closest(name, fields | OWN_OPTIONS)}",
            )


def server_args(model: ModelSpec, options: Mapping[str, Any], lease: GpuLease | None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for one single-GPU engine."""
    check_options(options)
    args: dict[str, Any] = {
        "log_level": "warning",
        **{k: v for k, v in options.items() if k not in OWN_OPTIONS},
        "model_path": model.path,
        "tokenizer_path": model.tokenizer or model.path,
        "skip_tokenizer_init": True,
        "tp_size": 1,
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
        self.max_inflight = int(options.get("max_inflight", DEFAULT_MAX_INFLIGHT))
        self.retries = int(options.get("retries", DEFAULT_RETRIES))
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
                out = await self.engine.async_generate(input_ids=request.prompt_ids, sampling_params=params, rid=rid)
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


def render_fields_module(version: str, fields: Iterable[str]) -> str:
    """The source of ``sglang_fields.py`` for one SGLang version's ServerArgs."""
    lines = [
        f'"""ServerArgs fields of SGLang {version}: generated from the installed package, do not edit.',
        "",
        "Regenerate after changing SGLANG_VERSION (tests/test_sglang_contract.py says when):",
        "    python -c 'from dflash_build.engines import sglang_backend as s; s.write_fields_module()'",
        '"""',
        "",
        f'VERSION = "{version}"',
        "SERVER_ARGS = frozenset(",
        "    {",
        *(f'        "{name}",' for name in sorted(fields)),
        "    }",
        ")",
    ]
    return "\n".join(lines) + "\n"


def write_fields_module() -> None:
    from pathlib import Path

    version = installed_version()
    if version is None:
        raise RuntimeError("SGLang is not installed (make setup installs the pinned wheel)")
    path = Path(__file__).with_name("sglang_fields.py")
    path.write_text(render_fields_module(version, installed_server_fields()))


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
