"""The openai backend's servers as a pool (dflash_build.engines.openai_backend), against real HTTP
servers on 127.0.0.1 (tests/standin_server.py): a server that stops answering while it holds requests
(a SIGSTOPped process: nothing answers, its health check neither) leaves the pool within
``stall_timeout`` plus its health check and its requests go to the others; a busy one whose health
check answers stays; a dead one leaves at once; the pool's owner may replace a lost server and adds
servers that start later. Every time, the answers are the undisturbed ones, row for row.

The shared engines that own such a pool (kill, replace, join) are tested end to end, SIGSTOP
included, in tests/test_shared_engines.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dflash_build.engines import Request, Result, SamplingParams, openai_backend
from dflash_build.engines.openai_backend import EngineStalled, OpenAIEngine, PoolChange
from tests.standin_server import STOP_ID, StandIn

MODEL = "/models/tiny-model"
ROWS = 16
STALL = 1.0  # engine.stall_timeout here; the health check's deadline follows it


def _requests() -> list[Request]:
    params = SamplingParams(0.8, 0.95, 50, 0.0, 12)
    return [Request(f"p{i}", 0, [1, 300 + i, 301 + i, 7], params, seed=1000 + i) for i in range(ROWS)]


def _engine(urls: list[str], pool: object = None, **options: object) -> OpenAIEngine:
    opts = {"urls": urls, "prompt": "ids", "retries": 2, "backoff": 0.01, "timeout": 60, "concurrency": 2}
    return OpenAIEngine({**opts, **options}, [STOP_ID], None, MODEL, stall_timeout=STALL, pool=pool)  # type: ignore[arg-type]


def _run(engine: OpenAIEngine) -> dict[str, tuple[list[int], str]]:
    try:
        return {r.prompt_id: (r.output_ids, r.finish_reason) for r in engine.generate(_requests())}
    finally:
        engine.close()


class Owner:
    """A pool owner that records what it hears and hands out the servers it is given."""

    def __init__(self, replacement: StandIn | None = None, later: StandIn | None = None) -> None:
        self.replacement, self.later = replacement, later
        self.lost_calls: list[tuple[str, bool]] = []

    def lost(self, url: str, why: str, stalled: bool) -> PoolChange:
        self.lost_calls.append((url, stalled))
        if self.replacement is None:
            return PoolChange()
        self.replacement.start()  # a replacement takes a while to start; the pool goes on meanwhile
        return PoolChange(joined=[self.replacement.url])

    def refresh(self) -> PoolChange:
        if self.later is not None and self.later.server is not None:
            return PoolChange(joined=[self.later.url])
        return PoolChange()


@pytest.fixture
def servers() -> Iterator[list[StandIn]]:
    started: list[StandIn] = []  # _standin adds each server it makes; all stop after the test
    yield started
    for server in started:
        server.stop()


def _standin(servers: list[StandIn], start: bool = True, **kw: object) -> StandIn:
    server = StandIn(model_id="tiny-model", **kw)  # type: ignore[arg-type]
    servers.append(server)
    return server.start() if start else server


@pytest.fixture(scope="module")
def undisturbed() -> dict[str, tuple[list[int], str]]:
    server = StandIn(model_id="tiny-model").start()
    try:
        return _run(_engine([server.url]))
    finally:
        server.stop()


def test_a_stalled_server_leaves_the_pool_and_its_requests_go_to_the_others(
    servers: list[StandIn], undisturbed: dict[str, tuple[list[int], str]], caplog: pytest.LogCaptureFixture
) -> None:
    stalls, healthy = _standin(servers, freeze_after=3), _standin(servers)
    owner = Owner()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=openai_backend.__name__):
        got = _run(_engine([stalls.url, healthy.url], pool=owner))
    elapsed = time.monotonic() - start
    assert got == undisturbed, "the stalled server's requests were re-sent; nothing was lost or changed"
    assert owner.lost_calls == [(stalls.url, True)], "the owner hears once, as a stall (it may kill the engine)"
    assert healthy.completions == ROWS - 2, "all but the two rows the stalled server answered, each once"
    # stalled at its 3rd request: stall_timeout, then two health checks of up to STALL each, then a margin
    assert elapsed < STALL * 3 + 3, f"the stall was handled after {elapsed:.1f}s"
    [left] = [r.getMessage() for r in caplog.records if "leaves the pool" in r.getMessage()]
    assert left.startswith(f"{stalls.url} leaves the pool (stalled: no answer for ")
    assert "engine.stall_timeout 1s), and its health check /v1/models failed" in left


def test_the_stall_verdict_comes_within_the_documented_bound(
    servers: list[StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    """docs/generation.md: a silent server is named within stall_timeout plus a bounded health check
    (0.75 x stall_timeout here), measured from the moment it froze to the verdict's log record."""
    stall = 2.0
    stalls, healthy = _standin(servers, freeze_after=3), _standin(servers)
    opts = {"urls": [stalls.url, healthy.url], "prompt": "ids", "retries": 2, "backoff": 0.01, "timeout": 60}
    engine = OpenAIEngine({**opts, "concurrency": 2}, [STOP_ID], None, MODEL, stall_timeout=stall, pool=Owner())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger=openai_backend.__name__):
        _run(engine)
    [verdict] = [r for r in caplog.records if "leaves the pool (stalled" in r.getMessage()]
    took = verdict.created - stalls.frozen_at
    bound = openai_backend.stall_verdict_seconds(stall)
    assert bound == stall * 1.75, "below 10 s: one look a quarter of stall_timeout, two checks of a quarter each"
    assert openai_backend.stall_verdict_seconds(300.0) == 312.5, "the docs' 12.5 s at the production setting"
    # the last answer before the freeze came a moment earlier than the freeze itself: 0.3 s of slack
    assert stall <= took + 0.3 and took <= bound + 0.3, f"named {took:.2f}s after the freeze (bound {bound:.2f}s)"


