"""A stand-in OpenAI-protocol server on 127.0.0.1 that answers deterministically and misbehaves on demand.

Its answer to a request depends only on the request's seed and prompt (like a real server with fixed
seeds), so a build through it can be compared with a build through it that met faults on the way.
A fault applies to POST requests number ``first`` to ``last`` (1-based, inclusive).

It also answers SGLang's native ``POST /generate`` (:func:`generate_answer`), whole or, with ``"stream":
true``, as SGLang 0.5.23 streams it (dflash_build/engines/sglang_wire.py: ``data: {"output_ids",
"meta_info"}`` events every ``stream_interval`` tokens, the answer so far or with ``incremental`` its new
tokens, ``data: [DONE]`` last), generating one token every ``token_seconds``. Like SGLang it stops
generating when the client closes the stream (uvicorn sees the connection go, and the request is
aborted); each request's record (``generations``, :meth:`settled`) says how many tokens it generated
and whether it saw the stream closed.
"""

from __future__ import annotations

import http.server
import json
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STOP_ID = 2  # SmolLM2's <|im_end|>
FAULTS = ("http_503", "empty_choices", "not_json", "json_list", "cut_mid_body", "trickle", "too_long", "hang")
# /generate: SGLang's abort with "retry later" (503), as the last chunk of a stream or the status of a whole answer
GENERATE_FAULTS = ("abort_503",)
LOOP_ID = 9  # a /generate prompt holding it loops: LOOP_PERIOD after LOOP_HEAD tokens, to the budget
LOOP_HEAD = 20
LOOP_PERIOD = (4001, 4002, 4003, 4004, 4005)
SPEC = {"spec_verify_ct": 7, "spec_num_proposed_drafts": 21, "spec_num_correct_drafts": 9}  # with `spec`


def generate_answer(body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """SGLang's answer to a /generate body: its ``output_ids`` (the stop token last, as SGLang returns them)
    and its finish reason. A prompt without LOOP_ID stops after 1..48 tokens, one with it loops to its budget."""
    prompt, params = body["input_ids"], body["sampling_params"]
    rng = random.Random(f"{params.get('sampling_seed')}/{json.dumps(prompt)}")
    limit = int(params["max_new_tokens"])
    if LOOP_ID in prompt:
        head = [rng.randrange(300, 4000) for _ in range(LOOP_HEAD)]
        return (head + list(LOOP_PERIOD) * limit)[:limit], {"type": "length", "length": limit}
    ids = [rng.randrange(300, 4000) for _ in range(rng.randint(1, min(48, limit - 1)))]
    return [*ids, STOP_ID], {"type": "stop", "matched": STOP_ID}


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
    token_seconds: float = 0.0  # /generate: the time one token takes
    incremental: bool = False  # /generate streams: each chunk holds its new tokens (incremental_streaming_output)
    spec: bool = False  # /generate: the last chunk carries speculative counts (SPEC), as a drafting server's
    generations: list[dict[str, Any]] = field(default_factory=list)  # /generate: body, generated, closed

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
                if self.path == "/generate":
                    faulty = (
                        standin.fault == "abort_503" and standin.first <= n and (not standin.last or n <= standin.last)
                    )
                    self._generate(body, faulty)
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

            def _generate(self, body: dict[str, Any], faulty: bool) -> None:
                record = {"body": body, "generated": 0, "closed": False, "ended": False}
                with standin.lock:
                    standin.generations.append(record)
                try:
                    self._generated(body, faulty, record)
                finally:
                    record["ended"] = True

            def _generated(self, body: dict[str, Any], faulty: bool, record: dict[str, Any]) -> None:
                ids, finish = generate_answer(body)
                if faulty:
                    with standin.lock:
                        standin.faults_sent += 1
                    ids, finish = ids[:3], {"type": "abort", "message": "Retry later.", "status_code": 503}
                if not body.get("stream"):
                    time.sleep(standin.token_seconds * len(ids))
                    record["generated"] = len(ids)
                    status = finish.get("status_code") or 200  # SGLang raises a whole request's abort as its status
                    answer = {"output_ids": ids, "meta_info": self._meta(len(ids), finish)}
                    self._send(status, json.dumps(answer if status == 200 else {"detail": finish["message"]}).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                interval, sent = int(body["sampling_params"].get("stream_interval") or 1), 0
                for i in range(1, len(ids) + 1):
                    if self._client_gone():  # uvicorn's disconnect: SGLang aborts the request here
                        record["closed"] = True
                        return
                    time.sleep(standin.token_seconds)
                    record["generated"] = i
                    if i < len(ids) and i - sent < interval and sent:
                        continue
                    meta = self._meta(i, finish if i == len(ids) else None)
                    chunk = {"output_ids": ids[sent:i] if standin.incremental else ids[:i], "meta_info": meta}
                    if not self._event(b"data: " + json.dumps(chunk).encode() + b"\n\n"):
                        record["closed"] = True
                        return
                    sent = i
                self._event(b"data: [DONE]\n\n")
                self._event(b"")  # the last, empty chunk of the chunked body

            def _meta(self, count: int, finish: dict[str, Any] | None) -> dict[str, Any]:
                meta = {"id": "standin", "finish_reason": finish, "prompt_tokens": 4, "completion_tokens": count}
                return {**meta, **SPEC} if standin.spec and finish is not None else meta

            def _event(self, data: bytes) -> bool:
                """One chunk of a chunked body; False when the client has gone."""
                try:
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                except OSError:
                    return False
                return True

            def _client_gone(self) -> bool:
                """The client closed its end: the connection reads as ended (as uvicorn sees a disconnect)."""
                conn = self.connection
                if not select.select([conn], [], [], 0)[0]:
                    return False
                try:
                    return conn.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

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

    def settled(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The /generate records once every request has ended here (a closed stream is seen a moment after
        the client has its answer)."""
        deadline = time.monotonic() + timeout
        while not all(g["ended"] for g in self.generations) and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.generations)

    def wait_while_frozen(self) -> None:
        while self.frozen.is_set() and self.server is not None:
            time.sleep(0.05)

    def stop(self) -> None:
        server, self.server = self.server, None  # a frozen handler sees it and ends
        if server is not None:
            server.shutdown()
            server.server_close()
