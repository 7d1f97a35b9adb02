"""The demo configuration's model, end to end through Snakemake: SmolLM2-135M-Instruct from its GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, Workflow, write_jsonl

pytestmark = pytest.mark.workflow


@pytest.mark.slow
def test_demo_config_on_a_slice_of_its_prompts(tmp_path: Path, gguf_path: Path) -> None:
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config["model"]["path"] = str(gguf_path)
    config["model"]["chat_template"] = str(REPO / config["model"]["chat_template"])
    config["sampling"].update(max_new_tokens=40, temperature=0.0)
    config["truncated"] = "keep"
    config["mix"]["budget_tokens"] = 100000  # keep every sample: the test reads them all
    config["checks"] = {"allow_shortfall": True}  # a slice of the sources cannot meet the demo's shares
    keep = {"demo-agent", "demo-math"}
    config["sources"] = {k: v for k, v in config["sources"].items() if k in keep}
    for source in config["sources"].values():
        source["files"] = [str(REPO / f) for f in source["files"]]
        source["max_samples"] = 2
        source.pop("sampling", None)
    write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "What is the capital of France? Answer in one word."},
                    {"from": "gpt", "value": "Paris"},
                    {"from": "human", "value": "And the capital of Italy? One word."},
                ]
            }
        ],
    )
    config["sources"]["chat"] = {
        "category": "general",
        "files": [str(tmp_path / "chat.jsonl")],
        "format": "sharegpt",
        "turns": "all",
    }
    wf = Workflow(tmp_path)
    wf.write_config(config)
    proc = wf.build()
    assert "dataset: dist/demo" in proc.stdout + proc.stderr  # the run ends with a summary

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    rows = [
        r for f in sorted((tmp_path / "dist" / "demo" / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()
    ]
    assert {r["category"] for r in rows} <= {"agent", "math", "general"}
    [conversation] = [r for r in rows if r["source"] == "chat"]
    spans = sum(
        1 for i, m in enumerate(conversation["loss_mask"]) if m and (i == 0 or not conversation["loss_mask"][i - 1])
    )
    text = tok.decode(conversation["input_ids"])
    assert spans == 2, "both assistant turns are generated and trained on"
    assert "capital of Italy" in text and text.count("<|im_start|>assistant") == 2
    for r in rows:
        if r["source"] == "chat":
            continue
        answer = [t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m]
        prompt = tok.decode(r["input_ids"][: len(r["input_ids"]) - len(answer)])
        assert prompt.endswith("<|im_start|>assistant\n")
        if r["category"] == "agent":
            assert "<tools>" in prompt
        if r["finish_reason"] == "stop":
            assert answer[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        assert len(tok.decode(answer).strip()) > 0
    manifest = json.loads((tmp_path / "dist" / "demo" / "manifest.json").read_text())
    assert manifest["rows"] == len(rows)
    # the demo packs too (pack: {seq_len: 1024}): every sample, in rows of 1024 tokens
    packed = json.loads((tmp_path / "dist" / "demo-packed-1024" / "manifest.json").read_text())
    assert packed["samples"] + packed["dropped_long"] == len(rows) and packed["rows"] > 0
    assert "packed: dist/demo-packed-1024" in proc.stdout + proc.stderr
