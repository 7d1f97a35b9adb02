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
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dflash_build.engines import registry
from dflash_build.engines.base import Request, Result
from dflash_build.engines.openai_http import (
    _SHOWN,
    APIS,
    PROMPT_MODES,
    EngineStalled,
    ServerClient,
    ServerDown,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)
BACKEND = registry.get("openai")
T = TypeVar("T")

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


class OpenAIEngine(ServerClient):
    def __init__(
        self,
        options: Mapping[str, Any],
        stop_token_ids: list[int],
        tokenizer: Any,
        model_path: str,
        stall_timeout: float | None = None,
        health_path: str = "/v1/models",
        pool: PoolHooks | None = None,
        loops_in_request: bool = False,
    ) -> None:
        super().__init__(loops_in_request)
        self.opts = _options(options)
        self.stop_token_ids = stop_token_ids
        self.tokenizer = tokenizer  # for text prompts and re-tokenized answers
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
            for url in self.opts["urls"]:
                self._run(self._first_contact(url, model_path))
            if not self._servers and pool is None:
                raise self._failure or ServerDown("no server")
        except BaseException:
            self.close()
            raise

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
