"""The openai backend against a real third-party server: llama-cpp-python serving the SmolLM2 GGUF.

llama.cpp's /v1/completions takes text prompts only, so this exercises the fallback from token-id
prompts to rendered text and the re-tokenization accounting. `make setup` installs the server.
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_build.engines import Request, SamplingParams
from dflash_build.engines.openai_backend import OpenAIEngine, ServerDown
from dflash_build.engines.openai_http import ModelMismatch
from dflash_build.spec import ModelSpec
from dflash_build.stages.common import chat
from tests.conftest import TOOLS_TEMPLATE, Workflow, base_config, write_jsonl

pytest.importorskip("llama_cpp", reason="llama-cpp-python[server] is installed by make setup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path)),
                *("--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama.cpp server did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> object:
    return chat.load_tokenizer(ModelSpec(str(gguf_path), None, None, str(TOOLS_TEMPLATE), {}))


def _request(tokenizer: object, pid: str, text: str, max_new: int) -> Request:
    ids = chat.render(tokenizer, [{"role": "user", "content": text}], None, {})
    return Request(pid, 0, ids, SamplingParams(0.0, 1.0, 0, 0.0, max_new), seed=7)


@pytest.mark.workflow
def test_text_only_server_answers_through_the_fallback(server: str, tokenizer: object, gguf_path: Path) -> None:
    engine = OpenAIEngine({"urls": [server], "concurrency": 2}, [2], tokenizer, str(gguf_path))
    requests = [
        _request(tokenizer, "a", "Reply with the single word: yes", 24),
        _request(tokenizer, "b", "Write a long story about a dragon.", 8),
        _request(tokenizer, "c", "What is 2 + 2? Answer with a number.", 24),
    ]
    results = {r.prompt_id: r for r in engine.generate(requests)}
    engine.close()
    assert engine.prompt_mode == "text", "llama.cpp refuses token-id prompts; the backend falls back to text"
    assert engine.top_k_off == {server: 0}, "llama.cpp refuses top_k -1; 0 means no top-k there"
    assert set(results) == {"a", "b", "c"}
    assert results["b"].finish_reason == "length"
    assert results["a"].finish_reason == "stop" and results["a"].stop_token_id == 2
    for r in results.values():
        assert r.retokenized and r.output_ids and r.engine_output_tokens is not None
        assert len(tokenizer.decode(r.output_ids).strip()) > 0


@pytest.mark.workflow
def test_requests_spread_over_servers_within_their_concurrency(server: str, tokenizer: object, gguf_path: Path) -> None:
    """Two addresses of one server: each gets at most `concurrency` requests at once, and both get work."""
    seen: dict[str, int] = {}
    peak: dict[str, int] = {}
    urls = [server, server.replace("127.0.0.1", "localhost")]
    engine = OpenAIEngine({"urls": urls, "concurrency": 1, "prompt": "text"}, [2], tokenizer, str(gguf_path))
    active: dict[str, int] = {}
    lock = threading.Lock()
    original = engine._one

    async def counting(url: str, request: Request) -> object:
        with lock:
            active[url] = active.get(url, 0) + 1
            peak[url] = max(peak.get(url, 0), active[url])
            seen[url] = seen.get(url, 0) + 1
        try:
            return await original(url, request)
        finally:
            with lock:
                active[url] -= 1

    engine._one = counting  # type: ignore[method-assign]
    results = list(engine.generate([_request(tokenizer, f"r{i}", f"Say the number {i}.", 4) for i in range(6)]))
    engine.close()
    assert len(results) == 6
    assert len(seen) == 2 and all(n >= 1 for n in seen.values())
    assert all(p == 1 for p in peak.values())


def test_a_server_that_is_down_fails_clearly(tokenizer: object) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerDown, match=r"engine\.options\.urls.*" + url):
        OpenAIEngine({"urls": [url], "retries": 1, "backoff": 0.05}, [2], tokenizer, "model")


def test_busy_and_failing_responses_are_retried(tokenizer: object) -> None:
    """A stand-in that answers 503 and 429 before a real-shaped answer (unit test of the retry loop)."""
    calls: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._send(200, {"data": [{"id": "m"}]})

        def do_POST(self) -> None:
            calls.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            if len(calls) <= 2:
                self._send(503 if len(calls) == 1 else 429, {"error": "busy"})
            else:
                body = {
                    "choices": [{"token_ids": [7, 8, 2], "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 3},
                }
                self._send(200, body)

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{stub.server_address[1]}"
        options = {"urls": [url], "backoff": 0.01, "prompt": "ids", "expect_model": "m"}
        engine = OpenAIEngine(options, [2], tokenizer, "/models/served-as-m")
        [result] = engine.generate([_request(tokenizer, "a", "hi", 4)])
    finally:
        stub.shutdown()
    assert len(calls) == 3
    assert (result.output_ids, result.finish_reason, result.stop_token_id, result.retokenized) == (
        [7, 8],
        "stop",
        2,
        False,
    )


@pytest.mark.workflow
def test_workflow_on_the_server(server: str, gguf_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "q.jsonl", [{"q": "Say hello."}, {"q": "Name a fruit."}, {"q": "Count to three."}])
    sources = {
        "qs": {"category": "general", "files": [str(data / "q.jsonl")], "format": "prompt", "fields": {"prompt": "q"}}
    }
    config = base_config(gguf_path, sources)
    config["engine"] = {"backend": "openai", "options": {"urls": [server], "concurrency": 2}}
    config["sampling"].update(max_new_tokens=16, temperature=0.0)
    wf = Workflow(tmp_path / "work")
    wf.workdir.mkdir()
    wf.write_config(config)
    wf.build()
    [stats_file] = (wf.workdir / "store" / "completions").rglob("*.stats.json")
    stats = json.loads(stats_file.read_text())
    assert stats["input_rows"] == 3 and stats["retokenized_turns"] == 3
    assert 0.0 <= stats["retokenize_drift_rate"] <= 1.0
    assert stats["engine"]["backend"] == "openai" and stats["engine"]["gpu"] is None
    assert any(name.endswith(gguf_path.name) for name in stats["engine"]["served"][server])
    assert (wf.workdir / "dist" / "test-mix" / "manifest.json").exists()


@pytest.mark.workflow
def test_a_server_of_another_model_is_refused(server: str, tokenizer: object, gguf_path: Path) -> None:
    """The key names model.path's files; a server that serves anything else must not answer under it."""
    with pytest.raises(ModelMismatch, match=rf"server {server} serves .*{gguf_path.name}.*not model.path"):
        OpenAIEngine({"urls": [server]}, [2], tokenizer, "/models/Qwen3.6-27B")
    # a server that reports a served name is accepted when the config says which name that is
    engine = OpenAIEngine({"urls": [server], "expect_model": gguf_path.name}, [2], tokenizer, "/elsewhere/x")
    engine.close()


def test_every_sampling_knob_is_sent_so_no_server_default_applies() -> None:
    from dflash_build.engines.openai_http import completions_body

    request = Request("p", 0, [1, 2], SamplingParams(0.6, 0.95, 0, 0.0, 16), seed=9)
    body = completions_body(request, "m", [1, 2], [2])
    assert body["top_k"] == -1 and body["min_p"] == 0.0 and body["seed"] == 9
    assert body["repeat_penalty"] == body["repetition_penalty"] == 1.0
    assert body["frequency_penalty"] == body["presence_penalty"] == 0.0
