"""Every language, measured and steered: each prompt's language on real text, a source's language list
(prepare), and the mix's language floors on a real two-language build (tiny model, transformers engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import language
from dflash_build import plan as plan_mod
from dflash_build.spec import Config, ConfigError
from dflash_build.stages import generate, mix, prepare, tokenize
from dflash_build.stages.registry import planned
from tests.conftest import base_config, write_jsonl
from tests.multilingual import GSM8K_QUESTION, MGSM_ITEM_0, PARAGRAPH, SAME_TOPIC

MGSM_EXEMPLARS = Path(__file__).parent / "data" / "mgsm" / "exemplars.jsonl"


def _exemplars() -> list[dict[str, Any]]:
    return [json.loads(line) for line in MGSM_EXEMPLARS.read_text(encoding="utf-8").splitlines()]


def test_mgsm_questions_in_eleven_languages_are_named_by_their_language() -> None:
    """MGSM's exemplar questions, translated by people: all right but Swahili, which the compressed
    lid.176 model confuses with other Bantu and Austronesian languages (docs/benchmarks.md)."""
    rows = _exemplars()
    answers = [(r["language"], language.detect(r["question"])) for r in rows]
    wrong = [(lang, found) for lang, found in answers if found != lang]
    assert {lang for lang, _ in wrong} <= {"sw"}, wrong
    assert len(wrong) <= 4
    assert {r["language"] for r in rows} - {"sw"} <= language.codes()


def test_the_script_rule_settles_chinese_japanese_and_korean() -> None:
    assert language.detect(MGSM_ITEM_0["zh"]) == "zh"
    assert language.detect(MGSM_ITEM_0["ja"]) == "ja"
    assert language.detect(MGSM_ITEM_0["th"]) == "th"
    # short Han-only prompts the model alone calls Japanese or Wu
    assert language.detect("帮我写一封请假邮件。") == "zh"
    assert language.detect("澳大利亚的首都是哪里？") == "zh"
    assert language.detect("호주의 수도는 어디인가요?") == "ko"
    assert language.detect(GSM8K_QUESTION) == "en"


def test_user_turns_decide_and_code_and_digits_do_not() -> None:
    english_system = {"role": "system", "content": "You are a helpful assistant. Answer in the user's language."}
    assert language.of_messages([english_system, {"role": "user", "content": SAME_TOPIC["zh"]}]) == "zh"
    fenced = "请解释下面的代码为什么会报错：\n```python\ndef mean(values):\n    return sum(values) / len(values)\n```"
    assert language.of_messages([{"role": "user", "content": fenced}]) == "zh"
    assert language.detect("12 + 7 = ?") == language.UNDETERMINED
    assert language.detect("") == language.UNDETERMINED
    # code without a line of prose names no language (it was counted English, inflating English shares)
    code_only = {
        "python": "def mean(values):\n    return sum(values) / len(values)\n",
        "fenced": "```python\ndef f(x):\n    return x\n```",
        "javascript": "function add(a, b) {\n  return a + b;\n}\nconsole.log(add(1, 2));",
        "rust": 'fn main() {\n    let x = 5;\n    println!("{}", x);\n}',
        "html": '<div class="a">\n  <p>Hi</p>\n</div>',
    }
    assert {name: language.detect(text) for name, text in code_only.items()} == dict.fromkeys(code_only, "und")
    # a line of prose decides, in whatever language, asides and all; a list without code stays prose
    assert language.detect("Fix the bug in this function:\ndef f(x):\n    return x +\n") == "en"
    assert language.detect("Explain this (briefly, please):\nx = [1, 2, 3]") == "en"
    assert language.detect("# compute the mean of the values\ndef mean(v):\n    return sum(v) / len(v)") == "en"
    assert language.detect("请解释下面的代码：\ndef mean(v):\n    return sum(v) / len(v)") == "zh"
    assert language.detect("- apples\n- pears\n- plums") == "en"
    assert language.of_messages_json([json.dumps([{"role": "user", "content": PARAGRAPH["ja"]}])]) == ["ja"]


def _raw(tmp_path: Path, **source: Any) -> dict[str, Any]:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"gguf")
    rows = [{"instruction": r["question"]} for r in _exemplars() if r["language"] in ("en", "zh", "ja")]
    write_jsonl(tmp_path / "in.jsonl", rows)
    return {
        "store": str(tmp_path / "store"),
        "model": {"path": str(model)},
        "sources": {"s": {"category": "general", "format": "alpaca", "files": [str(tmp_path / "in.jsonl")], **source}},
        "mix": {"categories": {"general": 1}},
    }


def _load(tmp_path: Path, raw: dict[str, Any]) -> Config:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw, allow_unicode=True))
    return cfg.load(tmp_path / "c.yaml")


# a per-row template kwarg sends every row through prepare's row path instead of its columnar one
ROW_PATH = {"chat_template_kwargs_from": {"enable_thinking": {"field": "reasoning", "default": True}}}


@pytest.mark.parametrize("path", [{}, ROW_PATH], ids=["columns", "rows"])
def test_a_source_keeps_only_its_languages_counting_the_rest(tmp_path: Path, path: dict[str, Any]) -> None:
    raw = _raw(tmp_path, languages=["zh", "ja"], max_samples=10, **path)
    plan = plan_mod.build(_load(tmp_path, raw))
    manifest = prepare.run(planned(plan, "prepare", "s"))
    assert manifest["rows_in"] == 24
    assert manifest["drops"]["language"] == 8  # the English questions, before max_samples
    assert manifest["drops"]["over_max_samples"] == 6
    assert all("language 'en'" in e for e in manifest["drop_examples"]["language"])
    kept = pq.read_table(plan.prompt_shards("s")[0]).column("messages").to_pylist()
    assert sorted(set(language.of_messages_json(kept))) == ["ja", "zh"]
    # the list is in the prompt key, with the detector's version; a source without one keeps its key
    assert plan.sources["s"].prompt_components["language"] >= 1
    del raw["sources"]["s"]["languages"]
    plain = plan_mod.build(_load(tmp_path, raw))
    assert "language" not in plain.sources["s"].prompt_components
    assert plain.sources["s"].prompt_key != plan.sources["s"].prompt_key


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("source", ["zh", "zz"], "config key 'sources.s.languages.1': 'zz' is not a language code"),
        (
            "mix",
            {"genral": {"zh": 0.2}},
            "config key 'mix.languages.genral': 'genral' is not in mix.categories (did you mean 'general'?)",
        ),
        (
            "mix",
            {"general": {"zhh": 0.2}},
            "config key 'mix.languages.general.zhh': 'zhh' is not a language code the detector names "
            "(ISO 639, e.g. en, zh, ja); did you mean 'zh'?",
        ),
        ("mix", {"general": {"zh": 0.7, "ja": 0.6}}, "config key 'mix.languages.general': the floors sum to 1.3"),
    ],
)
def test_language_settings_fail_naming_the_key(tmp_path: Path, where: str, value: Any, message: str) -> None:
    raw = _raw(tmp_path)
    if where == "source":
        raw["sources"]["s"]["languages"] = value
    else:
        raw["mix"]["languages"] = value
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, raw)
    assert message in str(err.value)


# -- a two-language build: prepare, generate (tiny model, transformers engine), tokenize, then mixes ----
@pytest.fixture(scope="module")
def bilingual(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[Path, dict[str, Any]]:
    """General prompts in English and Chinese from two sources, math in English; every token shard built
    once, in process. Each test mixes it anew with its own mix settings."""
    root = tmp_path_factory.mktemp("bilingual")
    rows = _exemplars()
    by_language = {
        lang: [{"instruction": r["question"]} for r in rows if r["language"] == lang] for lang in ("en", "zh", "de")
    }
    write_jsonl(root / "en.jsonl", by_language["en"] + by_language["de"])
    write_jsonl(
        root / "zh.jsonl", by_language["zh"] + [{"instruction": SAME_TOPIC["zh"]}, {"instruction": PARAGRAPH["zh"]}]
    )
    write_jsonl(root / "math.jsonl", [{"instruction": f"{GSM8K_QUESTION} ({i})"} for i in range(6)])
    source = {"format": "alpaca"}
    raw = base_config(
        tiny_model,
        {
            "general-en": {**source, "category": "general", "files": [str(root / "en.jsonl")]},
            "general-zh": {**source, "category": "general", "files": [str(root / "zh.jsonl")]},
            "math": {**source, "category": "math", "files": [str(root / "math.jsonl")]},
        },
        store=str(root / "store"),
        logs=str(root / "logs"),
    )
    raw["shard_size"] = 32
    plan = plan_mod.build(_load(root, raw))
    for name, sp in plan.sources.items():
        prepare.run(planned(plan, "prepare", name))
        for shard in sp.shards:
            generate.run(planned(plan, "generate", name, shard))
            tokenize.run(planned(plan, "tokenize", name, shard))
    return root, raw


def _mix(root: Path, raw: dict[str, Any], name: str, **mix_settings: Any) -> dict[str, Any]:
    raw = {**raw, "dataset": {"name": name, "out": str(root / "dist")}, "mix": {**raw["mix"], **mix_settings}}
    plan = plan_mod.build(_load(root, raw))
    return mix.run(planned(plan, "mix"))


def _general_share(manifest: dict[str, Any], lang: str) -> float:
    tokens = manifest["languages"]["by_category"]["general"]
    return tokens.get(lang, 0) / sum(tokens.values())


def test_samples_carry_their_prompts_language_into_the_dataset_and_its_card(
    bilingual: tuple[Path, dict[str, Any]],
) -> None:
    root, raw = bilingual
    manifest = _mix(root, raw, "plain")
    plan = plan_mod.build(_load(root, raw))
    samples = {name: pq.read_table(plan.token_shards(name)[0]).column("language").to_pylist() for name in plan.sources}
    assert set(samples["general-zh"]) == {"zh"} and set(samples["general-en"]) == {"en", "de"}
    assert set(samples["math"]) == {"en"}
    for name, by_language in manifest["languages"]["by_source"].items():
        assert set(by_language) <= set(samples[name])
    data = pq.read_table(root / "dist" / "plain" / "data")
    per_row = dict(zip(data.column("prompt_id").to_pylist(), data.column("language").to_pylist(), strict=True))
    prompts = pq.read_table(plan.prompt_shards("general-zh")[0])
    for pid, messages in zip(
        prompts.column("prompt_id").to_pylist(), prompts.column("messages").to_pylist(), strict=True
    ):
        if pid in per_row:
            assert per_row[pid] == language.of_messages(json.loads(messages)) == "zh"
    card = (root / "dist" / "plain" / "README.md").read_text()
    assert "## Languages" in card and "| zh |" in card and "| en |" in card
    assert "| general-zh | zh 100.0% |" in card
    assert (root / "dist" / "plain" / "plots" / "languages_by_category.png").stat().st_size > 0
    table = (root / "dist" / "plain" / "tables" / "by_language.csv").read_text().splitlines()
    assert table[0] == "language,general,math,all,tokens"


def test_a_language_floor_is_met_and_a_short_language_fails_loudly(bilingual: tuple[Path, dict[str, Any]]) -> None:
    root, raw = bilingual
    plain = _mix(root, raw, "plain-again")
    zh_share = _general_share(plain, "zh")
    floor = round(min(0.9, zh_share + 0.2), 2)
    steered = _mix(root, raw, "steered", languages={"general": {"zh": floor}})
    got = steered["mix"]["languages"]["general"]["zh"]
    assert got["floor"] == floor and got["achieved_share"] >= floor - raw["checks"]["share_tolerance"]
    assert _general_share(steered, "zh") == pytest.approx(got["achieved_share"], abs=1e-6)
    # without a budget the floor sizes the dataset: all of general's Chinese tokens can back it
    assert steered["tokens"] <= plain["tokens"]
    assert "general, zh:" in (root / "dist" / "steered" / "README.md").read_text()

    with pytest.raises(mix.checks.MixError) as err:  # no Japanese prompt in general at all
        _mix(root, raw, "short", languages={"general": {"ja": 0.3}})
    message = str(err.value)
    assert "category 'general': language 'ja' reaches 0.0% of its tokens, floor 30.0%" in message
    assert "mix.languages.general.ja" in message
    assert not (root / "dist" / "short").exists()  # nothing published

    # a floor below the tolerance with nothing of its language still fails: no mix can meet it
    tolerance = raw["checks"]["share_tolerance"]
    with pytest.raises(mix.checks.MixError, match=r"language 'ja' reaches 0\.0% of its tokens"):
        _mix(root, raw, "none-within", languages={"general": {"ja": round(tolerance / 2, 3)}})

    # general's target is all it has, of which 90% in Chinese is more than there is
    budget = 2 * plain["mix"]["categories"]["general"]["available_tokens"]
    with pytest.raises(mix.checks.MixError, match="language 'zh' reaches"):
        _mix(root, raw, "budget", budget_tokens=budget, languages={"general": {"zh": 0.9}})


def test_plan_forecasts_what_the_mix_then_takes_and_the_card_counts_generated_against_used(
    bilingual: tuple[Path, dict[str, Any]],
) -> None:
    """Issue 39's forecast, on real generated shards: from measured lengths, `plan` names the binding
    category and the tokens every-prompt generation leaves out; the mix's manifest and card then count
    generated against used tokens, and the two agree."""
    from dflash_build.ops import estimate, forecast

    root, raw = bilingual
    plan = plan_mod.build(_load(root, {**raw, "dataset": {"name": "counted", "out": str(root / "dist")}}))
    _, _, predicted = estimate.estimate_with_disk(plan)
    assert set(predicted.bases.values()) == {forecast.MEASURED_HERE}
    manifest = _mix(root, raw, "counted")
    use = manifest["use"]
    assert use["used_tokens"] == manifest["tokens"] and use["used_share"] == pytest.approx(
        manifest["tokens"] / use["generated_tokens"], abs=1e-6
    )
    for c in predicted.categories:
        generated = use["by_category"][c.category]["generated_tokens"]
        assert generated == manifest["mix"]["categories"][c.category]["available_tokens"]  # no cross-source copies
        assert c.expected_tokens == pytest.approx(generated, rel=0.05), c.category
        assert c.target_tokens == pytest.approx(manifest["mix"]["categories"][c.category]["target_tokens"], rel=0.05)
    taken_whole = [c for c, got in use["by_category"].items() if got["used_tokens"] == got["generated_tokens"]]
    assert [c.category for c in predicted.categories if c.binds] == taken_whole
    assert predicted.left_out_tokens == pytest.approx(use["generated_tokens"] - use["used_tokens"], rel=0.1)
    card = (root / "dist" / "counted" / "README.md").read_text()
    assert f"used: {use['used_tokens']} of the {use['generated_tokens']} tokens generated" in card
    assert "| category math |" in card and "| source general-zh |" in card
    assert any(line.startswith("mix forecast") and "binding:" in line for line in predicted.lines())
