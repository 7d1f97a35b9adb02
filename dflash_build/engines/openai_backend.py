"""OpenAI-protocol backend: already-running servers (e.g. one ``sglang.launch_server`` per GPU).

Token ids go in and out where the server allows it: SGLang's native ``/generate`` takes
``input_ids`` and returns ``output_ids``; SGLang and vLLM accept token-id prompts on
``/v1/completions``. Otherwise (llama.cpp, for one) the rendered prompt goes as text and the answer
comes back as text, which is re-tokenized; each such row is marked, and rows whose re-tokenized
length differs from the server's own completion-token count are counted as drift in the stats.

Requests are spread over the servers with a bounded number in flight per server (httpx, async, one
pooled client). The servers are a pool: one that stops answering while it holds requests (no answer
for ``stall_timeout`` seconds and its health check fails: a stopped process, a deadlocked scheduler, a
wedged GPU) or that fails through every retry leaves it at once, and its requests go to the others;
the pool's owner (``PoolHooks``: the shared engines of engine_host) may kill and replace it, and adds
servers that start later. When no server is left, the job fails naming the last one.

A server fault is never data: each attempt has a total deadline (``timeout``, from connecting to the
last byte), and timeouts, broken connections, 408/429/5xx and answers that are not a well-formed
completion (not JSON, no choices, no tokens, more tokens than ``max_tokens``) are retried with
exponential backoff. When the retries run out, the server leaves the pool; with none left the job
fails with the server's address and its last answer; finished rows stay journaled. A request the
server refuses (other 4xx) is an error row, and one it keeps aborting an abort row: both count
against ``checks.max_failed_fraction``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dflash_build.engines import registry
from dflash_build.engines.base import EngineStalled as EngineMadeNoProgress
from dflash_build.engines.base import Request, Result
from dflash_build.engines.sglang_wire import parse_output, sampling_params

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)
BACKEND = registry.get("openai")
T = TypeVar("T")

APIS = ("completions", "generate")
PROMPT_MODES = ("auto", "ids", "text")
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# How servers refuse a token-id prompt (llama.cpp: a 500 validation error); busy answers are not refusals.
_REFUSAL_STATUS = frozenset({400, 415, 422, 500})
_SHOWN = 300  # characters of a server's answer quoted in errors
PROBE_SECONDS = 30.0  # first contact's deadline: SGLang's /health_generate itself gives up after 20 s
POOL_REFRESH_SECONDS = 10.0  # how often the pool's owner is asked for servers that started or went
# The stall verdict's health check: two attempts of at most this each (a quarter of stall_timeout when
# shorter). A server silent for stall_timeout has had its chance; the check only tells a busy one from a
# stopped one, and a live server answers its health path in well under a second.
HEALTH_CHECK_SECONDS = 5.0


def _tick_seconds(stall_timeout: float | None) -> float:
    """How often the pool looks at its servers (and so at their silence)."""
    return max(0.1, min(stall_timeout or POOL_REFRESH_SECONDS, POOL_REFRESH_SECONDS) / 4)


def health_check_seconds(stall_timeout: float) -> float:
    return min(HEALTH_CHECK_SECONDS, stall_timeout / 4)


def stall_verdict_seconds(stall_timeout: float) -> float:
    """The longest a silent server holding requests goes unnamed: ``stall_timeout``, then one look of the
    pool at most, then its two-attempt health check (docs/generation.md says so; a test measures it):
    ``stall_timeout`` + 12.5 s at most, + 0.75 x ``stall_timeout`` when that is less."""
    return stall_timeout + _tick_seconds(stall_timeout) + 2 * health_check_seconds(stall_timeout)


class ServerDown(RuntimeError):
    """A server did not answer usefully through every retry: the job fails, its journal stays."""

    timed_out = False  # its last attempt got no answer at all within the deadline (a stopped process)


class EngineStalled(ServerDown, EngineMadeNoProgress):
    """A server held requests without answering for ``stall_timeout`` and failed its health check."""


class HTTPFailure(Exception):
    """The server answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:_SHOWN]}")
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


class Malformed(Exception):
    """A 200 answer that is not a usable completion: retried like a 5xx, never stored."""


