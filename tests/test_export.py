"""Trainer-handoff exports (dflash_build.stages.export): what each length policy and filter writes, checked
against the trainers' own code (SpecForge 0.2.0's pre-tokenized prompt loader and DFlash filter,
speculators 0.9.0's pass-through of speculator-format rows), and the conversations' shape.

The exports of a real build fed to both loaders, and what a settings edit reruns: tests/test_workflow.py.
"""

from __future__ import annotations

import random

import pytest
from specforge.data.loss_mask import has_consecutive_supervised_tokens
from specforge.data.prompt_builder import _prompt_from_record
from speculators.data_generation.preprocessing import _append_row

from dflash_build import configfile
from dflash_build.spec import ExportSpec
from dflash_build.stages.export import conversations, tokens


def _samples(n: int = 300, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompt then answer, as the dataset writes them: loss 1 exactly on the answer, some answers tiny."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(1, 40), rng.choice([0, 1, 2, rng.randint(3, 80)])
        ids = [rng.randrange(5, 1000) for _ in range(prompt + answer)]
        out.append((ids, [0] * prompt + [1] * answer))
    return out


def _spec(fmt: str, **kw: object) -> ExportSpec:
    defaults = {
        k: v["default"] for k, v in configfile.schema()["properties"]["export"]["properties"][fmt]["properties"].items()
    }
    return ExportSpec(format=fmt, **{**defaults, **kw})  # type: ignore[arg-type]


def _specforge_keeps(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int]] | None:
    """What SpecForge's loader makes of a row for the DFlash recipe (min_loss_tokens 2, adjacent tokens)."""
    prompt = _prompt_from_record(
        {"input_ids": ids, "loss_mask": mask}, source="t", max_length=max_length, min_loss_tokens=2
    )
    if prompt is None or not has_consecutive_supervised_tokens(prompt["payload"]["loss_mask"]):
        return None
    return prompt["payload"]["input_ids"], prompt["payload"]["loss_mask"]


def _speculators_keeps(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int]] | None:
    results: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    if _append_row(results, ids, mask, max_length, None) != "kept":
        return None
    return results["input_ids"][0].tolist(), results["loss_mask"][0].tolist()


@pytest.mark.parametrize("long", ["warn", "cut"])
@pytest.mark.parametrize(("fmt", "trainer"), [("specforge", _specforge_keeps), ("speculators", _speculators_keeps)])
def test_the_trainer_sees_exactly_the_rows_written_cut_at_its_window(fmt: str, trainer: object, long: str) -> None:
    spec = _spec(fmt, max_length=48, long=long)
    for ids, mask in _samples():
        spans, why = tokens.shape(ids, mask, spec)
        expected = trainer(ids, mask, 48)  # type: ignore[operator]
        if expected is None:
            assert spans == [] and why in (tokens.DROP_FEW_LOSS, tokens.DROP_FEW_IN_WINDOW, tokens.DROP_NOT_CONSECUTIVE)
            if why == tokens.DROP_FEW_IN_WINDOW:
                assert trainer(ids, mask, len(ids)) is not None, "kept by a window that holds all of it"  # type: ignore[operator]
            continue
        [(start, end)] = spans
        written = ids[start:end], mask[start:end]
        assert trainer(*written, 48) == expected, "the trainer makes of the written row what it makes of the sample"  # type: ignore[operator]
        if long == "cut":
            assert list(written) == list(expected), "cut writes what the trainer would keep"


def test_split_keeps_every_token_of_the_pieces_that_pass_and_drop_leaves_long_samples_out() -> None:
    for ids, mask in _samples(seed=1):
        spans, _ = tokens.shape(ids, mask, _spec("speculators", max_length=32, long="split"))
        assert all(end - start <= 32 for start, end in spans)
        pieces = [(start, end) for start in range(0, len(ids), 32) for end in [min(start + 32, len(ids))]]
        kept = [p for p in pieces if sum(mask[p[0] : p[1]]) >= 1]
        assert spans == kept, "every piece with a supervised token, in order"
        dropped, why = tokens.shape(ids, mask, _spec("speculators", max_length=32, long="drop"))
        if len(ids) > 32:
            assert dropped == [] and why == tokens.DROP_LONG


def test_without_a_window_only_the_filters_apply() -> None:
    spec = _spec("specforge")
    for ids, mask in _samples(seed=2):
        spans, _ = tokens.shape(ids, mask, spec)
        assert spans == ([] if _specforge_keeps(ids, mask, 10**9) is None else [(0, len(ids))])


def test_a_conversation_takes_the_regenerated_answers_in_place_of_the_sources() -> None:
    think = ("<think>", "</think>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "old one"},
        {"role": "tool", "content": '{"x": 1}', "name": "calc"},
        {"role": "assistant", "content": "old two"},
        {"role": "user", "content": "Three?"},
    ]
    both = conversations.conversation(messages, ["<think>\nhm</think>\n\nnew one", "new two"], think)
    # the user's last question was never answered: the conversation ends with the last regenerated turn
    assert [m["role"] for m in both] == ["system", "user", "assistant", "tool", "assistant"]
    assert both[2] == {"role": "assistant", "content": "new one", "reasoning_content": "hm"}
    assert both[3] == messages[3] and both[4] == {"role": "assistant", "content": "new two"}
    first = conversations.conversation(messages, ["hm</think>answer"], think)  # the prompt opened the think block
    assert first[-1] == {"role": "assistant", "content": "answer", "reasoning_content": "hm"} and len(first) == 3
    single = conversations.conversation(messages[:2], ["plain"], think)  # turns: first keeps no source answer
    assert single == [*messages[:2], {"role": "assistant", "content": "plain"}]


@pytest.mark.parametrize(
    ("parser", "call"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "days": 2}}\n</tool_call>'),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        ),
    ],
)
def test_the_targets_tool_calls_are_exported_as_the_server_reads_them(parser: str, call: str) -> None:
    """With model.tool_call_parser, an answer's calls become structured tool_calls (arguments a JSON
    string, typed by the tool's schema), its text before them the content, its reasoning apart."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "北京天气?"}, {"role": "assistant", "content": "old"}]
    answer = f"<think>\nThe user wants Beijing.\n</think>\n\nLet me check.\n{call}"
    turns = conversations.conversation(messages, [answer], ("<think>", "</think>"), parser, tools)
    assert turns[-1] == {
        "role": "assistant",
        "content": "Let me check.\n" if parser == "qwen3_coder" else "Let me check.",  # as SGLang returns it
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京", "days": 2}'}}
        ],
        "reasoning_content": "The user wants Beijing.",
    }
    unparsed = conversations.conversation(messages, [answer], ("<think>", "</think>"))  # no parser: the text stays
    assert unparsed[-1]["content"].endswith("</tool_call>") and "tool_calls" not in unparsed[-1]
