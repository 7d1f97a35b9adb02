"""engine.drafter's parity guard (issue 79, item 3): preflight compares the pilot's answers with the drafter and
without it, and generate refuses a drafter whose guard failed or has not run on this engine identity. The
comparison and the refusal here (unit tier, a stand-in engine for the planted failure); the real vLLM CPU
server's passing guard in tests/test_preflight.py."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_build.config import ConfigError
from dflash_build.engines import Request, Result, SamplingParams
from dflash_build.plan import Plan
from dflash_build.stages.generate import gate
from dflash_build.stages.preflight import parity
from dflash_build.store import atomic, layout
from tests.test_config import build, raw  # noqa: F401 (the config fixture)
from tests.test_drafted_rows import _with_drafter


def test_identical_answers_and_where_one_first_differs() -> None:
    same = [[1, 2, 3], [4, 5]]
    assert parity.identical(same, copy.deepcopy(same)) == {
        "answers": 2,
        "identical": 2,
        "share": 1.0,
        "first_differ": [],
    }
    drafted = [[1, 2, 3], [4, 5, 9, 9]]
    found = parity.identical(drafted, [[1, 2, 3], [4, 5, 6, 7]])
    assert found["identical"] == 1 and found["share"] == 0.5 and found["first_differ"] == [2], "parted at token 2"
    assert parity.first_difference([1, 2], [1, 2, 3]) == 2, "one runs on past the other's end"
    assert parity.greedy_problem("d", parity.identical(same, same), parity.identical(same, same), 0.125) is None
    line = parity.greedy_problem("d", found, parity.identical(same, same), 0.125)
    assert line is not None and "1 of 2 temperature-0 pilot answers are identical with and without it (50%" in line
    assert "agrees with itself on 100%" in line and "first differ at token 2" in line
    # the engine's own disagreement (one of two answers with itself) moves the bound: 50% passes then
    assert parity.greedy_problem("d", found, found, 0.125) is None


def test_sampled_answers_compare_by_length_finish_reasons_and_degenerate_share() -> None:
    plain = parity.Sample([40, 44, 38, 41, 43, 39, 42, 40], ["stop"] * 8, [False] * 8)
    near = parity.Sample([42, 39, 41, 44, 38, 40, 43, 41], ["stop"] * 7 + ["length"], [False] * 8)
    assert parity.sampled_problem(near, plain) is None, "within the sampler's spread"
    longer = parity.Sample([x + 30 for x in plain.lengths], ["stop"] * 8, [False] * 8)
    line = parity.sampled_problem(longer, plain)
    assert line is not None and "mean length 70.9 against 40.9 tokens" in line
    looping = parity.Sample(plain.lengths, ["length"] * 7 + ["stop"], [True] * 7 + [False])
    line = parity.sampled_problem(looping, plain)
    assert line is not None and "finish reason length 7 against 0 of 8" in line and "degenerate 7 against 0" in line


def _plan(raw: dict[str, Any], tmp_path: Path, **preflight: Any) -> Plan:  # noqa: F811
    config = _with_drafter(raw)
    config["preflight"] = preflight
    return build(config, tmp_path)


class Planted:
    """A stand-in engine server: answers each request with its prompt, but where it serves a drafter (its options
    hold the speculative config) its answers part from the target's at token 3, as a broken drafter's do."""

    def __init__(self, engine: Any) -> None:
        self.drafted = "speculative_config" in engine.options

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        for r in requests:
            out = list(r.prompt_ids) * 2
            if self.drafted and int(r.prompt_id) % 2 == 0:
                out[3] += 1
            yield Result(r.prompt_id, r.sample_idx, out, "stop", 0)

    def close(self) -> None:
        pass


def _requests(n: int) -> list[Request]:
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=8)
    return [Request(str(i), 0, [i, i + 1, i + 2], params, i) for i in range(n)]


def test_a_drafter_that_changes_the_answers_fails_in_one_line_naming_it(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planted failure through the guard's own path: the pilot's requests to the drafted engine and to the
    plain one (twice), compared, judged; the verdict keyed by the engine identity."""
    plan = _plan(raw, tmp_path)
    monkeypatch.setattr(parity, "pilot_requests", lambda plan: (_requests(8), [None] * 8))
    opened: list[bool] = []

    def open_engine(cfg: Any, stop_ids: Any, lease: Any, tok: Any, fp: Any, ctx: Any, engine: Any) -> Planted:
        assert not engine.shared and engine.drafter is None, "a server of its own, its drafter in its options"
        opened.append("speculative_config" in engine.options)
        return Planted(engine)

    monkeypatch.setattr(parity.engine_host, "open_engine", open_engine)
    monkeypatch.setattr(parity.chat, "load_tokenizer", lambda model, cache: None)
    monkeypatch.setattr(parity.chat, "stop_token_ids", lambda tok, path: [0])
    figures, [problem] = parity.guard(plan)
    assert opened == [True, False], "the drafted engine, then the plain one"
    assert figures["verdict"] == "FAIL" and figures["key"] == gate.identity_key(plan)
    assert json.loads(json.dumps(figures))["identity"]["drafter"]["method"] == "ngram", "the summary holds it"
    assert figures["temperature_0"]["itself"]["share"] == 1.0
    assert problem.level == "fail" and "\n" not in problem.line
    assert problem.line.startswith("engine.drafter (ngram) changes the target's answers on vllm: 4 of 8 ")
    assert "first differ at token 3, 3, 3, 3" in problem.line and "preflight.skip_parity" in problem.line
    monkeypatch.setattr(Planted, "__init__", lambda self, engine: setattr(self, "drafted", False))
    figures, problems = parity.guard(plan)
    assert problems == [] and figures["verdict"] == "PASS", "a drafter that leaves them alone passes"
    monkeypatch.setattr(parity, "pilot_requests", lambda plan: ([], []))
    figures, [problem] = parity.guard(plan)
    assert figures["verdict"] == "FAIL" and "no pilot request to compare" in problem.line, "nothing shown: no pass"