def test_a_busy_server_whose_health_check_answers_stays_in_the_pool(
    servers: list[StandIn], undisturbed: dict[str, tuple[list[int], str]], caplog: pytest.LogCaptureFixture
) -> None:
    busy = _standin(servers, fault="hang", first=2, last=3, hang_seconds=2.5 * STALL)
    owner = Owner()
    with caplog.at_level(logging.WARNING, logger=openai_backend.__name__):
        got = _run(_engine([busy.url], pool=owner, health="/health"))  # engine.options.health
    assert got == undisturbed
    assert owner.lost_calls == [], "long answers are not a stall while the server's health check answers"
    assert any("its health check /health answers: busy with long answers" in r.getMessage() for r in caplog.records)
    assert busy.completions == ROWS, "nothing was sent twice"


def test_when_the_only_server_stalls_the_job_fails_naming_it_after_yielding_what_finished(
    servers: list[StandIn],
) -> None:
    stalls = _standin(servers, freeze_after=5)
    engine = _engine([stalls.url], concurrency=1)
    got: list[Result] = []
    start = time.monotonic()
    with pytest.raises(EngineStalled, match=rf"server {stalls.url} stalled: no answer for \d+s while it held 1 "):
        try:
            got.extend(engine.generate(_requests()))
        finally:
            engine.close()
    assert len(got) == 4, "every row answered before the stall is yielded (the job journals it)"
    assert time.monotonic() - start < STALL * 3 + 3


