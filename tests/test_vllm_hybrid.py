"""Qwen3.6's attention family on vLLM 0.32.0's CPU server: a tiny random Qwen3-Next (Gated DeltaNet linear
attention beside gated full attention, a mixture of experts; tests/conftest.py build_hybrid_model) builds
under a thinking and a direct variant on Qwen3's template, with a tool conversation, served with an ngram
drafter (every row's counts recorded), and `accept` measures a drafter on it. What the hybrid needs there is
in its engine block: prefix caching off (refused at parse time otherwise: tests/test_drafted_rows.py) and
bfloat16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dflash_build.store import layout
from tests.conftest import Workflow, build_hybrid_model, shared_engine
from tests.test_accept import NGRAM
from tests.test_variants import QWEN3_TEMPLATE
from tests.test_vllm import vllm_config

pytestmark = pytest.mark.workflow

# the random model's answers never close a thinking block and repeat: kept, the mechanics are under test
KEEP = {reason: {"policy": "keep"} for reason in ("loop", "repetitive", "unclosed_reasoning", "empty")}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Workflow:
    root = tmp_path_factory.mktemp("hybrid")
    model = build_hybrid_model(root / "model", tokenizer_dir, seed=0)
    config: dict[str, Any] = vllm_config(model, root / "data")
    config["model"]["chat_template"] = str(QWEN3_TEMPLATE)
    # what a hybrid needs of vLLM's CPU build: prefix caching off, bfloat16
    options = {"dtype": "bfloat16", "enable_prefix_caching": False}
    config["engine"] = {**shared_engine(model, "vllm", **options), "drafter": NGRAM}
    config["preflight"] = {"skip_parity": True}  # its parity guard: tests/test_preflight.py
    config["sampling"].update(temperature=0.0, top_k=0, max_new_tokens=16)
    config["variants"] = {
        "think": {"share": 1, "chat_template_kwargs": {"enable_thinking": True}},
        "direct": {"share": 1, "chat_template_kwargs": {"enable_thinking": False}},
    }
    config["degenerate"] = KEEP
    config["checks"]["share_tolerance"] = 1.0  # a handful of prompts, some held out: shares are not the point
    config["eval"] = {"share": 0.3, "cap": 2}
    # the calibration drafts with the target itself (draft_model), which vLLM does not serve for a hybrid here
    config["accept"] = {"drafters": {"ngram": NGRAM}, "max_new_tokens": 16, "calibration": {"rows": 0}}
    wf = Workflow.at(root / "work", config)
    wf.build()
    return wf


def _rows(store: Path) -> list[dict[str, Any]]:
    return [r for p in sorted((store / "completions").rglob("0*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_the_hybrid_builds_each_variant_and_a_tool_conversation_with_a_drafter(hybrid: Workflow) -> None:
    store = hybrid.workdir / "store"
    rows = _rows(store)
    assert {r["variant"] for r in rows} == {"think", "direct"}
    tokenizer = AutoTokenizer.from_pretrained(hybrid.workdir.parent / "model")
    for r in rows:
        prompt = tokenizer.decode(r["prompt_ids"])
        assert ("<think>\n\n</think>" in prompt) is (r["variant"] == "direct"), "each row prompted as its variant"
    tools = [r for r in rows if r["turns"] and "get_weather" in tokenizer.decode(r["turns"][0]["context_ids"])]
    assert tools, "the tool conversation was generated"
    answered = [r for r in rows if r["finish_reason"] in ("stop", "length")]
    assert answered and all(r["acceptance"] is not None for r in answered), "every answer carries its counts"
    print(
        "hybrid rows' steps (ngram drafts only where the answer repeats):", [r["acceptance"]["steps"] for r in answered]
    )
    sidecars = [json.loads(p.read_text()) for p in (store / "completions").rglob(f"*{layout.SIDECAR}")]
    assert {s["engine"]["drafter"]["method"] for s in sidecars} == {"ngram"}
    samples = [r for p in sorted((hybrid.workdir / "dist" / "test-mix" / "data").glob("*.parquet"))
               for r in pq.read_table(p).to_pylist()]  # fmt: skip
    assert samples and all(s["draft_mark"] is None or len(s["draft_mark"]) == len(s["loss_mask"]) for s in samples)


def test_accept_measures_a_drafter_on_the_hybrid(hybrid: Workflow) -> None:
    """Every eval request of the hybrid's split measured on its speculative server. The random model repeats
    nothing, so ngram proposes no draft (0 steps, τ none); vLLM 0.32.0 loads a Qwen3-Next as a draft_model
    as its MTP module and refuses it (weights not initialized), so the target cannot draft for itself here."""
    hybrid.run("accept")
    report = json.loads((hybrid.workdir / "dist" / "test-mix-acceptance" / "acceptance.json").read_text())
    ngram = report["drafters"]["ngram"]
    split = sum(pq.read_metadata(p).num_rows for p in (hybrid.workdir / "dist" / "test-mix-eval" / "data").glob("*"))
    assert ngram["counted"]["requests"] == split >= 1
    assert ngram["engine"]["version"] == "0.32.0" and ngram["counted"]["steps"] == 0
