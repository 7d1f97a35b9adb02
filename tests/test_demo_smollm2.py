"""The demo configuration's model, end to end through Snakemake: SmolLM2-135M-Instruct from its GGUF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, Workflow, own_ports, write_jsonl

pytestmark = pytest.mark.workflow


@pytest.mark.slow
def test_demo_config_on_a_slice_of_its_prompts(tmp_path: Path, gguf_path: Path) -> None:
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config["model"]["path"] = str(gguf_path)
    config["model"]["chat_template"] = str(REPO / config["model"]["chat_template"])
    config["sampling"].update(max_new_tokens=40, temperature=0.0)
    config["truncated"] = "keep"
    assert config["engine"]["shared"], "the demo serves its model as production does"
    config["engine"].update(lock_dir=str(tmp_path / "locks"), base_port=own_ports())  # the build's own engine
    config["mix"]["budget_tokens"] = 100000  # keep every sample: the test reads them all
    config["export"]["specforge"]["max_length"] = 80  # shorter than some samples: the trainer would cut them
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
    assert "stopped the shared engines on cpu (history: logs/demo/engines/engines.jsonl)" in proc.stdout + proc.stderr

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
    check_exports(tmp_path, rows, tok, Path(config["model"]["chat_template"]).read_text(), proc.stdout + proc.stderr)


def _trainer_view(rows: list[dict[str, Any]], max_length: int, keeps: Any) -> list[tuple[list[int], list[int]]]:
    """The dataset as a trainer sees it: every sample cut at its window, the ones its filter keeps."""
    cut = [(r["input_ids"][:max_length], r["loss_mask"][:max_length]) for r in rows]
    return sorted(c for c in cut if keeps(c[1]))


def check_exports(root: Path, rows: list[dict[str, Any]], tok: Any, template: str, output: str) -> None:
    """Each export, read by its trainer's own loader (SpecForge 0.2.0, speculators 0.9.0), gives the
    dataset token for token, cut at the trainer's window; the conversations render back to the prompts."""
    from specforge.data.loss_mask import has_consecutive_supervised_tokens
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    dist = root / "dist"
    # SpecForge's DFlash recipe: data.prompts_path, 2+ loss tokens, two of them adjacent; long samples kept (warn)
    manifest = json.loads((dist / "demo-specforge" / "manifest.json").read_text())
    limit = manifest["export"]["max_length"]
    got = []
    for f in manifest["files"]:
        tasks = prepare_prompt_tasks(
            str(dist / "demo-specforge" / f["path"]), None, chat_template=None, max_length=limit,
            is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
            min_loss_tokens=2, loss_mask_filter=has_consecutive_supervised_tokens,
        )  # fmt: skip
        got += [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]
    dflash = lambda m: sum(m) >= 2 and has_consecutive_supervised_tokens(m)  # noqa: E731
    assert sorted(got) == _trainer_view(rows, limit, dflash)
    lost = sum(sum(r["loss_mask"][limit:]) for r in rows if dflash(r["loss_mask"][:limit]))
    assert manifest["trainer_cuts_loss_tokens"] == lost, "the card says what the trainer's cut loses"
    assert lost > 0 and f"the trainer cuts them and loses {lost} of" in output, "and so does the build's summary"

    # speculators: prepare_data's loader on the folder of JSONL rows (cut here already: long: cut)
    exported = json.loads((dist / "demo-speculators" / "manifest.json").read_text())
    tok_dir = root / "tokenizer"
    tok.save_pretrained(tok_dir)  # its loader takes a model path for the processor, which it uses to print
    loaded, _ = load_and_preprocess_dataset(
        str(tok_dir), [str(dist / "demo-speculators" / "data")], seq_length=exported["export"]["max_length"],
        build_dataset_num_proc=1,
    )  # fmt: skip
    got = sorted((r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in loaded)
    assert got == _trainer_view(rows, exported["export"]["max_length"], lambda m: sum(m) >= 1)
    assert exported["rows"] == len(got)

    # conversations: the prompt renders back to the dataset's prompt ids; the answers are the model's text
    by_id = {f"{r['prompt_id']}:{r['sample_idx']}": r for r in rows}
    convs = [
        json.loads(line)
        for p in sorted((dist / "demo-conversations" / "data").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert sorted(c["id"] for c in convs) == sorted(by_id)
    for c in convs:
        row, turns = by_id[c["id"]], c["conversations"]
        assert turns[-1]["role"] == "assistant" and all(t["content"] is not None for t in turns)
        answers = sum(t["role"] == "assistant" for t in turns)
        if row["source"] == "chat":
            assert answers == 2, "both regenerated turns, in the source's place"
            continue
        prompt_len = row["loss_mask"].index(1) if 1 in row["loss_mask"] else len(row["input_ids"])
        rendered = tok.apply_chat_template(
            turns[:-1], tools=c["tools"], chat_template=template, add_generation_prompt=True, tokenize=False
        )
        assert tok(rendered, add_special_tokens=False)["input_ids"] == row["input_ids"][:prompt_len], c["id"]
        answer = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert turns[-1]["content"] == tok.decode(answer, skip_special_tokens=True).strip()