def test_a_dead_server_leaves_the_pool_at_once(
    servers: list[StandIn], undisturbed: dict[str, tuple[list[int], str]]
) -> None:
    dies, healthy = _standin(servers, delay_seconds=0.05), _standin(servers, delay_seconds=0.05)
    owner, dead_url = Owner(), dies.url
    # four in flight on the server that dies: their failures come back together, in one wait
    engine = _engine([dies.url, healthy.url], pool=owner, concurrency=4)
    got = {}
    try:
        for r in engine.generate(_requests()):
            got[r.prompt_id] = (r.output_ids, r.finish_reason)
            if len(got) == 3:
                dies.stop()  # connections refused from now on
    finally:
        engine.close()
    assert got == undisturbed
    assert owner.lost_calls == [(dead_url, False)], "a dead server is lost, not stalled: nothing to kill"


def test_the_owner_replaces_a_lost_server_and_the_pool_grows_with_servers_that_start_later(
    servers: list[StandIn], undisturbed: dict[str, tuple[list[int], str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_backend, "POOL_REFRESH_SECONDS", 0.2)
    stalls = _standin(servers, freeze_after=2, delay_seconds=0.05)
    replacement = _standin(servers, start=False, delay_seconds=0.4)  # slow: the run outlasts the later start
    later = _standin(servers, start=False, delay_seconds=0.05)
    owner = Owner(replacement=replacement, later=later)
    engine = _engine([stalls.url], pool=owner)
    # after the replacement came: the stall is named within stall_verdict_seconds of the freeze
    threading.Timer(openai_backend.stall_verdict_seconds(STALL) + 1.0, later.start).start()
    assert _run(engine) == undisturbed
    assert owner.lost_calls == [(stalls.url, True)]
    assert replacement.completions > 0, "the replacement took the stalled server's place"
    assert later.completions > 0, "a server that started during the run joined it"


def test_a_server_that_joined_the_pool_gets_the_model_name_it_serves(
    servers: list[StandIn], undisturbed: dict[str, tuple[list[int], str]]
) -> None:
    """The job's only server does not answer its first contact (so the job never read a model name), and
    the replacement, like vLLM, refuses a request naming a model it does not serve: every row comes back
    under the name the replacement lists (the fault soak on vLLM found every row of a shard journaled as
    an error row, "The model `default` does not exist", and the shard failed every rerun)."""
    with socket.socket() as s:  # a port nothing listens on: the server is down at the first contact
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    replacement = _standin(servers, start=False, only_its_model=True)
    owner = Owner(replacement=replacement)
    assert _run(_engine([down], pool=owner)) == undisturbed
    assert owner.lost_calls == [(down, False)] and replacement.completions == ROWS


def test_requests_that_fail_together_on_a_dying_server_are_all_sent_again(servers: list[StandIn]) -> None:
    """Every request in flight on a server fails in the same turn of the event loop (its process died
    with them): each is sent again exactly once, none is lost. (The engine's HTTP is replaced by a
    function here: what is tested is the pool's bookkeeping around it.)"""
    import asyncio

    from dflash_build.engines.openai_backend import ServerDown

    dying, healthy = _standin(servers), _standin(servers)
    engine = _engine([dying.url, healthy.url], pool=Owner(), concurrency=4)
    died = asyncio.Event()
    sent: list[tuple[str, str]] = []

    async def one(url: str, request: Request) -> Result:
        sent.append((url, request.prompt_id))
        if url == dying.url:
            await died.wait()  # released all at once
            raise ServerDown(f"server {url} failed /v1/completions after 1 attempts; last answer: ConnectError")
        if len(sent) >= 4 and not died.is_set():
            asyncio.get_running_loop().call_soon(died.set)
        return Result(request.prompt_id, request.sample_idx, [5], "stop", STOP_ID)

    engine._one = one  # type: ignore[method-assign]
    try:
        got = [r.prompt_id for r in engine.generate(_requests())]
    finally:
        engine.close()
    assert sorted(got) == sorted(r.prompt_id for r in _requests()), "every row once"
    on_dying = [p for u, p in sent if u == dying.url]
    assert len(on_dying) == 4 and all((healthy.url, p) in sent for p in on_dying), "each failed one sent again"
