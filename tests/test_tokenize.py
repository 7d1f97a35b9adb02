from __future__ import annotations

import pytest

from dflash_build.stages import tokenize


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


def test_every_regenerated_turn_is_in_the_loss_mask() -> None:
    multi = {
        "finish_reason": "stop",
        "prompt_ids": [1, 5],
        "output_ids": [9],
        "stop_token_id": 2,
        "turns": [
            {"context_ids": [1, 5], "output_ids": [7, 8], "stop_token_id": 2, "finish_reason": "stop", "text": ""},
            {"context_ids": [3, 4], "output_ids": [9], "stop_token_id": 2, "finish_reason": "stop", "text": ""},
        ],
    }
    assert tokenize.to_sample(multi, "drop") == ([1, 5, 7, 8, 2, 3, 4, 9, 2], [0, 0, 1, 1, 1, 0, 0, 1, 1])


def test_reasoning_tokens_stay_in_the_answer() -> None:
    think = [151667, 40, 151668, 50]  # <think> x </think> y: all generated, all trained on
    assert tokenize.to_sample(row("stop", think, stop=2), "drop")[1] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_skipped_rows_are_dropped() -> None:
    assert tokenize.to_sample(row("skipped", []), "keep") == tokenize.DROP_SKIPPED
