"""Generation served with a drafter (config engine.drafter) on vLLM 0.32.0's CPU server: the target drafting
for itself at temperature 0 writes the rows the plain server writes, every row carries the engine's counts
(every drafted token accepted), the dataset's draft_mark lines up with loss_mask, the card shows τ per slice,
and a drafter switched on, off or to another generates nothing (it enters no key)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_build.store import layout
from tests.conftest import Workflow, base_config, completion_rows, shared_engine
from tests.test_vllm import vllm_config

pytestmark = pytest.mark.workflow

SELF_DRAFT_K = 3


def _greedy(model: Path, data: Path) -> dict[str, Any]:
    config = vllm_config(model, data)
    config["sampling"].update(temperature=0.0, top_k=0)  # the pinned CPU build's speculation: greedy only
    config["sampling"]["max_new_tokens"] = 16
    return config


def _drafted(model: Path, data: Path, drafter: dict[str, Any] | None) -> dict[str, Any]:
    config = _greedy(model, data)
    # an engine of its own (another max_inflight: another test slot), as a drafter is another server
    config["engine"] = {**shared_engine(model, "vllm", max_inflight=8), "drafter": drafter}
    config["preflight"] = {"skip_parity": True}  # its parity guard: tests/test_preflight.py
    return config


def _self_drafter(model: Path) -> dict[str, Any]:
    return {"method": "draft_model", "path": str(model), "options": {"num_speculative_tokens": SELF_DRAFT_K}}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path) -> tuple[Workflow, Workflow]:
    """The same greedy build twice: on the plain server, and with the target drafting for itself."""
    root = tmp_path_factory.mktemp("drafter")
    plain = Workflow.at(root / "plain", _greedy(vllm_model, root / "data"))
    drafted = Workflow.at(root / "drafted", _drafted(vllm_model, root / "data", _self_drafter(vllm_model)))
    plain.build()
    drafted.build()
    return plain, drafted


def _rows(store: Path) -> list[dict[str, Any]]:
    return [r for p in sorted((store / "completions").rglob("0*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_the_target_drafting_for_itself_writes_the_plain_servers_rows(builds: tuple[Workflow, Workflow]) -> None:
    plain, drafted = builds
    without, with_ = completion_rows(plain.workdir / "store"), completion_rows(drafted.workdir / "store")
    assert with_.keys() == without.keys() and len(with_) == 14
    differing = [k for k in with_ if with_[k] != without[k]]
    assert differing == [], f"greedy rows that differ with the drafter: {differing}"
    for row in _rows(drafted.workdir / "store"):
        for turn in row["turns"] or [row]:
            counted = turn["acceptance"]
            generated = len(turn["output_ids"]) + (turn["stop_token_id"] is not None)
            assert counted is not None and counted["steps"] >= 1, (row["prompt_id"], generated)
            assert counted["accepted"] == counted["drafted"] == SELF_DRAFT_K * counted["steps"], "all accepted"
            assert counted["accepted_steps"] == [SELF_DRAFT_K] * counted["steps"], "each step, in order"
    assert all(r["acceptance"] is None for r in _rows(plain.workdir / "store")), "no drafter: no counts"
    sidecar = json.loads(next((drafted.workdir / "store" / "completions").rglob(f"*{layout.SIDECAR}")).read_text())
    assert sidecar["engine"]["drafter"]["method"] == "draft_model"
    assert sidecar["drafting"]["tau"] == SELF_DRAFT_K + 1
    said = drafted.cli("status").stdout
    assert f"drafter: τ {SELF_DRAFT_K + 1:.2f} tokens per verify step over 14 rows it served" in said, said
    assert "drafter:" not in plain.cli("status").stdout


def test_the_datasets_draft_mark_lines_up_with_loss_mask_and_the_card_shows_tau(
    builds: tuple[Workflow, Workflow],
) -> None:
    _, drafted = builds
    dataset = drafted.workdir / "dist" / "test-mix"
    samples = [r for p in sorted((dataset / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert samples
    for s in samples:
        mark, loss = s["draft_mark"], s["loss_mask"]
        assert len(mark) == len(loss) == len(s["input_ids"])
        assert all(m == -1 for m, x in zip(mark, loss, strict=True) if x == 0), "nothing marked outside the answers"
        assert 0 not in mark, "the target drafting for itself: no draft turned down"
        assert mark.count(1) <= s["spec_accepted"], "each accepted draft in the sample, at most once"
    manifest = json.loads((dataset / layout.MANIFEST).read_text())
    whole = manifest["drafting"]["slices"]["all"]
    assert whole["measured"] == whole["rows"] == len(samples) and whole["tau"] == SELF_DRAFT_K + 1
    assert manifest["drafting"]["slices"]["category=agent"]["per_position"] == [1.0] * SELF_DRAFT_K
    card = (dataset / "README.md").read_text()
    assert "## Acceptance in generation" in card and "| category=general |" in card


def test_switching_the_drafter_on_off_or_to_another_generates_nothing(
    builds: tuple[Workflow, Workflow], vllm_model: Path, tmp_path: Path
) -> None:
    plain, drafted = builds
    data = drafted.workdir.parent / "data"
    ngram = {"method": "ngram", "options": {"num_speculative_tokens": 2, "prompt_lookup_max": 3}}
    for wf, drafter in ((drafted, None), (drafted, ngram), (plain, _self_drafter(vllm_model))):
        copy_ = wf.copy_to(tmp_path / f"copy-{len(list(tmp_path.iterdir()))}")
        config = _drafted(vllm_model, data, drafter) if drafter is not None else _greedy(vllm_model, data)
        copy_.write_config(copy.deepcopy(config))
        assert "total: 0 generate jobs" in copy_.cli("plan").stdout, drafter
        assert "generate" not in copy_.dry_run(), drafter


def test_ngram_accepts_more_on_repetitive_code_than_on_prose(tmp_path: Path, smollm2: Path) -> None:
    """SmolLM2-135M-Instruct on vLLM's CPU server, greedy, served with ngram (prompt lookup): the code rows
    (asked to repeat code) accept more drafts than the prose rows, per row and in the card's slices."""
    from tests.test_accept import NGRAM, accept_config

    config = accept_config(smollm2, tmp_path / "data", None)
    config["sampling"]["max_new_tokens"] = 48
    config["sources"]["code"]["max_samples"] = config["sources"]["prose"]["max_samples"] = 4
    config["engine"] = {**config["engine"], "drafter": NGRAM}
    config["preflight"] = {"skip_parity": True}
    wf = Workflow.at(tmp_path / "work", config)
    wf.build()
    tau: dict[str, list[float]] = {}
    rows = {s: [r for p in sorted((wf.workdir / "store" / "completions" / s).rglob("0*.parquet"))
                for r in pq.read_table(p).to_pylist()] for s in ("code", "prose")}  # fmt: skip
    for source, found in rows.items():
        measured = [r["acceptance"] for r in found if r["acceptance"] and r["acceptance"]["steps"]]
        assert len(measured) == len(found) == 4, (source, [r["acceptance"] for r in found])
        tau[source] = [1 + a["accepted"] / a["steps"] for a in measured]
    print(f"ngram τ per row: code {tau['code']}, prose {tau['prose']}")
    assert min(tau["code"]) > max(tau["prose"]), tau
    slices = json.loads((wf.workdir / "dist" / "test-mix" / layout.MANIFEST).read_text())["drafting"]["slices"]
    assert slices["category=coding"]["tau"] > slices["category=general"]["tau"]


