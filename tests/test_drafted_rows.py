"""Rows generated with engine.drafter: what the engine counted of each answer, placed on its tokens, and
carried into the dataset's optional columns lined up with loss_mask (the vLLM server's own runs:
tests/test_vllm_drafter.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash_build.config import ConfigError
from dflash_build.engines import registry
from dflash_build.engines.base import Acceptance
from dflash_build.stages import tokenize
from dflash_build.stages.generate.conversation import Turn
from dflash_build.stages.generate.work import row_acceptance
from tests.test_config import build, raw  # noqa: F401 (the config fixture)


def _counts(accepted: list[int], drafted: list[int]) -> Acceptance:
    return Acceptance(len(accepted), sum(drafted), sum(accepted), (), tuple(accepted), tuple(drafted))


def test_each_step_places_its_accepted_drafts_and_the_targets_own_token() -> None:
    # k 3: step 1 accepts 1 of 3 (then the target's correction), step 2 all 3 (then its bonus token)
    counts = _counts([1, 3], [3, 3])
    assert counts.marks(7) == [-1, 1, 0, 1, 1, 1, -1]
    assert counts.marks(4) == [-1, 1, 0, 1], "the answer stopped inside the last step's accepted drafts"
    assert counts.marks(8) is None, "an undrafted step (ngram without a match) is not reported: not placeable"
    assert counts.marks(2) is None, "a step after the answer's end: the counts are not this answer's"
    assert Acceptance(2, 6, 4).marks(7) is None, "totals only (SGLang's meta_info): nothing to place"


def test_a_rows_acceptance_round_trips_and_sums_over_its_turns() -> None:
    one = _counts([2, 0], [3, 3])
    assert Acceptance.of(one.as_dict()) == one and Acceptance.of(None) is None
    turns = [Turn([1], [2, 3], "stop", 9, acceptance=one), Turn([4], [5], "stop", 9, acceptance=_counts([1], [2]))]
    summed = row_acceptance(turns)
    assert summed is not None and (summed["steps"], summed["drafted"], summed["accepted"]) == (3, 8, 3)
    assert row_acceptance([turns[0], Turn([4], [5], "stop", 9)]) is None, "one turn unmeasured: the row is"


def _row(acceptance: dict[str, Any] | None, turns: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"prompt_ids": [7, 7, 7], "output_ids": [5, 6, 7, 8, 9, 10], "stop_token_id": 2, "finish_reason": "stop",
            "acceptance": acceptance, "turns": turns, "per_turn": None}  # fmt: skip


def test_the_draft_mark_lines_up_with_loss_mask() -> None:
    row = _row(_counts([1, 3], [3, 3]).as_dict())
    input_ids, loss_mask = tokenize.to_sample(row, "keep")  # type: ignore[misc]
    cols = tokenize.drafting(row, None)
    assert len(cols["draft_mark"]) == len(input_ids) == len(loss_mask)
    assert cols["draft_mark"] == [-1, -1, -1, -1, 1, 0, 1, 1, 1, -1]
    assert all(m == -1 for m, loss in zip(cols["draft_mark"], loss_mask, strict=True) if loss == 0)
    assert (cols["spec_steps"], cols["spec_drafted"], cols["spec_accepted"]) == (2, 6, 4)
    assert tokenize.drafting(_row(None), None) == dict.fromkeys(cols), "no drafter: null columns"


@pytest.mark.parametrize("per_turn", [False, True])
def test_a_conversations_marks_follow_each_turn(per_turn: bool) -> None:
    first, second = _counts([1], [1]), _counts([0], [2])
    turns = [
        {"context_ids": [7, 7], "output_ids": [5, 6], "stop_token_id": 2, "finish_reason": "stop",
         "acceptance": first.as_dict()},
        {"context_ids": [8], "output_ids": [9], "stop_token_id": 2, "finish_reason": "stop",
         "acceptance": second.as_dict()},
    ]  # fmt: skip
    row = {**_row(None, turns), "per_turn": per_turn}
    samples = [s for s in tokenize.to_samples(row, "keep") if not isinstance(s, str)]
    for turn, input_ids, loss_mask in samples:
        mark = tokenize.drafting(row, turn)["draft_mark"]
        assert len(mark) == len(input_ids) and [m for m, x in zip(mark, loss_mask, strict=True) if not x] == [-1] * (
            len(loss_mask) - sum(loss_mask)
        )
    marks = [tokenize.drafting(row, turn)["draft_mark"] for turn, _, _ in samples]
    if per_turn:  # turn 1's sample holds its whole prompt (here the row's own context ids)
        assert marks == [[-1, -1, -1, 1, -1], [-1, -1, 0]]
    else:
        assert marks == [[-1, -1, -1, 1, -1, -1, -1, 0]]


def _with_drafter(raw: dict[str, Any], device: str = "cpu", **drafter: Any) -> dict[str, Any]:  # noqa: F811
    out = copy.deepcopy(raw)
    out["engine"] = {"backend": "vllm", "options": {"device": device}}
    out["engine"]["drafter"] = {"method": "ngram", "options": {"num_speculative_tokens": 3, **drafter}}
    out["sampling"] = {"temperature": 0.0, "top_k": 0}
    return out


@pytest.mark.parametrize(
    ("edit", "key", "message"),
    [
        (lambda c: c["engine"]["drafter"].update(method="ngrm"), "engine.drafter.method", "did you mean 'ngram'"),
        # a lossy rejection would write answers that are not the target's into the training rows
        (lambda c: c["engine"]["drafter"]["options"].update(rejection_sample_method="fly"),
         "engine.drafter.options.rejection_sample_method", "'fly' accepts drafts the target's probabilities"),
        (lambda c: c["engine"].update(backend="transformers", options={}), "engine.drafter", "use sglang or vllm"),
        (lambda c: c["engine"]["options"].update(speculative_config={}), "engine.options.speculative_config",
         "engine.drafter sets it"),
        # the production config's sampling on vLLM's CPU build: refused at parse time, naming the source
        (lambda c: c.update(sampling={"temperature": 0.6, "top_k": 20}), "sources.a.sampling", "use top_k 0 on CPU"),
        (lambda c: c.update(sampling={"temperature": 0.6, "top_k": 0}), "sources.a.sampling",
         "does not keep the target's distribution"),
        (lambda c: c["sources"]["b"].update(sampling={"temperature": 0.6}), "sources.b.sampling", "temperature 0"),
    ],
)  # fmt: skip
def test_generation_with_a_drafter_is_refused_in_one_line(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    key: str,
    message: str,
) -> None:
    config = _with_drafter(raw)
    edit(config)
    with pytest.raises(ConfigError) as refused:
        build(config, tmp_path)
    assert refused.value.key == key and message in str(refused.value) and "\n" not in str(refused.value)


def test_a_drafter_enters_no_key_and_serves_generation_with_its_per_step_counts(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same keys with any drafter or none; the engine generation runs serves the drafter and reports each
    answer's steps (vLLM's detailed per-request metrics), and a GPU build takes the production sampling."""
    without = _with_drafter(raw)
    del without["engine"]["drafter"]
    plans = [build(c, tmp_path) for c in (without, _with_drafter(raw), _with_drafter(raw, prompt_lookup_max=2))]
    assert len({tuple(sp.gen_key for sp in p.sources.values()) for p in plans}) == 1
    served = registry.for_generation(plans[1].config.engine)
    assert served.options["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert served.options["per_request_spec_decode_metrics"] == "detailed"
    assert registry.for_generation(plans[0].config.engine) is plans[0].config.engine
    gpu = _with_drafter(raw, device="cuda")
    gpu["sampling"] = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert build(gpu, tmp_path).config.engine.drafter is not None


def test_status_reads_tau_from_a_running_jobs_journal_and_a_published_shards_sidecar(tmp_path: Path) -> None:
    from dflash_build.ops import status
    from dflash_build.store import records as R
    from dflash_build.store.journal import Journal

    journal = Journal(tmp_path, 1, 0.0)
    for i, counted in enumerate((_counts([3, 3], [3, 3]), _counts([0, 1], [3, 3]), None)):
        journal.append({"prompt_id": f"p{i}", "sample_idx": 0, "turn": 0, "output_ids": [1, 2], "at": 1.0,
                        "finish_reason": "stop", "acceptance": counted.as_dict() if counted else None})  # fmt: skip
    journal.close()
    running = status.SourceStatus("code", 10, True)
    status._journaled("code", "00000", tmp_path, 10, running, status._Window(2.0, 60.0), 2.0)
    assert (running.measured, running.spec_steps, running.spec_accepted) == (2, 4, 7), "the unmeasured row: not"
    published = status.SourceStatus("prose", 4, True)
    drafted = {"rows": 4, "steps": 10, "drafted": 30, "accepted": 5, "tau": 1.5}
    status._published(published, {R.STAT_INPUT_ROWS: 4, R.STAT_DRAFTING: drafted}, status._Window(2.0, 60.0))
    lines = status._drafting([running, published, status.SourceStatus("plain", 3, True)])
    assert lines == ["drafter: τ 1.86 tokens per verify step over 6 rows it served (code 2.75, prose 1.50)"]


def test_a_hybrid_target_on_vllms_cpu_build_needs_prefix_caching_off(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Measured on vLLM 0.32.0's CPU server (tests/test_vllm_hybrid.py serves one): with prefix caching on, a
    hybrid's server refuses to start, since this backend turns chunked prefill off there."""
    config = _with_drafter(raw)
    del config["engine"]["drafter"]
    model = Path(config["model"]["path"])
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "layer_types": ["linear_attention"]}))
    with pytest.raises(ConfigError) as refused:
        build(config, tmp_path)
    assert refused.value.key == "engine.options.enable_prefix_caching" and "Chunked prefill is required" in str(
        refused.value
    )
    config["engine"]["options"]["enable_prefix_caching"] = False
    assert build(config, tmp_path).config.engine.options["enable_prefix_caching"] is False
    config["engine"]["options"] = {"device": "cuda"}  # a GPU build: preflight says what it needs, no refusal
    build(config, tmp_path)