class Aborted(Exception):
    """A well-formed answer whose finish_reason says the server gave up on the request: retried."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.error)
        self.result = result


@dataclass
class PoolChange:
    """What the pool's owner did: servers that joined (they serve this job's identity and passed their
    own health check) and servers that are gone."""

    joined: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


class PoolHooks(Protocol):
    """The owner of a pool of servers (engine_host.ServedEngine). Called in threads of their own: they
    may block (starting an engine takes minutes) while the other servers go on."""

    def lost(self, url: str, why: str, stalled: bool) -> PoolChange:
        """``url`` left the pool (``stalled``: it holds requests and does not answer); may replace it."""
        ...

    def refresh(self) -> PoolChange:
        """Servers of the pool's identity that started since, and members that are gone."""
        ...


@dataclass(eq=False)
class _Server:
    url: str
    in_flight: int = 0
    quiet_since: float = 0.0  # its last answer, or when it was given work while it held none
    probe: asyncio.Future[str | None] | None = None
    probed_at: float = 0.0  # its last health check that answered


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    BACKEND.check(options)
    urls = options.get("urls")
    if isinstance(urls, str):
        urls = [urls]
    if not urls:
        raise ValueError("config key 'engine.options.urls': the openai backend needs the servers' base URLs")
    value = functools.partial(BACKEND.value, options)
    out = {
        "urls": [u.rstrip("/") for u in urls],
        **{name: value(name) for name in ("api", "model", "prompt", "expect_model", "health")},
        "concurrency": int(value("concurrency")),
        "retries": int(value("retries")),
        **{name: float(value(name)) for name in ("timeout", "backoff", "max_backoff")},
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
    return {"input_ids": request.prompt_ids, "sampling_params": sampling_params(request, stop_token_ids)}


class OpenAIEngine:
    def __init__(
        self,
        options: Mapping[str, Any],
        stop_token_ids: list[int],
        tokenizer: Any,
        model_path: str,
        stall_timeout: float | None = None,
        health_path: str = "/v1/models",
        pool: PoolHooks | None = None,
    ) -> None:
        self.opts = _options(options)
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer  # for text prompts and re-tokenized answers
        self.top_k_off: dict[str, int] = {}  # per server, once it refused the first spelling
        self.prompt_mode = "ids" if self.opts["api"] == "generate" else self.opts["prompt"]
        self.name = "the server " + ", ".join(self.opts["urls"])  # how warnings name it
        self.stall_timeout, self.pool = stall_timeout, pool
        self.health_path = self.opts["health"] or health_path
        # a SIGSTOPped server accepts connections and never answers: checks made here wait this long
        self.probe_seconds = min(PROBE_SECONDS, stall_timeout or PROBE_SECONDS)
        self.health_seconds = health_check_seconds(stall_timeout or PROBE_SECONDS)  # the stall verdict's
        self._servers = {url: _Server(url) for url in self.opts["urls"]}
        self._changes: set[asyncio.Future[PoolChange]] = set()  # the pool owner's answers still to come
        self._failure: ServerDown | None = None  # why the last server left
        self._refreshed = time.monotonic()
        # One event loop in a thread of its own: the driver's loop stays synchronous.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-backend", daemon=True)
        self._thread.start()
        self._client = self._run(self._open_client())
        try:
            self._model_ids: dict[str, list[str]] = {}  # /v1/models ids per server, read once
            self.identity: dict[str, list[str]] = {}
            for url in self.opts["urls"]:
                self._run(self._first_contact(url, model_path))
            if not self._servers and pool is None:
                raise self._failure or ServerDown("no server")
        except BaseException:
            self.close()
            raise
        first = self._model_ids.get(self.opts["urls"][0]) or []
        self.model_name = self.opts["model"] or (first[0] if first else "default")

    async def _first_contact(self, url: str, model_path: str) -> None:
        """Health and identity of a configured server; in a pool, one that does not answer just leaves it."""
        try:
            await self._health(url)
            self.identity[url] = await self._check_identity(url, model_path)
        except ServerDown as e:
            if self.pool is None:
                raise
            # accepted the connection, never answered: stopped or deadlocked, so its owner may kill it
            how = "stalled: no answer to its first health check" if e.timed_out else "not answering"
            self._leave(self._servers[url], f"{how} ({e})", stalled=e.timed_out, failure=e)

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    async def _open_client(self) -> httpx.AsyncClient:
        import httpx  # here, not at the top: 0.2 s that Snakemake and every command importing the package skip

        per_server = self.opts["concurrency"]
        del per_server  # the pool grows and shrinks: _generate bounds the requests in flight per server
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.opts["timeout"]), trust_env=False)

    async def _check_identity(self, url: str, model_path: str) -> list[str]:
        """What ``url`` serves; refuses a server whose model is not model.path's (the key names those files)."""
        answers = []
        for path in ("/v1/models", "/get_model_info"):
            try:
                answers.append(await self._call(url, path, None, retries=1, deadline=self.probe_seconds))
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
    async def _attempt(self, url: str, path: str, body: dict[str, Any] | None) -> Any:
        """One request: the JSON it answers, or the failure it is."""
        if body is None:
            response = await self._client.get(url + path)
        else:
            response = await self._client.post(url + path, json=body)
        text = response.text
        if response.status_code >= 400:
            if response.status_code not in _RETRY_STATUS:
                raise RequestRefused(response.status_code, text)
            if "validation error" in text:  # llama.cpp answers a bad request with a 500: no retry helps
                raise HTTPFailure(response.status_code, text)
            raise _Retry(f"HTTP {response.status_code}: {text[:_SHOWN]}", response.status_code)
        try:
            return json.loads(text)
        except ValueError:
            raise Malformed(f"HTTP {response.status_code} with a body that is not JSON: {text[:_SHOWN]!r}") from None

    async def _call(
        self,
        url: str,
        path: str,
        body: dict[str, Any] | None,
        retries: int | None = None,
        parse: Callable[[Any], T] | None = None,
        deadline: float | None = None,
    ) -> Any:
        """GET (no body) or POST, parsed by ``parse``; faults retried with backoff within a total deadline each."""
        import httpx

        attempts = (self.opts["retries"] if retries is None else retries) + 1
        deadline = deadline or self.opts["timeout"]
        delay = self.opts["backoff"]
        last, status = "", 0
        for attempt in range(attempts):
            try:
                answer = await asyncio.wait_for(self._attempt(url, path, body), deadline)
                return answer if parse is None else _parsed(parse, answer)
            except _Retry as e:
                last, status = str(e), e.status
            except Malformed as e:
                last, status = str(e), 0
            except Aborted as e:
                if attempt + 1 == attempts:
                    return e.result  # the server keeps giving up on this request: an abort row
                last, status = str(e), 0
            except (asyncio.TimeoutError, TimeoutError):
                last, status = f"no complete answer within the deadline of {deadline:g}s", 0
            except httpx.TransportError as e:  # refused, reset, closed mid-body, ...
                last, status = f"{type(e).__name__}: {e}", 0
            if attempt + 1 < attempts:
                log.warning("%s%s failed (%s); retry %d/%d in %.1fs", url, path, last, attempt + 1, attempts - 1, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.opts["max_backoff"])
        message = f"server {url} failed {path} after {attempts} attempts; last answer: {last}"
        if status:
            raise ServerError(status, message)
        down = ServerDown(message)
        down.timed_out = last.startswith("no complete answer within the deadline")
        raise down

    async def _health(self, url: str) -> None:
        try:
            await self._call(url, "/v1/models", None, retries=2, deadline=self.probe_seconds)
        except RequestRefused:
            pass  # it answers: some servers have no /v1/models
        except ServerDown as e:
            if self.pool is not None:
                raise
            raise ServerDown(f"config key 'engine.options.urls': {e}") from e

    # -- one request --------------------------------------------------------------------------
    async def _one(self, url: str, request: Request) -> Result:
        try:
            if self.opts["api"] == "generate":
                return await self._native(url, request)
            return await self._completion(url, request)
        except RequestRefused as e:
            return Result(request.prompt_id, request.sample_idx, [], "error", error=f"{url}: {e}")

    async def _native(self, url: str, request: Request) -> Result:
        def parse(out: Any) -> Result:
            out = out[0] if isinstance(out, list) and out else out
            if not isinstance(out, dict) or not isinstance(out.get("output_ids"), list):
                raise Malformed(f"not a /generate answer (no output_ids): {json.dumps(out)[:_SHOWN]}")
            return self._checked(request, parse_output(request, out, self.stop_token_ids), out)

        return await self._call(url, "/generate", generate_body(request, self.stop_token_ids), parse=parse)

    async def _completion(self, url: str, request: Request) -> Result:
        if self.prompt_mode == "auto":
            # Probe once, without retries: some servers refuse token-id prompts with a 4xx, others
            # (llama.cpp) with a 500 validation error. If the same request then works as text, the
            # server is text-only; if it does not, the first error stands.
            try:
                result = await self._post_completion(url, request, request.prompt_ids, retries=0)
            except HTTPFailure as refused:
                if refused.status not in _REFUSAL_STATUS:
                    raise
                try:
                    result = await self._text_completion(url, request)
                except HTTPFailure:
                    raise refused from None
                if self.prompt_mode == "auto":  # one event loop: no other task runs between these lines
                    log.warning("%s refuses token-id prompts (%s): sending rendered text from now on", url, refused)
                    self.prompt_mode = "text"
                return result
            if self.prompt_mode == "auto":
                self.prompt_mode = "ids"
            return result
        if self.prompt_mode == "ids":
            return await self._post_completion(url, request, request.prompt_ids)
        return await self._text_completion(url, request)

    async def _text_completion(self, url: str, request: Request) -> Result:
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        return await self._post_completion(url, request, text)

    async def _post_completion(
        self, url: str, request: Request, prompt: list[int] | str, retries: int | None = None
    ) -> Result:
        """POST /v1/completions; a server that refuses top_k -1 gets 0 ("disabled" too) from then on."""
        off = self.top_k_off.get(url, TOP_K_OFF[0])
        body = completions_body(request, self.model_name, prompt, self.stop_token_ids, off)

        def parse(out: Any) -> Result:
            return self._parse_completion(request, out)

        try:
            return await self._call(url, "/v1/completions", body, retries, parse)  # type: ignore[no-any-return]
        except HTTPFailure as e:
            if body["top_k"] != TOP_K_OFF[0] or "top_k" not in str(e):
                raise
            if url not in self.top_k_off:
                log.warning("%s refuses top_k %d (%s): sending %d for no top-k", url, off, e, TOP_K_OFF[1])
            self.top_k_off[url] = TOP_K_OFF[1]
            body["top_k"] = TOP_K_OFF[1]
            return await self._call(url, "/v1/completions", body, retries, parse)  # type: ignore[no-any-return]

    def _parse_completion(self, request: Request, out: Any) -> Result:
        """A /v1/completions answer as a Result; anything else is Malformed (retried, never stored)."""
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise Malformed(f"no choices in the answer: {json.dumps(out)[:_SHOWN]}")
        choice = choices[0]
        reason = choice.get("finish_reason")
        usage = out.get("usage")
        server_count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        ids = choice.get("token_ids")
        retokenized = ids is None
        if retokenized:
            text = choice.get("text")
            if not isinstance(text, str):
                raise Malformed(f"a choice with neither token_ids nor text: {json.dumps(choice)[:_SHOWN]}")
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise Malformed(f"token_ids are not a list of ints: {json.dumps(choice)[:_SHOWN]}")
        ids = list(ids)
        if reason == "stop":
            # Text answers carry no stop token; the server stopped on the model's end of turn.
            stop = ids.pop() if ids and ids[-1] in self.stop_token_ids else self.stop_token_ids[0]
            if server_count is not None and retokenized:
                server_count -= 1  # the server counts the stop token it emitted
            result = Result(request.prompt_id, request.sample_idx, ids, "stop", stop, None, retokenized, server_count)
        elif reason == "length":
            result = Result(request.prompt_id, request.sample_idx, ids, "length", None, None, retokenized, server_count)
        else:
            result = Result(request.prompt_id, request.sample_idx, ids, "abort", error=f"finish_reason {reason!r}")
        return self._checked(request, result, out)

    def _checked(self, request: Request, result: Result, out: Any) -> Result:
        """Refuse more tokens than asked for (a server that ignores max_tokens); retry what aborted."""
        limit = request.params.max_new_tokens
        # a re-tokenized answer may come out a token or two longer than the server's own count
        counted = result.engine_output_tokens if result.retokenized else len(result.output_ids)
        if counted is not None and counted > limit:
            raise Malformed(f"{counted} tokens for max_tokens {limit}: {json.dumps(out)[:_SHOWN]}")
        if result.finish_reason == "abort":
            raise Aborted(result)
        return result

    # -- Engine -------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """At most ``concurrency`` requests in flight per server, each to the least loaded one."""
        results: queue.Queue[Any] = queue.Queue()
        done = object()
        running = asyncio.run_coroutine_threadsafe(self._generate(iter(requests), results, done), self._loop)
        self._running = running
        try:
            while (item := results.get()) is not done:
                yield item
            if not running.cancelled():
                running.result()  # a ServerDown propagates: the job fails, the journal stays
        finally:
            running.cancel()
            self._running = None

    def interrupt(self) -> None:
        """Cancel the requests in flight (their connections close, so the servers stop them)."""
        running = getattr(self, "_running", None)
        if running is not None:
            running.cancel()  # thread-safe: the task is cancelled in the backend's loop

    async def _generate(self, todo: Iterator[Request], results: queue.Queue[Any], done: object) -> None:
        owner: dict[asyncio.Task[Result], tuple[_Server, Request]] = {}
        resend: deque[Request] = deque()  # requests of servers that left the pool go first
        exhausted = False

        def fill() -> None:
            nonlocal exhausted
            while self._servers:
                server = min(self._servers.values(), key=lambda s: s.in_flight)
                if server.in_flight >= self.opts["concurrency"]:
                    return
                request = resend.popleft() if resend else next(todo, None)
                if request is None:
                    exhausted = True
                    return
                if not server.in_flight:
                    server.quiet_since = time.monotonic()
                server.in_flight += 1
                owner[asyncio.ensure_future(self._one(server.url, request))] = (server, request)

        def leave(server: _Server, why: str, stalled: bool, failure: ServerDown) -> None:
            for task, (held_by, request) in list(owner.items()):
                if held_by is server and not task.done():  # a finished one is taken as it finished
                    task.cancel()
                    del owner[task]
                    resend.append(request)
            self._leave(server, why, stalled, failure)

        try:
            fill()
            while owner or resend or not exhausted:
                if not self._servers and not self._changes:
                    raise self._failure or ServerDown("no server is left in the pool")
                for task in await self._next_done(set(owner)):
                    if task not in owner:  # a change, a probe, or taken back when its server left
                        continue
                    server, request = owner.pop(task)
                    server.in_flight -= 1
                    try:
                        result = task.result()
                    except ServerDown as e:
                        resend.appendleft(request)
                        leave(server, str(e), stalled=False, failure=e)
                        continue
                    server.quiet_since = time.monotonic()
                    results.put(result)
                self._take_changes(leave)
                self._watch_stalls(leave)
                fill()
        finally:
            for task in owner:
                task.cancel()
            results.put(done)

    async def _next_done(self, requests: set[Any]) -> set[Any]:
        """What finished within a tick: requests, pool changes, health probes (any may be none)."""
        probes = {s.probe for s in self._servers.values() if s.probe is not None}
        waiting = requests | self._changes | probes
        if not waiting:  # nothing to wait for this turn (asyncio.wait refuses an empty set)
            await asyncio.sleep(self._tick())
            return set()
        return (await asyncio.wait(waiting, timeout=self._tick(), return_when=asyncio.FIRST_COMPLETED))[0]

    # -- the pool -----------------------------------------------------------------------------
    def _tick(self) -> float:
        return _tick_seconds(self.stall_timeout)

    def _leave(self, server: _Server, why: str, stalled: bool, failure: ServerDown) -> None:
        """``server`` leaves the pool (its requests were taken back); its owner hears of it."""
        if self._servers.get(server.url) is not server:
            return
        del self._servers[server.url]
        if server.probe is not None:
            server.probe.cancel()
        self._failure = failure
        rest = ", ".join(self._servers) or "none"
        log.warning("%s leaves the pool (%s); its requests go to the others (left: %s)", server.url, why, rest)
        if self.pool is not None:
            self._changes.add(_in_thread(self._loop, self.pool.lost, server.url, why, stalled))

    def _take_changes(self, leave: Callable[[_Server, str, bool, ServerDown], None]) -> None:
        """Apply what the pool's owner answered; ask it again every POOL_REFRESH_SECONDS."""
        for change in [c for c in self._changes if c.done()]:
            self._changes.discard(change)
            try:
                answer = change.result()
            except Exception as e:  # a failed replacement leaves the rest of the pool working
                log.warning("the engine pool could not change: %s: %s", type(e).__name__, e)
                continue
            for url in answer.gone:
                if url in self._servers:
                    leave(self._servers[url], "its engine is no longer running", False, ServerDown(f"{url} is gone"))
            for url in answer.joined:
                if url not in self._servers:
                    log.info("%s joins the pool", url)
                    self._servers[url] = _Server(url)
        if self.pool is not None and time.monotonic() - self._refreshed >= POOL_REFRESH_SECONDS:
            self._refreshed = time.monotonic()
            if not self._changes:
                self._changes.add(_in_thread(self._loop, self.pool.refresh))

    def _watch_stalls(self, leave: Callable[[_Server, str, bool, ServerDown], None]) -> None:
        """A server silent for ``stall_timeout`` while it holds requests is health-checked; failing, it leaves."""
        if not self.stall_timeout:
            return
        now = time.monotonic()
        for server in list(self._servers.values()):
            silent = now - server.quiet_since
            if server.probe is not None and server.probe.done():
                failed, server.probe = server.probe.result(), None
                if failed is None:
                    server.probed_at = now
                    log.warning(
                        "%s: no answer for %.0fs with %d requests in flight, but its health check %s answers: "
                        "busy with long answers, not stalled",
                        server.url,
                        silent,
                        server.in_flight,
                        self.health_path,
                    )
                    continue
                why = (
                    f"stalled: no answer for {silent:.0f}s while it held {server.in_flight} requests "
                    f"(engine.stall_timeout {self.stall_timeout:g}s), and its health check {self.health_path} {failed}"
                )
                leave(server, why, True, EngineStalled(f"server {server.url} {why}"))
            elif (
                server.in_flight
                and server.probe is None
                and now - max(server.quiet_since, server.probed_at) >= (self.stall_timeout)
            ):
                server.probe = asyncio.ensure_future(self._probe(server.url))

    async def _probe(self, url: str) -> str | None:
        """None if ``url`` answers its health check with a 2xx (an empty body is an answer: SGLang's
        /health has none), at the first or second attempt within the deadline each; else how it failed."""
        import httpx

        last = ""
        for _ in range(2):
            try:
                response = await asyncio.wait_for(self._client.get(url + self.health_path), self.health_seconds)
            except (asyncio.TimeoutError, TimeoutError):
                last = f"no answer within {self.health_seconds:g}s"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if response.status_code < 400:
                    return None
                last = f"HTTP {response.status_code}: {response.text[:_SHOWN]}"
        return f"failed ({last})"

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if getattr(self, "_client", None) is not None:
            self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


class _Retry(Exception):
    """A status worth asking again (busy, overloaded, a gateway in between)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _in_thread(loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a daemon thread, as a future of ``loop`` (a pending replacement never holds up
    the job's exit, as the default executor's threads would)."""
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # handed to the loop, which decides
            error = e
            loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(error))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(value))

    threading.Thread(target=run, name=f"pool {getattr(fn, '__name__', 'change')}", daemon=True).start()
    return future


def _parsed(parse: Callable[[Any], T], answer: Any) -> T:
    """``parse(answer)``; an answer of an unexpected shape is Malformed (retried), not a crash."""
    try:
        return parse(answer)
    except (Malformed, Aborted):
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise Malformed(f"unexpected answer ({type(e).__name__}: {e}): {json.dumps(answer)[:_SHOWN]}") from e