def _dataset_taus(wf: Workflow) -> list[float]:
    data = wf.workdir / "dist" / "test-mix" / "data"
    rows = [r for p in sorted(data.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    return [1 + r["spec_accepted"] / r["spec_steps"] if r["spec_steps"] else 1.0 for r in rows]


def test_the_mix_chooses_the_rows_the_drafter_accepted_least(tmp_path: Path, smollm2: Path) -> None:
    """One category of code and prose prompts, generated with ngram on SmolLM2, then mixed to half its tokens:
    by acceptance the dataset's rows accept less than the seeded rank's choice of the same budget, the share
    and the language floor met, the manifest's counts those of the dataset, and nothing generated again."""
    from tests.test_accept import CODE, NGRAM, PROSE

    target = smollm2
    data = tmp_path / "data"
    data.mkdir()
    (data / "mixed.jsonl").write_text("".join(json.dumps({"instruction": p}) + "\n" for p in CODE[:4] + PROSE[:4]))
    sources = {"mixed": {"category": "coding", "format": "alpaca", "files": [str(data / "mixed.jsonl")]}}
    config = base_config(target, sources, engine={**shared_engine(target, "vllm"), "drafter": NGRAM})
    config["model"].pop("chat_template")
    config["sampling"] = {"temperature": 0, "top_k": 0, "max_new_tokens": 48}
    config["preflight"] = {"skip_parity": True}
    config["mix"]["languages"] = {"coding": {"en": 0.5}}
    wf = Workflow.at(tmp_path / "work", config)
    wf.build()
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / layout.MANIFEST).read_text())
    config["mix"]["budget_tokens"] = manifest["tokens"] // 2
    wf.write_config(config)
    wf.build()
    random_choice = _dataset_taus(wf)
    config["mix"]["by_acceptance"] = {"coding": {"fraction": 1.0, "pool": 1}}
    wf.write_config(config)
    assert "total: 0 generate jobs" in wf.cli("plan").stdout
    wf.build()
    chosen = _dataset_taus(wf)
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / layout.MANIFEST).read_text())
    rule = manifest["by_acceptance"]["coding"]
    print(f"τ of the rows chosen by acceptance {chosen}, by rank {random_choice}; {rule}")
    assert sum(chosen) / len(chosen) < sum(random_choice) / len(random_choice)
    assert rule["hard_rows"] + rule["rest_rows"] == len(chosen) == rule["chosen"]["rows"]
    assert rule["chosen"]["rows"] + rule["left_out"]["rows"] == 8
    assert rule["chosen"]["tau_per_row"] == pytest.approx(sum(chosen) / len(chosen), abs=1e-3)
    assert rule["chosen"]["tau_per_row"] < rule["left_out"]["tau_per_row"]
    assert manifest["mix"]["languages"]["coding"]["en"]["achieved_share"] >= 0.5
    card = (wf.workdir / "dist" / "test-mix" / "README.md").read_text()
    assert f"| coding | 1 | 1 | {rule['hard_rows']} | {rule['rest_rows']} | 0 |" in card
