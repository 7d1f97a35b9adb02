"""OpenAI-protocol backend: already-running servers (e.g. one ``sglang.launch_server`` per GPU).

Token ids go in and out where the server allows it: SGLang's native ``/generate`` takes
``input_ids`` and returns ``output_ids``; SGLang and vLLM accept token-id prompts on
``/v1/completions``. Otherwise (llama.cpp, for one) the rendered prompt goes as text and the answer
comes back as text, which is re-tokenized; each such row is marked, and rows whose re-tokenized
length differs from the server's own completion-token count are counted as drift in the stats.

Requests are spread over the servers with a bounded number in flight per server. Timeouts, 429 and
5xx are retried with exponential backoff; a server that does not answer its health check, or that
stays down through every retry, fails the job with its address (finished rows stay journaled).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from dflash_build.engines import Request, Result

log = logging.getLogger(__name__)

KNOWN_OPTIONS = frozenset(
    {"urls", "api", "model", "prompt", "concurrency", "timeout", "retries", "backoff", "max_backoff", "expect_model"}
)
APIS = ("completions", "generate")
PROMPT_MODES = ("auto", "ids", "text")
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# How servers refuse a token-id prompt (llama.cpp: a 500 validation error); busy answers are not refusals.
_REFUSAL_STATUS = frozenset({400, 415, 422, 500})


class ServerDown(RuntimeError):
    pass


class HTTPFailure(Exception):
    """The server answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class ModelMismatch(RuntimeError):
    """A server serves another model than model.path: its answers would be stored under the wrong key."""


class RequestRefused(HTTPFailure):
    """A 4xx the server will not change its mind about (bad prompt, prompt too long, ...)."""


class ServerError(ServerDown, HTTPFailure):
    """A 5xx or 429 that outlasted every retry."""

    def __init__(self, status: int, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.status = status


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise ValueError(
            f"config key 'engine.options': unknown openai options {sorted(unknown)} (known: {sorted(KNOWN_OPTIONS)})"
        )
    urls = options.get("urls")
    if isinstance(urls, str):
        urls = [urls]
    if not urls:
        raise ValueError("config key 'engine.options.urls': the openai backend needs the servers' base URLs")
    out = {
        "urls": [u.rstrip("/") for u in urls],
        "api": options.get("api", "completions"),
        "model": options.get("model"),
        "prompt": options.get("prompt", "auto"),
        "concurrency": int(options.get("concurrency", 16)),
        "timeout": float(options.get("timeout", 600)),
        "retries": int(options.get("retries", 5)),
        "backoff": float(options.get("backoff", 0.5)),
        "max_backoff": float(options.get("max_backoff", 30)),
        "expect_model": options.get("expect_model"),
    }
    if out["api"] not in APIS:
        raise ValueError(f"config key 'engine.options.api': '{out['api']}' is not one of {APIS}")
    if out["prompt"] not in PROMPT_MODES:
        raise ValueError(f"config key 'engine.options.prompt': '{out['prompt']}' is not one of {PROMPT_MODES}")
    return out


# "No top-k" is -1 for SGLang and vLLM; llama.cpp refuses -1 and means the same by 0.
TOP_K_OFF = (-1, 0)


def completions_body(
    request: Request, model: str, prompt: list[int] | str, stop_token_ids: list[int], top_k_off: int = -1
) -> dict[str, Any]:
    p = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "min_p": p.min_p,
        # sent even when disabled: leaving it out would apply the server's own default
        "top_k": p.top_k if p.top_k > 0 else top_k_off,
        "seed": request.seed,
        # Servers' own defaults are not ours (llama.cpp's repeat_penalty is 1.1): every knob is sent.
        "repetition_penalty": 1.0,
        "repeat_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": list(stop_token_ids),
        "skip_special_tokens": False,
        "return_token_ids": True,  # vLLM: token ids of the answer in the response
    }
    return body


def served_identities(models: Any, model_info: Any) -> list[str]:
    """What a server says it serves: /v1/models ids and roots (vLLM), SGLang's /get_model_info path."""
    names: list[str] = []
    for entry in (models or {}).get("data") or []:
        names += [str(entry[k]) for k in ("id", "root") if isinstance(entry, dict) and entry.get(k)]
    if isinstance(model_info, dict) and model_info.get("model_path"):
        names.append(str(model_info["model_path"]))
    return names


