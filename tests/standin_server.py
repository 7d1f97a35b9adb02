"""A stand-in OpenAI-protocol server on 127.0.0.1 that answers deterministically and misbehaves on demand.

Its answer to a request depends only on the request's seed and prompt (like a real server with fixed
seeds), so a build through it can be compared with a build through it that met faults on the way.
A fault applies to /v1/completions requests number ``first`` to ``last`` (1-based, inclusive).
"""

from __future__ import annotations

import http.server
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STOP_ID = 2  # SmolLM2's <|im_end|>
FAULTS = ("http_503", "empty_choices", "not_json", "json_list", "cut_mid_body", "trickle", "too_long", "hang")


def answer(body: dict[str, Any]) -> dict[str, Any]:
    """A completion of 1..max_tokens ids: shorter ones stop (plus the stop id), the full length runs out."""
    prompt = body["prompt"]
    rng = random.Random(f"{body['seed']}/{json.dumps(prompt)}")
    limit = int(body["max_tokens"])
    n = rng.randint(1, limit)
    ids = [rng.randrange(300, 5000) for _ in range(n)]
    if n < limit:
        return {"choices": [{"token_ids": [*ids, STOP_ID], "finish_reason": "stop"}], "usage": {"completion_tokens": n}}
    return {"choices": [{"token_ids": ids, "finish_reason": "length"}], "usage": {"completion_tokens": n}}


def vllm_model_not_found(name: str) -> bytes:
    """vLLM 0.32.0's answer to a completion naming a model it does not serve, as its server sent it."""
    message = f"The model `{name}` does not exist. Valid aliases: <path>"
    error = {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


@dataclass
class StandIn:
    model_id: str
    fault: str | None = None
    first: int = 1
    last: int = 0
    trickle_seconds: float = 0.4
    hang_seconds: float = 3.0  # "hang": nothing at all this long (a stopped process), then the answer
    delay_seconds: float = 0.0  # every completion takes this long (a busy server)
    freeze_after: int = 0  # from this completion on, nothing answers at all, /health neither (SIGSTOP)
    frozen: threading.Event = field(default_factory=threading.Event)
    frozen_at: float = 0.0  # time.time() of the freeze: a stall's verdict is measured from it
    completions: int = 0
    faults_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: http.server.ThreadingHTTPServer | None = None
    respond: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # a scripted answer in place of answer()
    only_its_model: bool = False  # as vLLM: a completion naming another model is refused (404)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> StandIn:
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                standin.wait_while_frozen()
                if standin.server is None:  # stopped: kept-alive connections die with it, as with a process
                    self.close_connection = True
                    return
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": standin.model_id}]}).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with standin.lock:
                    standin.completions += 1
                    n = standin.completions
                    if standin.freeze_after and n >= standin.freeze_after and not standin.frozen.is_set():
                        standin.frozen_at = time.time()
                        standin.frozen.set()
                standin.wait_while_frozen()
                time.sleep(standin.delay_seconds)
                if standin.server is None:
                    self.close_connection = True
                    return
                if standin.only_its_model and body.get("model") != standin.model_id:
                    self._send(404, vllm_model_not_found(str(body.get("model"))))
                    return
                faulty = standin.fault is not None and standin.first <= n and (not standin.last or n <= standin.last)
                if not faulty:
                    self._send(200, json.dumps((standin.respond or answer)(body)).encode())
                    return
                with standin.lock:
                    standin.faults_sent += 1
                self._fault(standin.fault or "", body)

            def _fault(self, fault: str, body: dict[str, Any]) -> None:
                good = json.dumps(answer(body)).encode()
                if fault == "http_503":
                    self._send(503, b'{"error": "overloaded"}')
                elif fault == "empty_choices":
                    self._send(200, b'{"choices": [], "usage": {"completion_tokens": 0}}')
                elif fault == "not_json":
                    self._send(200, b"<html>502 Bad Gateway</html>")
                elif fault == "json_list":
                    self._send(200, b"[1, 2, 3]")
                elif fault == "cut_mid_body":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(good)))
                    self.end_headers()
                    self.wfile.write(good[: len(good) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                elif fault == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(good)))
                    self.end_headers()
                    for i in range(len(good)):  # bounded: the whole answer, one byte at a time
                        try:
                            self.wfile.write(good[i : i + 1])
                            self.wfile.flush()
                        except OSError:
                            return
                        time.sleep(standin.trickle_seconds)
                elif fault == "hang":
                    time.sleep(standin.hang_seconds)  # bounded: then it answers, if anyone still listens
                    try:
                        self._send(200, good)
                    except OSError:
                        return
                elif fault == "too_long":
                    over = dict(answer({**body, "max_tokens": int(body["max_tokens"]) + 3}))
                    over["choices"][0]["token_ids"] = [7] * (int(body["max_tokens"]) + 3)
                    over["choices"][0]["finish_reason"] = "length"
                    self._send(200, json.dumps(over).encode())
                else:
                    raise ValueError(fault)

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def wait_while_frozen(self) -> None:
        while self.frozen.is_set() and self.server is not None:
            time.sleep(0.05)

    def stop(self) -> None:
        server, self.server = self.server, None  # a frozen handler sees it and ends
        if server is not None:
            server.shutdown()
            server.server_close()
