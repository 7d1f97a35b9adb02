"""Every server fault seen in production, against the openai backend itself (a real HTTP server on
127.0.0.1 that misbehaves on demand): a passing fault is retried and never becomes data; a lasting one
fails with the server's address and its last answer, after yielding every row that finished before it.

The workflow around it (journal kept, the rerun generating only the rest, the dataset equal to an
undisturbed build's) is proven end to end once per outcome in tests/test_faults.py; the fault kinds
differ only inside the backend, which is what this module covers for each of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dflash_build.engines import Request, Result, SamplingParams
from dflash_build.engines.openai_backend import OpenAIEngine, ServerDown
from tests.standin_server import FAULTS, STOP_ID, StandIn

MODEL = "/models/tiny-model"
ROWS = 12


def _requests() -> list[Request]:
    params = SamplingParams(0.8, 0.95, 50, 0.0, 12)
    return [Request(f"p{i}", 0, [1, 300 + i, 301 + i, 7], params, seed=1000 + i) for i in range(ROWS)]


def _engine(url: str, **options: object) -> OpenAIEngine:
    opts = {"urls": [url], "prompt": "ids", "retries": 3, "backoff": 0.01, "timeout": 2, "concurrency": 2}
    return OpenAIEngine({**opts, **options}, [STOP_ID], None, MODEL)


def _by_row(results: list[Result]) -> dict[str, tuple[list[int], str, int | None]]:
    return {r.prompt_id: (r.output_ids, r.finish_reason, r.stop_token_id) for r in results}


@pytest.fixture
def standin() -> Iterator[StandIn]:
    server = StandIn(model_id="tiny-model").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def undisturbed() -> dict[str, tuple[list[int], str, int | None]]:
    server = StandIn(model_id="tiny-model").start()
    try:
        engine = _engine(server.url)
        try:
            return _by_row(list(engine.generate(_requests())))
        finally:
            engine.close()
    finally:
        server.stop()


def test_the_undisturbed_answers_are_real_rows(undisturbed: dict[str, tuple[list[int], str, int | None]]) -> None:
    assert len(undisturbed) == ROWS
    reasons = {reason for _, reason, _ in undisturbed.values()}
    assert reasons <= {"stop", "length"} and all(ids for ids, _, _ in undisturbed.values())


@pytest.mark.parametrize("fault", FAULTS)
def test_a_passing_fault_is_retried_and_never_becomes_data(
    standin: StandIn, undisturbed: dict[str, tuple[list[int], str, int | None]], fault: str
) -> None:
    standin.fault, standin.first, standin.last = fault, 3, 5
    engine = _engine(standin.url, timeout=1 if fault == "trickle" else 2)
    try:
        results = list(engine.generate(_requests()))
    finally:
        engine.close()
    assert standin.faults_sent == 3
    assert _by_row(results) == undisturbed
    assert all(r.error is None for r in results)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lasting_fault_fails_naming_the_server_after_the_rows_that_finished(
    standin: StandIn, undisturbed: dict[str, tuple[list[int], str, int | None]], fault: str
) -> None:
    standin.fault, standin.first = fault, 3  # the first two rows come back, then the server stays broken
    engine = _engine(standin.url, retries=1, timeout=1, concurrency=1)
    finished: list[Result] = []
    try:
        with pytest.raises(ServerDown) as err:
            for result in engine.generate(_requests()):
                finished.append(result)
    finally:
        engine.close()
    assert f"server {standin.url} failed /v1/completions after 2 attempts; last answer:" in str(err.value)
    assert _by_row(finished) == {pid: undisturbed[pid] for pid in ("p0", "p1")}
    assert standin.faults_sent == 2, "one request, tried twice, then the job stops sending"