def matches_model(served: list[str], model_path: str, expect: str | None) -> bool:
    """A served name is model.path, ends with its folder or file name, or is the name the config expects."""
    wanted = {model_path.rstrip("/"), os.path.basename(model_path.rstrip("/"))}
    if expect:
        wanted.add(expect)
    return any(name.rstrip("/") in wanted or os.path.basename(name.rstrip("/")) in wanted for name in served)


def generate_body(request: Request, stop_token_ids: list[int]) -> dict[str, Any]:
    """SGLang's native /generate takes the in-process engine's sampling params as they are."""
    from dflash_build.engines.sglang_backend import sampling_params

    return {"input_ids": request.prompt_ids, "sampling_params": sampling_params(request, stop_token_ids)}


class OpenAIEngine:
    def __init__(self, options: Mapping[str, Any], stop_token_ids: list[int], tokenizer: Any, model_path: str) -> None:
        self.opts = _options(options)
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer  # for text prompts and re-tokenized answers
        self._mode_lock = threading.Lock()
        self.top_k_off: dict[str, int] = {}  # per server, once it refused the first spelling
        self.prompt_mode = "ids" if self.opts["api"] == "generate" else self.opts["prompt"]
        for url in self.opts["urls"]:
            self._health(url)
        self._model_ids: dict[str, list[str]] = {}  # /v1/models ids per server, read once
        self.identity = {url: self._check_identity(url, model_path) for url in self.opts["urls"]}
        first = self._model_ids[self.opts["urls"][0]]
        self.model_name = self.opts["model"] or (first[0] if first else "default")
        self.pool = ThreadPoolExecutor(max_workers=self.opts["concurrency"] * len(self.opts["urls"]))

    def _check_identity(self, url: str, model_path: str) -> list[str]:
        """What ``url`` serves; refuses a server whose model is not model.path's (the key names those files)."""
        answers = []
        for path in ("/v1/models", "/get_model_info"):
            try:
                answers.append(self._call(url, path, None, retries=1))
            except (RequestRefused, ServerDown):
                answers.append(None)
        self._model_ids[url] = [
            e["id"] for e in (answers[0] or {}).get("data") or [] if isinstance(e, dict) and "id" in e
        ]
        served = served_identities(*answers)
        if not matches_model(served, model_path, self.opts["expect_model"]):
            raise ModelMismatch(
                f"server {url} serves {served or 'a model it does not name'}, not model.path '{model_path}': "
                "its answers would be stored under that model's key. Point engine.options.urls at servers of "
                "model.path, or set engine.options.expect_model to the name the server reports for it."
            )
        return served

    # -- HTTP ---------------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: dict[str, Any] | None, retries: int | None = None) -> Any:
        """POST (or GET without body) with retries on timeouts, 429 and 5xx."""
        attempts = (self.opts["retries"] if retries is None else retries) + 1
        delay = self.opts["backoff"]
        last: Exception | None = None
        status, text = 0, ""
        for attempt in range(attempts):
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.opts["timeout"]) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")
                if e.code not in _RETRY_STATUS:
                    raise RequestRefused(e.code, text) from e
                if "validation error" in text:  # llama.cpp answers a bad request with a 500: no retry helps
                    raise HTTPFailure(e.code, text) from e
                status, last = e.code, RuntimeError(f"HTTP {e.code}: {text[:200]}")
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = e
            if attempt + 1 < attempts:
                log.warning("%s%s failed (%s); retry %d/%d in %.1fs", url, path, last, attempt + 1, attempts - 1, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.opts["max_backoff"])
        if status:
            raise ServerError(status, f"server {url} failed {path} after {attempts} attempts: {last}")
        raise ServerDown(f"server {url} failed {path} after {attempts} attempts: {last}")

    def _health(self, url: str) -> None:
        try:
            self._call(url, "/v1/models", None, retries=2)
        except RequestRefused:
            pass  # it answers: some servers have no /v1/models
        except ServerDown as e:
            raise ServerDown(f"config key 'engine.options.urls': {e}") from e

    # -- one request --------------------------------------------------------------------------
    def _one(self, url: str, request: Request) -> Result:
        try:
            if self.opts["api"] == "generate":
                return self._native(url, request)
            return self._completion(url, request)
        except RequestRefused as e:
            return Result(request.prompt_id, request.sample_idx, [], "error", error=f"{url}: {e}")

    def _native(self, url: str, request: Request) -> Result:
        from dflash_build.engines.sglang_backend import parse_output

        out = self._call(url, "/generate", generate_body(request, self.stop_token_ids))
        out = out[0] if isinstance(out, list) else out
        return parse_output(request, out, self.stop_token_ids)

    def _completion(self, url: str, request: Request) -> Result:
        if self.prompt_mode == "auto":
            # Probe once, without retries: some servers refuse token-id prompts with a 4xx, others
            # (llama.cpp) with a 500 validation error. If the same request then works as text, the
            # server is text-only; if it does not, the first error stands.
            try:
                out = self._post_completion(url, request, request.prompt_ids, retries=0)
            except HTTPFailure as refused:
                if refused.status not in _REFUSAL_STATUS:
                    raise
                try:
                    result = self._parse_completion(request, self._text_completion(url, request))
                except HTTPFailure:
                    raise refused from None
                with self._mode_lock:
                    if self.prompt_mode == "auto":
                        log.warning("%s refuses token-id prompts (%s): sending rendered text from now on", url, refused)
                        self.prompt_mode = "text"
                return result
            with self._mode_lock:
                if self.prompt_mode == "auto":
                    self.prompt_mode = "ids"
        elif self.prompt_mode == "ids":
            out = self._post_completion(url, request, request.prompt_ids)
        else:
            out = self._text_completion(url, request)
        return self._parse_completion(request, out)

    def _text_completion(self, url: str, request: Request) -> Any:
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        return self._post_completion(url, request, text)

    def _post_completion(self, url: str, request: Request, prompt: list[int] | str, retries: int | None = None) -> Any:
        """POST /v1/completions; a server that refuses top_k -1 gets 0 ("disabled" too) from then on."""
        off = self.top_k_off.get(url, TOP_K_OFF[0])
        body = completions_body(request, self.model_name, prompt, self.stop_token_ids, off)
        try:
            return self._call(url, "/v1/completions", body, retries)
        except HTTPFailure as e:
            if body["top_k"] != TOP_K_OFF[0] or "top_k" not in str(e):
                raise
            with self._mode_lock:
                if url not in self.top_k_off:
                    log.warning("%s refuses top_k %d (%s): sending %d for no top-k", url, off, e, TOP_K_OFF[1])
                self.top_k_off[url] = TOP_K_OFF[1]
            body["top_k"] = TOP_K_OFF[1]
            return self._call(url, "/v1/completions", body, retries)

    def _parse_completion(self, request: Request, out: Mapping[str, Any]) -> Result:
        choice = (out.get("choices") or [{}])[0]
        reason = choice.get("finish_reason")
        server_count = (out.get("usage") or {}).get("completion_tokens")
        ids = choice.get("token_ids")
        retokenized = ids is None
        if retokenized:
            ids = list(self.tokenizer(choice.get("text") or "", add_special_tokens=False)["input_ids"])
        ids = [int(t) for t in ids]
        if reason == "stop":
            # Text answers carry no stop token; the server stopped on the model's end of turn.
            stop = ids.pop() if ids and ids[-1] in self.stop_token_ids else self.stop_token_ids[0]
            if server_count is not None and retokenized:
                server_count -= 1  # the server counts the stop token it emitted
            return Result(request.prompt_id, request.sample_idx, ids, "stop", stop, None, retokenized, server_count)
        if reason == "length":
            return Result(request.prompt_id, request.sample_idx, ids, "length", None, None, retokenized, server_count)
        return Result(request.prompt_id, request.sample_idx, ids, "abort", error=f"finish_reason {reason!r}")

    # -- Engine -------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """At most ``concurrency`` requests in flight per server, each to the least loaded one."""
        per_server = self.opts["concurrency"]
        in_flight = dict.fromkeys(self.opts["urls"], 0)
        owner: dict[Future[Result], str] = {}
        todo = iter(requests)

        def fill() -> None:
            while True:
                url = min(in_flight, key=in_flight.__getitem__)
                if in_flight[url] >= per_server:
                    return
                request = next(todo, None)
                if request is None:
                    return
                in_flight[url] += 1
                owner[self.pool.submit(self._one, url, request)] = url

        fill()
        while owner:
            done, _ = wait(owner, return_when=FIRST_COMPLETED)
            for future in done:
                in_flight[owner.pop(future)] -= 1
                yield future.result()  # ServerDown propagates: the job fails, the journal stays
            fill()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