def _record(plan: Plan, verdict: str, key: str | None = None) -> None:
    cfg = plan.config
    path = Path(layout.preflight_summary(cfg.logs, cfg.dataset_name))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, {"verdict": verdict, "parity": {"key": key or gate.identity_key(plan), "verdict": verdict}})


def test_generate_refuses_a_drafter_without_a_passing_verdict_on_this_engine(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    plan = _plan(raw, tmp_path)
    with pytest.raises(ConfigError) as refused:
        gate.require(plan)
    said = str(refused.value)
    assert refused.value.key == "engine.drafter" and "no parity verdict" in said and "dflash-build preflight" in said
    assert "\n" not in said
    _record(plan, "FAIL")
    with pytest.raises(ConfigError, match="failed its parity guard"):
        gate.require(plan)
    _record(plan, "PASS")
    gate.require(plan)
    other = _with_drafter(raw, prompt_lookup_max=2)  # another drafter's options: another identity
    other["preflight"] = {}
    moved = build(other, tmp_path)
    assert gate.identity_key(moved) != gate.identity_key(plan)
    with pytest.raises(ConfigError, match="no parity verdict"):
        gate.require(moved)
    gate.require(_plan(raw, tmp_path, skip_parity=True))  # builds anyway (a warning; the card says so)
    without = copy.deepcopy(raw)
    gate.require(build(without, tmp_path))  # no drafter: nothing to guard


def test_the_card_says_the_guard_was_skipped() -> None:
    from dflash_build.publish import card

    slices = {"all": {"rows": 1, "measured": 1, "measured_share": 1.0, "tau": 2.0, "tau_per_request": 2.0,
                      "per_position": [1.0], "steps": 1, "accepted": 1}}  # fmt: skip
    manifest = {"drafting": {"slices": slices, "drafter": {"method": "ngram", "parity_skipped": True}}}
    assert card.PARITY_SKIPPED in card.drafting_section(manifest)
    manifest["drafting"]["drafter"] = {"method": "ngram"}
    assert card.PARITY_SKIPPED not in card.drafting_section(manifest)
    assert json.dumps(manifest)


def test_a_failing_guard_stops_preflight_before_the_pilot_journals_the_drafters_rows(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dflash_build.stages import preflight
    from dflash_build.stages.preflight import checks

    plan = _plan(raw, tmp_path)
    line = "engine.drafter (ngram) changes the target's answers on vllm: ..."
    monkeypatch.setattr(preflight, "before_engines", lambda plan: ({"at": 0.0}, []))
    monkeypatch.setattr(
        parity, "guard", lambda plan: ({"verdict": "FAIL"}, [checks.Problem(checks.FAIL, "parity", line)])
    )
    monkeypatch.setattr(preflight, "pilot", lambda plan: pytest.fail("the pilot ran after a failed guard"))
    summary = preflight.check(plan)
    assert summary["verdict"] == "FAIL" and summary["parity"] == {"verdict": "FAIL"}
    assert [p["line"] for p in summary["problems"]] == [line] and "pilot" not in summary


def test_the_summary_shows_the_guards_figures() -> None:
    from dflash_build.stages.preflight import checks

    t0 = {"drafted": parity.identical([[1, 2]], [[1, 3]]), "itself": parity.identical([[1, 2]], [[1, 2]])}
    drawn = {"lengths": [1, 2], "finishes": ["stop", "length"], "degenerate": [False, True]}
    found = {
        "verdict": "FAIL",
        "requests": 2,
        "temperature_0": t0,
        "sampled": {"drafted_sample": drawn, "plain_sample": drawn},
    }
    text = checks.render({"verdict": "FAIL", "problems": [], "parity": found})
    assert "## Parity of engine.drafter: FAIL" in text and "first differing tokens: 1" in text
    assert "- sampled, plain: mean length 1.5, length 1, stop 1, degenerate 1" in text
