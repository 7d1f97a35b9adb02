"""A small HTTP server around the transformers backend, so that a CPU (or small GPU) engine can outlive
a job the way an SGLang server does (see dflash_build.engines.host).

It speaks the subset of SGLang's native API that the openai backend uses with ``api: generate``:
``POST /generate`` with ``input_ids`` and SGLang's ``sampling_params`` (``sampling_seed`` included),
answered with ``output_ids`` (the stop token last, as SGLang does) and ``meta_info.finish_reason``
in SGLang's shapes; ``GET /health``, ``/get_model_info`` and ``/v1/models`` name the model. Requests
from every connected job wait in one queue; a worker takes up to ``batch_size`` of them with the same
sampling parameters at a time. Answers do not depend on which requests share a batch (the backend
samples every position from the row's own seed), so a shared engine writes exactly what a job's own
engine writes.

    python -m dflash_build.engines.server --model PATH --options JSON --stop-ids 2,3 --port 31000
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dflash_build.engines.base import Request, Result, SamplingParams
from dflash_build.engines.transformers_backend import TransformersEngine
from dflash_build.spec import LoopRule

log = logging.getLogger(__name__)
# Knobs the transformers backend does not implement: refused unless neutral, never silently ignored.
_NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0}


def request_of(rid: str, body: dict[str, Any], stop_ids: list[int]) -> Request:
    """A /generate body as the backend's Request; ValueError (a 400) for anything it cannot honour."""
    ids, sp = body.get("input_ids"), body.get("sampling_params") or {}
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("input_ids must be a non-empty list of token ids")
    if sorted(sp.get("stop_token_ids", stop_ids)) != sorted(stop_ids):
        raise ValueError(f"stop_token_ids {sp['stop_token_ids']} are not this server's {stop_ids}")
    for name, neutral in _NEUTRAL.items():
        if sp.get(name, neutral) != neutral:
            raise ValueError(f"sampling_params.{name}={sp[name]!r} is not supported (only {neutral})")
    top_k = int(sp.get("top_k", -1))
    params = SamplingParams(
        float(sp.get("temperature", 1.0)),
        float(sp.get("top_p", 1.0)),
        top_k if top_k > 0 else 0,
        float(sp.get("min_p", 0.0)),
        int(sp.get("max_new_tokens", 128)),
    )
    rule = body.get("stop_loops")
    stop_loops = LoopRule(**{k: int(rule[k]) for k in ("max_period", "min_repeats", "min_span")}) if rule else None
    return Request(rid, 0, ids, params, int(sp.get("sampling_seed", 0)), stop_loops)


def answer_of(result: Result) -> dict[str, Any]:
    """A Result in SGLang's /generate shape."""
    ids = list(result.output_ids)
    if result.finish_reason == "stop":
        ids.append(result.stop_token_id)
        finish: dict[str, Any] = {"type": "stop", "matched": result.stop_token_id}
    elif result.finish_reason in ("length", "loop"):  # loop: ours, the rule the request named fired
        finish = {"type": result.finish_reason, "length": len(ids)}
    else:
        finish = {"type": "abort", "message": result.error or result.finish_reason}
    return {
        "output_ids": ids,
        "meta_info": {"id": result.prompt_id, "finish_reason": finish, "completion_tokens": len(ids)},
    }


class BatchingEngine:
    """One worker thread runs the engine over whatever requests wait, up to ``batch_size`` at a time."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.waiting: queue.Queue[tuple[Request, Future[Result]]] = queue.Queue()
        self._next = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._work, name="batching", daemon=True).start()

    def submit(self, body: dict[str, Any]) -> Future[Result]:
        with self._lock:
            self._next += 1
            rid = f"r{self._next}"
        future: Future[Result] = Future()
        self.waiting.put((request_of(rid, body, sorted(self.engine.stop_token_ids)), future))
        return future

    def _work(self) -> None:
        while True:
            batch = [self.waiting.get()]
            later = []
            while len(batch) < self.engine.batch_size:
                try:
                    item = self.waiting.get_nowait()
                except queue.Empty:
                    break
                (batch if item[0].params == batch[0][0].params else later).append(item)
            for item in later:
                self.waiting.put(item)
            futures = {r.prompt_id: f for r, f in batch}
            try:
                answered = tokens = 0
                for result in self.engine.generate([r for r, _ in batch]):
                    futures.pop(result.prompt_id).set_result(result)
                    answered, tokens = answered + 1, tokens + len(result.output_ids)
                # a count the engine's log keeps across restarts: what it answered, wasted or not
                log.info("answered %d requests (%d output tokens)", answered, tokens)
            except Exception as e:  # the engine failed: every waiting request hears of it
                log.exception("engine failed")
                for f in futures.values():
                    f.set_exception(e)
            for f in futures.values():  # never answered: an abort, not a hang
                if not f.done():
                    f.set_exception(RuntimeError("the engine returned no result"))


def make_handler(batching: BatchingEngine, model_path: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # one line per request is noise
            pass

        def _send(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/get_model_info":
                self._send(200, {"model_path": model_path})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model_path, "object": "model"}]})
            else:
                self._send(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError as e:
                self._send(400, {"error": f"not JSON: {e}"})
                return
            if self.path != "/generate":
                self._send(404, {"error": f"no {self.path}"})
                return
            try:
                future = batching.submit(body)
            except (ValueError, TypeError) as e:
                self._send(400, {"error": str(e)})
                return
            try:
                self._send(200, answer_of(future.result()))
            except Exception as e:
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--revision", default=None)
    parser.add_argument("--options", default="{}", help="the transformers backend's engine.options, as JSON")
    parser.add_argument("--stop-ids", required=True, help="comma-separated stop token ids")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop_ids = [int(t) for t in args.stop_ids.split(",")]
    engine = TransformersEngine(args.model, json.loads(args.options), stop_ids, args.revision)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(BatchingEngine(engine), args.model))
    server.daemon_threads = True
    log.info("serving %s on %s:%d", args.model, args.host, args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
