"""Near-duplicates, decontamination and prompts several sources hold: on real prepare, mix and builds."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import lsh
from dflash_build import plan as plan_mod
from dflash_build.spec import ConfigError, NearSpec
from dflash_build.stages import prepare
from dflash_build.stages.common import crosssource, neardup
from dflash_build.stages.common import words as W
from dflash_build.stages.common.decontaminate import ReferenceError
from dflash_build.stages.registry import planned
from tests.conftest import Workflow, base_config, write_jsonl
from tests.multilingual import ASK, GSM8K_QUESTION, MGSM_ITEM_0, PARAGRAPH, SAME_TOPIC

# HuggingFaceH4/mt_bench_prompts: `prompt` is a list of turns.
MT_BENCH_ITEM = {
    "prompt": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
        "and must-see attractions.",
        "Rewrite your previous response. Start every sentence with the letter A.",
    ],
    "category": "writing",
}


def _words(*texts: str) -> W.Words:
    return W.words(pa.array(list(texts), pa.string()))


# -- words ---------------------------------------------------------------------------------------------
def test_words_fold_case_punctuation_and_unicode_form() -> None:
    folded = _words("janet s ducks lay 16 eggs").hashes
    assert np.array_equal(_words("Janet's DUCKS, lay 16 eggs!").hashes, folded)
    assert np.array_equal(_words("Janet’s ducks — lay 16 eggs…").hashes, folded)  # Unicode punctuation too
    assert np.array_equal(_words("JANET’S ducks lay 16 EGGS", "x").hashes[:6], folded)  # in a mixed batch
    composed, decomposed = "café olé", unicodedata.normalize("NFD", "café olé")
    assert composed != decomposed
    assert np.array_equal(_words(composed).hashes, _words(decomposed).hashes)
    assert not np.array_equal(_words("ducks lay eggs").hashes, _words("ducks lay egg").hashes)
    long_a, long_b = "x" * 20 + "a" + "x" * 20, "x" * 20 + "b" + "x" * 20  # differ past the first 8 bytes
    assert _words(long_a).hashes[0] != _words(long_b).hashes[0]


def test_ngrams_depend_on_the_words_only_never_on_where_they_are() -> None:
    rng = random.Random(0)
    run = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(13))
    texts = [run, f"first some words {run}", f"x {run} and after", "unrelated short text"]
    found = _words(*texts)
    hashes, text_of = found.ngrams(13, whole_if_shorter=False)
    alone = hashes[text_of == 0]
    assert len(alone) == 1
    for t in (1, 2):
        assert alone[0] in hashes[text_of == t]
    assert not (text_of == 3).any()  # shorter than 13 words: no run
    _, whole_of = found.ngrams(13, whole_if_shorter=True)
    assert (whole_of == 3).sum() == 1
    # runs never cross from one text into the next
    joined, _ = _words(run[: len(run) // 2], run[len(run) // 2 :]).ngrams(13, whole_if_shorter=False)
    assert alone[0] not in joined


# -- the near-copy rule ----------------------------------------------------------------------------------
def _brute_first_copies(order: np.ndarray, keys: np.ndarray) -> list[int]:
    out = []
    for i in range(len(order)):
        partners = [int(order[j]) for j in range(len(order)) if (keys[i] == keys[j]).any() and order[j] < order[i]]
        out.append(min(partners) if partners else int(neardup.NO_MATCH))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_first_copies_is_the_brute_force_rule_in_any_row_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, bands = 60, 4
    keys = rng.integers(0, 6, size=(n, bands)).astype(np.uint64)  # many collisions
    order = rng.permutation(10_000)[:n].astype(np.uint64)
    expected = _brute_first_copies(order, keys)
    assert neardup.first_copies(order, keys).tolist() == expected
    shuffle = rng.permutation(n)
    assert neardup.first_copies(order[shuffle], keys[shuffle]).tolist() == [expected[i] for i in shuffle]


def test_the_bands_follow_the_threshold_as_lsh_chooses_them() -> None:
    assert lsh.bands_rows(NearSpec()) == (9, 13)  # datasketch's MinHashLSH(threshold=0.8, num_perm=128)
    bands, rows = lsh.bands_rows(NearSpec(threshold=0.5))
    assert bands * rows <= 128 and rows < 13
    assert lsh.catch_probability(0.95, 9, 13) > 0.99 > 0.1 > lsh.catch_probability(0.6, 9, 13)


# -- prepare ---------------------------------------------------------------------------------------------
def _plan(root: Path, sources: dict[str, Any], **extra: Any) -> plan_mod.Plan:
    (root / "model.gguf").write_bytes(b"gguf")
    raw = {
        "store": str(root / "store"),
        "shard_size": 3,
        "model": {"path": str(root / "model.gguf")},
        "sources": sources,
        "mix": {"categories": {s["category"]: 1 for s in sources.values()}},
        **extra,
    }
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(root / "config.yaml"))


def _texts(rows: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = [f"word{i}" for i in range(3000)]
    return [" ".join(rng.choice(vocab) for _ in range(40)) for _ in range(rows)]


def _shards(plan: plan_mod.Plan, source: str) -> list[list[str]]:
    return [pq.read_table(p).column("prompt_id").to_pylist() for p in plan.prompt_shards(source)]


def test_a_near_copy_is_dropped_counted_and_named_and_the_result_is_order_free(tmp_path: Path) -> None:
    texts = _texts(30, seed=1)
    near = texts[4].split(" ")
    near[20] = "changed"  # one word of 40: a Jaccard similarity of ~0.86 on 5-word shingles
    rows = [{"instruction": t} for t in [*texts, " ".join(near)]]
    write_jsonl(tmp_path / "a" / "in.jsonl", rows)
    shuffled = rows[:]
    random.Random(2).shuffle(shuffled)
    write_jsonl(tmp_path / "b" / "in.jsonl", shuffled)
    manifests, shards = [], []
    for folder in ("a", "b"):
        plan = _plan(
            tmp_path / folder,
            {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / folder / "in.jsonl")]}},
            dedup={"near": {"threshold": 0.7}},
        )
        manifests.append(prepare.run(planned(plan, "prepare", "s")))
        shards.append(_shards(plan, "s"))
    first = manifests[0]
    assert first["drops"] == {"near_duplicate": 1}
    assert first["rows_out"] == 30
    [example] = first["drop_examples"]["near_duplicate"]
    dropped, kept = (
        f"in.jsonl:{n}"
        for n in sorted(
            [5, 31],
            key=lambda n: prepare.identity.prompt_id([{"role": "user", "content": rows[n - 1]["instruction"]}], None),
            reverse=True,
        )
    )
    assert example.startswith(f"{tmp_path / 'a' / dropped}: near-copy of ") and example.endswith(kept)
    assert shards[0] == shards[1], "the same prompts in the same shards, whatever the input order"
    assert manifests[1]["drops"] == first["drops"]
    ids, bands = neardup.read_bands(plan.prompt_bands("s"))
    assert sorted(f"{int(i):016x}" for i in ids) == sorted(p for s in shards[1] for p in s)
    assert bands.shape == (30, 14)  # threshold 0.7: 14 bands of 9


def _decontaminate(path: Path) -> dict[str, Any]:
    return {"references": {"gsm8k": {"files": [str(path)], "field": "question"}}}


def test_a_prompt_holding_a_test_question_is_contaminated_and_one_on_its_topic_is_kept(tmp_path: Path) -> None:
    write_jsonl(
        tmp_path / "gsm8k_test.jsonl", [{"question": GSM8K_QUESTION, "answer": "18"}, {"question": "Short one?"}]
    )
    write_jsonl(tmp_path / "mt_bench.jsonl", [MT_BENCH_ITEM])
    restyled = GSM8K_QUESTION.replace("’", "'").upper()  # other case and quotes
    rows = [
        {"instruction": f"Solve step by step.\n\n{restyled}"},
        {
            "instruction": "Ducks lay eggs every day; a farmer sells duck eggs at the market for two dollars. "
            "How much does a farmer make in a week if the ducks lay sixteen eggs daily?"
        },  # the same topic
        {"instruction": "Please: rewrite your previous response. Start every sentence with the letter A. Thanks"},
        {"instruction": "Write a haiku about the sea."},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    references = _decontaminate(tmp_path / "gsm8k_test.jsonl")
    references["references"]["mt_bench"] = {"files": [str(tmp_path / "mt_bench.jsonl")], "field": "prompt"}
    references["ngram"] = 10  # MT-Bench's second turn has 12 words
    plan = _plan(
        tmp_path,
        {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / "in.jsonl")]}},
        decontaminate=references,
    )
    manifest = prepare.run(planned(plan, "prepare", "s"))
    assert manifest["drops"] == {"contaminated": 2}
    assert manifest["rows_out"] == 2
    examples = manifest["drop_examples"]["contaminated"]
    assert sorted(e.split(": ", 1)[0] for e in examples) == [f"{tmp_path}/in.jsonl:1", f"{tmp_path}/in.jsonl:3"]
    assert any(f"gsm8k:{tmp_path}/gsm8k_test.jsonl:1" in e for e in examples)
    assert any(f"mt_bench:{tmp_path}/mt_bench.jsonl:1" in e for e in examples)
    assert manifest["references"] == {"gsm8k": {"items": 2, "too_short": 1}, "mt_bench": {"items": 1, "too_short": 0}}
    kept = {
        json.loads(m)[0]["content"] for p in plan.prompt_shards("s") for m in pq.read_table(p)["messages"].to_pylist()
    }
    assert kept == {rows[1]["instruction"], rows[3]["instruction"]}


def test_a_reference_without_the_field_names_the_file_row_and_key(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "ref.jsonl", [{"question": GSM8K_QUESTION}, {"problem": "x"}])
    write_jsonl(tmp_path / "in.jsonl", [{"instruction": "hello there"}])
    plan = _plan(
        tmp_path,
        {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / "in.jsonl")]}},
        decontaminate=_decontaminate(tmp_path / "ref.jsonl"),
    )
    with pytest.raises(
        ReferenceError,
        match=r"ref\.jsonl:2: no text in column 'question' \(decontaminate\.references"
        r"\.gsm8k\.field; the row has columns: problem\)",
    ):
        prepare.run(planned(plan, "prepare", "s"))


def test_a_source_the_filters_empty_fails_naming_the_step(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "ref.jsonl", [{"question": GSM8K_QUESTION}])
    write_jsonl(tmp_path / "in.jsonl", [{"instruction": GSM8K_QUESTION}, {"instruction": f"Q: {GSM8K_QUESTION}"}])
    plan = _plan(
        tmp_path,
        {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / "in.jsonl")]}},
        decontaminate=_decontaminate(tmp_path / "ref.jsonl"),
    )
    with pytest.raises(
        prepare.checks.SourceLossError,
        match=r"every one of its 2 rows was removed.*contaminated 2 "
        r"\(decontaminate",
    ):
        prepare.run(planned(plan, "prepare", "s"))
    assert not plan.prompt_manifest("s").exists()


def test_a_preferred_source_that_is_not_one_is_named_with_the_closest(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"instruction": "hello there"}])
    source = {"category": "c", "format": "alpaca", "files": [str(tmp_path / "in.jsonl")]}
    with pytest.raises(
        ConfigError, match=r"dedup\.prefer\.0': 'codealpaca' is not a source; did you mean 'code_alpaca'"
    ):
        _plan(tmp_path, {"code_alpaca": source}, dedup={"prefer": ["codealpaca"]})


# -- across sources ------------------------------------------------------------------------------------
def test_across_sources_each_prompt_stays_with_one_source_by_an_order_free_rule() -> None:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 2**63, 20, dtype=np.uint64)
    prompts = {
        "zeta": np.concatenate([shared[:10], rng.integers(0, 2**63, 5, dtype=np.uint64)]),
        "alpha": np.concatenate([shared[5:], rng.integers(0, 2**63, 5, dtype=np.uint64)]),
        "mid": shared[:3].copy(),
    }
    by_name = crosssource.resolve(sorted(prompts), prompts, None)
    # by name: alpha keeps all of its prompts, mid (which alpha's do not overlap) all of its 3, and zeta
    # loses the 5 alpha holds and the 3 mid holds
    assert {k: len(v) for k, v in by_name.dropped.items()} == {"alpha": 0, "mid": 0, "zeta": 8}
    preferred = crosssource.resolve(["zeta", "alpha", "mid"], prompts, None)
    assert {k: len(v) for k, v in preferred.dropped.items()} == {"zeta": 0, "alpha": 5, "mid": 3}
    shuffled = {k: rng.permutation(v) for k, v in reversed(list(prompts.items()))}
    again = crosssource.resolve(["zeta", "alpha", "mid"], shuffled, None)
    assert {k: sorted(v.tolist()) for k, v in again.dropped.items()} == {
        k: sorted(v.tolist()) for k, v in preferred.dropped.items()
    }
    assert preferred.counts["alpha"] == {crosssource.CROSS_DUPLICATE: 5, crosssource.CROSS_NEAR_DUPLICATE: 0}
    assert "is zeta's too" in preferred.examples["alpha"][0]


# -- a build ---------------------------------------------------------------------------------------------
@pytest.mark.workflow
def test_a_prompt_several_sources_hold_is_generated_once_by_the_source_ranked_first(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Copies are settled before any GPU time: a source skips every prompt (and near-copy) that a source
    dedup.prefer ranks above it holds, counted and named; the dataset holds each prompt once and every
    generated row reaches it. Removing a ranked source re-keys the sources below it, whose rows, and the
    rows the removed source held, come from the row index: nothing is generated."""
    texts = _texts(10, seed=5)
    near = texts[9].split(" ")
    near[20] = "changed"
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", [{"instruction": t} for t in texts[:8]])
    write_jsonl(data / "b.jsonl", [{"instruction": t} for t in [*texts[4:9], " ".join(near)]])
    write_jsonl(data / "c.jsonl", [{"instruction": texts[9]}, {"instruction": "a prompt of its own, this one"}])
    sources = {
        "code_a": {"category": "coding", "format": "alpaca", "files": [str(data / "a.jsonl")]},
        "code_b": {"category": "coding", "format": "alpaca", "files": [str(data / "b.jsonl")]},
        "general": {"category": "coding", "format": "alpaca", "files": [str(data / "c.jsonl")]},
    }  # one category: the mix takes every sample it may
    config = base_config(tiny_model, sources, dedup={"near": {"threshold": 0.7}, "prefer": ["general", "code_a"]})
    config["checks"]["share_tolerance"] = 1.0
    wf = Workflow.at(tmp_path / "work", config)
    before = wf.cli("plan").stdout  # nothing prepared: exact copies, from prepare's selection in memory
    assert "across sources: 4 prompts another source holds too (code_b 4)" in before, before
    assert "Of the rows still to build, 4 are copies of a source dedup.prefer ranks above" in before, before
    wf.run()
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    rows = [
        r
        for f in sorted((wf.workdir / "dist" / "test-mix" / "data").glob("*.parquet"))
        for r in pq.read_table(f, columns=["prompt_id", "source"]).to_pylist()
    ]
    ids = [r["prompt_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a prompt id appears at most once in the dataset"
    assert len(ids) == 8 + 1 + 2  # a's 8; of b's 6, the one a lacks (4 are a's, 1 a near-copy of c's); c's 2
    cross = manifest["cross_source"]
    assert cross["code_b"][crosssource.CROSS_DUPLICATE] == 4  # code_a ranks above code_b
    assert cross["code_b"][crosssource.CROSS_NEAR_DUPLICATE] == 1  # general ranks first
    assert cross["code_a"][crosssource.CROSS_DUPLICATE] == 0 and cross["general"] == {
        crosssource.CROSS_DUPLICATE: 0,
        crosssource.CROSS_NEAR_DUPLICATE: 0,
        "examples": [],
    }
    stats = _generate_stats(wf.workdir)
    assert stats["code_b"]["cross_source"] == 5 and stats["code_b"]["generated"] == 1, stats["code_b"]
    assert sum(s["generated"] for s in stats.values()) == len(ids), "every generated row reaches the dataset"
    b_rows = [
        r
        for f in (wf.workdir / "store" / "completions" / "code_b").glob("*/*.parquet")
        for r in pq.read_table(f).to_pylist()
    ]
    errors = sorted(r["error"] for r in b_rows if r["finish_reason"] == "skipped")
    assert sum(e.startswith("cross_source_duplicate: prompt ") and e.endswith(" is code_a's too") for e in errors) == 4
    assert sum(e.startswith("cross_source_near_duplicate: ") and "general's prompt" in e for e in errors) == 1
    dropped: dict[str, int] = {}
    for f in (wf.workdir / "store" / "tokens" / "code_b").glob("*/*.stats.json"):
        for reason, n in json.loads(f.read_text())["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    assert dropped == {crosssource.CROSS_DUPLICATE: 4, crosssource.CROSS_NEAR_DUPLICATE: 1}
    generation = manifest["report"]["by_source"]["code_b"]["generation"]
    assert generation["cross_source"] == 5 and generation["error_rate"] == 0.0, "a skipped copy is no failure"
    card = (wf.workdir / "dist" / "test-mix" / "README.md").read_text()
    assert "## Removed rows" in card and "cross_source_duplicate 4" in card
    assert (wf.workdir / "dist" / "test-mix" / "plots" / "prompt_removals_by_source.png").exists()
    after = wf.cli("plan").stdout  # every source prepared: the near-copy counts too (nothing left to generate)
    assert "across sources: 5 prompts another source holds too (code_b 5)" in after, after
    assert "Of the rows still to build, 0 are copies" in after, after
    # removing a ranked source re-keys the one below it; its rows and code_a's come from the row index
    del config["sources"]["code_a"]
    config["dedup"]["prefer"] = ["general"]
    wf.write_config(config)
    jobs = wf.dry_run()
    assert {j["source"] for j in jobs["generate"]} == {"code_b"} and "prepare_code_b" not in jobs, jobs
    assert f"total: {len(jobs['generate'])} generate jobs, 0 rows to generate" in wf.cli("plan").stdout
    wf.run()
    b = _generate_stats(wf.workdir)["code_b"]
    assert b["generated"] == 0 and b["reused"] == 5 and b["cross_source"] == 1, b


def _generate_stats(workdir: Path) -> dict[str, dict[str, int]]:
    """Each source's generate counts, summed over the shards of its newest gen key."""
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in (workdir / "store" / "completions").glob("*/*/*.stats.json"):
        stats = json.loads(path.read_text())
        by_key.setdefault((stats["source"], stats["gen_key"]), []).append(stats)
    newest: dict[str, list[dict[str, Any]]] = {}
    for (source, _), shards in by_key.items():
        if source not in newest or max(s["finished_at"] for s in shards) > max(
            s["finished_at"] for s in newest[source]
        ):
            newest[source] = shards
    names = ("input_rows", "generated", "reused", "cross_source")
    return {source: {n: sum(s[n] for s in shards) for n in names} for source, shards in newest.items()}


# -- every script ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lang", sorted(MGSM_ITEM_0))
def test_scripts_without_spaces_are_decontaminated_and_deduplicated_by_characters(tmp_path: Path, lang: str) -> None:
    write_jsonl(
        tmp_path / "mgsm.jsonl", [{"question": MGSM_ITEM_0[lang], "answer": "18"}, {"question": GSM8K_QUESTION}]
    )
    paragraph = PARAGRAPH[lang]
    middle = len(paragraph) // 2
    changed = paragraph[:middle] + ("日" if paragraph[middle] != "日" else "月") + paragraph[middle + 1 :]
    rows = [
        {"instruction": ASK[lang] + MGSM_ITEM_0[lang]},  # holds the test item
        {"instruction": SAME_TOPIC[lang]},  # its topic, other words
        {"instruction": paragraph},
        {"instruction": changed},  # one character changed
        {"instruction": f"把这道题翻译成中文：{GSM8K_QUESTION}"},  # mixed scripts, the English item inside
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    plan = _plan(
        tmp_path,
        {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / "in.jsonl")]}},
        decontaminate=_decontaminate(tmp_path / "mgsm.jsonl"),
        dedup={"near": {"threshold": 0.7}},
    )
    manifest = prepare.run(planned(plan, "prepare", "s"))
    assert manifest["drops"] == {"contaminated": 2, "near_duplicate": 1}, manifest["drop_examples"]
    contaminated = sorted(e.split(": ", 1)[0] for e in manifest["drop_examples"]["contaminated"])
    assert contaminated == [f"{tmp_path}/in.jsonl:1", f"{tmp_path}/in.jsonl:5"]
    assert manifest["references"] == {"gsm8k": {"items": 2, "too_short": 0}}
    kept = {
        json.loads(m)[0]["content"] for p in plan.prompt_shards("s") for m in pq.read_table(p)["messages"].to_pylist()
    }
    assert SAME_TOPIC[lang] in kept and len(kept & {paragraph, changed}) == 1


def test_a_character_is_a_word_in_scripts_without_spaces_and_scripts_mix() -> None:
    assert len(_words("我们今天学习。").hashes) == 6, "six characters; the full stop separates"
    assert np.array_equal(_words("用Python写代码").hashes, _words("用 python 写 代 码").hashes)
    assert np.array_equal(_words("珍妮的鸭子，每天").hashes, _words("珍 妮 的 鸭 子 每 天").hashes)
    assert len(_words("สวัสดีครับ").hashes) == len("สวัสดีครับ"), "Thai: every code point"
    assert len(_words("안녕하세요 세계").hashes) == 2, "Korean writes spaces: its words stay whole"
    assert np.array_equal(_words("Janet's DUCKS lay").hashes, _words("janet s ducks lay").hashes), "English as before"
