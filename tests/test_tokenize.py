from __future__ import annotations

import pytest

from dflash_build import tokenize


def row(reason: str, output: list[int], stop: int | None = None) -> dict[str, object]:
    return {"finish_reason": reason, "prompt_ids": [1, 5, 6], "output_ids": output, "stop_token_id": stop}


def test_a_stopped_answer_ends_with_the_stop_token_it_emitted() -> None:
    assert tokenize.to_sample(row("stop", [7, 8], stop=2), "drop") == ([1, 5, 6, 7, 8, 2], [0, 0, 0, 1, 1, 1])
    assert tokenize.to_sample(row("stop", [], stop=2), "drop") == ([1, 5, 6, 2], [0, 0, 0, 1])


@pytest.mark.parametrize(
    ("reason", "policy", "expected"),
    [
        ("length", "drop", tokenize.DROP_TRUNCATED),
        ("length", "keep", ([1, 5, 6, 7, 8], [0, 0, 0, 1, 1])),
        ("error", "keep", tokenize.DROP_ENGINE_ERROR),
        ("abort", "keep", tokenize.DROP_ENGINE_ERROR),
    ],
)
def test_truncated_and_failed_rows(reason: str, policy: str, expected: object) -> None:
    assert tokenize.to_sample(row(reason, [7, 8]), policy) == expected


def test_an_empty_truncated_answer_is_dropped() -> None:
    assert tokenize.to_sample(row("length", []), "keep") == tokenize.DROP_EMPTY_ANSWER
