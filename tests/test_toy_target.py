"""The toy target (tests/toy_target.py, its build committed in tests/data/toy_target/): a tiny Qwen3 whose
greedy answers are its categories' templates, on prompts it never trained on; its tokenizer is the script's;
and vLLM's CPU server serves it, alone and with a DFlash drafter, with the same answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import toy_target
from tests.conftest import base_config, build_dflash_drafter, served_url, shared_engine, write_jsonl

HELD_OUT = 48  # held-out prompts of each category the unit test asks (of 142 math and 102 prose)
SERVED = 6  # prompts of each category asked of the vLLM server
DRAFT = 3  # draft tokens per step


@pytest.fixture(scope="module")
def toy() -> Path:
    return toy_target.COMMITTED


def test_the_toy_target_answers_held_out_prompts_with_its_categories_templates(toy: Path) -> None:
    """Greedy, through the chat template (transformers' generate), on prompts it never trained on."""
    asked = {c: toy_target.prompts(c, HELD_OUT, seed=0, held_out=True) for c in toy_target.CATEGORIES}
    answers = toy_target.greedy_answers(toy, [p for prompts in asked.values() for p in prompts])
    for n, (category, prompts) in enumerate(asked.items()):
        got = answers[n * HELD_OUT : (n + 1) * HELD_OUT]
        wrong = [(p, a) for p, a in zip(prompts, got, strict=True) if a != toy_target.answer(p)]
        print(f"{category}: {len(prompts) - len(wrong)}/{len(prompts)} held-out prompts answered with the template")
        assert len(wrong) <= 0.1 * len(prompts), (category, wrong)


def test_the_categories_answers_share_almost_no_words() -> None:
    """What a drafter learns on one category's answers is of little use on the other's."""
    words = {c: {w.strip(".,") for _, a, _ in toy_target.ITEMS[c] for w in a.split()} for c in toy_target.CATEGORIES}
    assert words["math"] & words["prose"] <= {"the", "is", "and", "from"}, words["math"] & words["prose"]
    for category in toy_target.CATEGORIES:
        assert len({a for _, a, _ in toy_target.ITEMS[category]}) > 50, "answers vary with the prompt"


def test_held_out_prompts_are_never_trained_on_and_draws_are_seeded() -> None:
    for category in toy_target.CATEGORIES:
        trained = set(toy_target.prompts(category, 200, seed=0))
        held = set(toy_target.prompts(category, 100, seed=0, held_out=True))
        assert not trained & held
        assert toy_target.prompts(category, 10, seed=3) == toy_target.prompts(category, 10, seed=3)
        assert toy_target.prompts(category, 10, seed=3) != toy_target.prompts(category, 10, seed=4)
        assert {toy_target.category_of(p) for p in held} == {category}
    with pytest.raises(ValueError, match="prompts asked"):
        toy_target.prompts("prose", 10_000, seed=0)


def test_the_committed_model_is_the_scripts_shape_and_tokenizer(toy: Path) -> None:
    """What tests/toy_target.py builds: its shape, and its tokenizer's ids for every chat (a template
    changed without a rebuild shows here); the special tokens where a DFlash drafter needs them."""
    from transformers import AutoTokenizer

    config = json.loads((toy / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert {k: config[k] for k in toy_target.SHAPE} == toy_target.SHAPE
    tok = AutoTokenizer.from_pretrained(toy)
    fresh = toy_target.train_tokenizer()
    assert len(tok) == config["vocab_size"] == fresh.get_vocab_size() <= toy_target.VOCAB_SIZE
    for category in toy_target.CATEGORIES:
        for prompt, answer, _ in toy_target.ITEMS[category]:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            text = tok.apply_chat_template(chat, tokenize=False)
            assert tok(text, add_special_tokens=False)["input_ids"] == fresh.encode(text).ids, text
    ids = {t: tok.convert_tokens_to_ids(t) for t in toy_target.SPECIAL_TOKENS}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|mask|>": 3}
    assert (tok.eos_token_id, tok.pad_token_id, config["eos_token_id"]) == (2, 0, 2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi."}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((toy / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    made = json.loads((toy / "toy_target.json").read_text())
    assert min(made["held_out_exact"].values()) >= toy_target.MIN_EXACT, made


def _chat(url: str, model: Path, messages: list[dict[str, str]]) -> dict[str, Any]:
    import httpx

    body = {"model": str(model), "messages": messages, "temperature": 0, "max_tokens": 64}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert "choices" in reply, reply
    return reply


def _user(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _config(toy: Path, data: Path, **engine: Any) -> dict[str, Any]:
    write_jsonl(data / "asked.jsonl", [{"instruction": p} for p in toy_target.prompts("math", 2, seed=0)])
    sources = {"asked": {"category": "math", "format": "alpaca", "files": [str(data / "asked.jsonl")]}}
    config = base_config(toy, sources, engine=engine)
    config["model"].pop("chat_template")  # the toy's own, which it was trained on
    config["sampling"] = {"temperature": 0, "top_k": 0, "max_new_tokens": 64, "seed": 0}
    return config


@pytest.mark.workflow
def test_vllms_cpu_server_answers_with_the_templates_alone_and_with_a_dflash_drafter(toy: Path, tmp_path: Path) -> None:
    """vLLM 0.32.0's CPU server (the tests' options: float32, eager, prefix caching on, chunked prefill off)
    answers held-out prompts greedily with the templates; served with a random-weight DFlash drafter
    (tests/conftest.py's) it answers the same, each answer carrying the drafter's counts. A chat longer than
    a KV block (128 tokens on the CPU build), asked twice, the second time from the prefix cache, too."""
    asked = [p for c in toy_target.CATEGORIES for p in toy_target.prompts(c, SERVED, seed=1, held_out=True)]
    before = toy_target.prompts("prose", 3, seed=2)
    long_chat = [m for p in before for m in (*_user(p), {"role": "assistant", "content": toy_target.answer(p)})]
    long_chat += _user(asked[0])
    chats = [*map(_user, asked), long_chat, long_chat]
    drafter = build_dflash_drafter(tmp_path / "dflash", toy, seed=0)
    dflash = {"method": "dflash", "path": str(drafter), "options": {"num_speculative_tokens": DRAFT}}
    plain_config = _config(toy, tmp_path / "data", **shared_engine(toy, "vllm"))
    # another max_inflight: another engine slot, as a drafter is another server
    drafted_config = _config(toy, tmp_path / "data", **shared_engine(toy, "vllm", max_inflight=8), drafter=dflash)
    with served_url(plain_config, tmp_path / "plain") as url:
        plain = [_chat(url, toy, c) for c in chats]
    with served_url(drafted_config, tmp_path / "drafted") as url:
        drafted = [_chat(url, toy, c) for c in chats]
    texts = [r["choices"][0]["message"]["content"] for r in plain]
    wrong = [(p, a) for p, a in zip(asked, texts, strict=False) if a != toy_target.answer(p)]
    print(f"vLLM: {len(asked) - len(wrong)}/{len(asked)} held-out prompts answered with the template")
    assert len(wrong) <= 1, wrong
    assert plain[-1]["usage"]["prompt_tokens"] > 128, plain[-1]["usage"]
    assert texts[-1] == texts[-2], "the long chat's answer from the prefix cache"
    assert [r["choices"][0]["message"]["content"] for r in drafted] == texts, "the drafter keeps greedy answers"
    for reply in drafted:
        counts = reply["metrics"]["speculative_decoding"]
        assert counts["num_spec_tokens"] == DRAFT and counts["num_draft_tokens"] == DRAFT * counts["num_spec_steps"]
        assert counts["num_spec_steps"] >= 1, reply
    print(
        "DFlash (random weights) τ:", [r["metrics"]["speculative_decoding"]["mean_acceptance_length"] for r in drafted]
    )