def test_the_datasets_tau_per_slice_is_accepts_figure_over_the_same_counts() -> None:
    """The card's slices use accept's figures: τ per token over the summed steps, τ per request over the
    rows with a verify step (a row counted with none, ngram without a match, is measured but not averaged)."""
    import pyarrow as pa

    from dflash_build.stages.mix.drafting import DraftTally
    from dflash_build.store import records as R

    rows = [
        {"language": "en", "spec_steps": 2, "spec_drafted": 6, "spec_accepted": 6, "spec_histogram": [0, 0, 0, 2]},
        {"language": "zh", "spec_steps": 4, "spec_drafted": 12, "spec_accepted": 2, "spec_histogram": [2, 2, 0, 0]},
        {"language": "zh", "spec_steps": 0, "spec_drafted": 0, "spec_accepted": 0, "spec_histogram": [0, 0, 0, 0]},
        {"language": "en", "spec_steps": None, "spec_drafted": None, "spec_accepted": None, "spec_histogram": None},
    ]
    schema = R.SAMPLE_SCHEMA
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema)
    tally = DraftTally()
    tally.add(table, "s", "coding", None)
    report = tally.report({"method": "ngram"})
    assert report is not None
    whole = report["slices"]["all"]
    assert (whole["rows"], whole["measured"], whole["steps"], whole["accepted"]) == (4, 3, 6, 8)
    assert whole["tau"] == round(1 + 8 / 6, 4) and whole["tau_per_request"] == round((4.0 + 1.5) / 2, 4)
    assert whole["per_position_steps"] == [4, 2, 2] and whole["per_position"] == [round(4 / 6, 4), 0.3333, 0.3333]
    assert report["slices"]["language=zh"]["tau_per_request"] == 1.5, "the row without a step is not averaged"
