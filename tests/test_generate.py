"""The generation driver around an engine: rendering, accounting, publishing (stand-in engine)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import engines
from dflash_build import plan as plan_mod
from dflash_build.engines import Request, Result
from dflash_build.stages import generate, prepare
from dflash_build.stages.registry import planned
from tests.conftest import TOOLS_TEMPLATE, write_jsonl


class EchoEngine:
    """Stand-in: answers each request with its last prompt token, stopping or not by parity."""

    def __init__(self, drop: int = 0) -> None:
        self.requests: list[Request] = []
        self.closed = False
        self.drop = drop

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        self.requests = list(requests)
        for r in self.requests[self.drop :]:
            if r.sample_idx % 2 == 0:
                yield Result(r.prompt_id, r.sample_idx, [r.prompt_ids[-1]], "stop", stop_token_id=2)
            else:
                yield Result(r.prompt_id, r.sample_idx, [r.prompt_ids[-1]] * 3, "length")

    def close(self) -> None:
        self.closed = True


def _plan(tmp_path: Path, tiny_model: Path, rows: list[Any], **model: Any) -> plan_mod.Plan:
    write_jsonl(tmp_path / "in.jsonl", rows)
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(tiny_model), **model},
        "sampling": {"samples_per_prompt": 2, "max_new_tokens": 3},
        "sources": {"s": {"category": "c", "format": "messages", "files": [str(tmp_path / "in.jsonl")]}},
        "mix": {"categories": {"c": 1}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "c.yaml"))
    prepare.run(planned(plan, "prepare", "s"))
    return plan


ROWS = [
    {"messages": [{"role": "user", "content": "one"}]},
    {"messages": [{"role": "user", "content": "two"}], "tools": [{"name": "f", "parameters": {}}]},
    # the template raises on a conversation that does not alternate: recorded, not fatal
    {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "tool", "content": "t"},
            {"role": "user", "content": "x"},
        ]
    },
]


def test_driver_accounts_for_every_row_and_records_template_failures(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' and loop.index0 == 1 %}"
        "{{ raise_exception('tool turn before any call') }}{% endif %}{% endfor %}" + TOOLS_TEMPLATE.read_text()
    )
    plan = _plan(tmp_path, tiny_model, ROWS, chat_template=str(template))
    stand_in = EchoEngine()
    monkeypatch.setattr(engines, "load", lambda *a, **k: stand_in)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stand_in.closed
    assert len(stand_in.requests) == 4  # 2 renderable prompts x 2 samples
    assert len({r.seed for r in stand_in.requests}) == 4
    assert stats["input_rows"] == 6
    assert (stats["ok"], stats["truncated"], stats["error"], stats["skipped"]) == (2, 2, 2, 0)
    rows = pq.read_table(plan.completion_dir("s") / "00000.parquet").to_pylist()
    errors = [r for r in rows if r["finish_reason"] == "error"]
    assert len(errors) == 2 and all("tool turn before any call" in r["error"] for r in errors)
    for r in rows:
        if r["finish_reason"] != "error":
            assert r["output_ids"][0] == r["prompt_ids"][-1] and r["n_prompt_tokens"] == len(r["prompt_ids"])
            assert r["seed"] == generate.row_seed(0, r["prompt_id"], r["sample_idx"])
    sidecar = json.loads((plan.completion_dir("s") / "00000.stats.json").read_text())
    assert sidecar["gen_key"] == plan.sources["s"].gen_key and sidecar["engine"]["backend"] == "transformers"


def test_an_engine_that_loses_rows_fails_the_shard_and_publishes_nothing(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path, tiny_model, ROWS[:1], chat_template=str(TOOLS_TEMPLATE))
    monkeypatch.setattr(engines, "load", lambda *a, **k: EchoEngine(drop=1))
    with pytest.raises(RuntimeError, match="no result for 1 requests"):
        generate.run(planned(plan, "generate", "s", "00000"))
    assert not (plan.completion_dir("s") / "00000.parquet").exists()
    journaled = (plan.journal_dir("s", "00000") / "rows.jsonl").read_text().splitlines()
    assert len(journaled) == 1, "the row that finished is kept for the rerun"


def test_a_template_that_ignores_tools_is_refused(tmp_path: Path, tiny_model: Path, gguf_path: Path) -> None:
    plan = _plan(tmp_path, tiny_model, ROWS[:2])  # the tiny model carries SmolLM2's template: no tools
    with pytest.raises(Exception, match=r"model\.chat_template"):
        generate.run(planned(plan, "generate", "s", "00000"))


def test_row_seeds_are_stable_distinct_and_31_bits() -> None:
    """The seed contract, where seeds are made: every row seed is below 2**31 (what every engine's seed
    field takes: SGLang's int64, vLLM's int, llama.cpp's uint32), and the seeds use all 31 bits."""
    assert generate.SEED_BITS == 31
    assert generate.row_seed(0, "a", 0) == generate.row_seed(0, "a", 0)
    seeds = {generate.row_seed(s, p, i) for s in (0, 1) for p in ("a", "b") for i in (0, 1)}
    assert len(seeds) == 8
    many = [generate.row_seed(base, f"{i:016x}", i % 3, i % 4) for i, base in enumerate([0, 7, 2**62] * 700)]
    assert all(0 <= s < 2**31 for s in many) and max(many) >= 2**30 > min(many)
    assert len(set(many)) == len(many), "2,100 rows, 2,100 seeds"


def _multi_turn_plan(tmp_path: Path, tiny_model: Path, template: Path, **model: Any) -> plan_mod.Plan:
    rows = [
        {
            "messages": [
                {"role": "user", "content": "first question"},
                {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": "second question"},
            ]
        },
        {"messages": [{"role": "user", "content": "x " * 200}]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(tiny_model), "chat_template": str(template), **model},
        "sampling": {"max_new_tokens": 3},
        "sources": {
            "s": {"category": "c", "format": "messages", "files": [str(tmp_path / "in.jsonl")], "turns": "all"}
        },
        "mix": {"categories": {"c": 1}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "c.yaml"))
    prepare.run(planned(plan, "prepare", "s"))
    return plan


def test_turns_all_builds_each_prompt_on_the_generated_history(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from dflash_build.stages import tokenize

    plan = _multi_turn_plan(tmp_path, tiny_model, TOOLS_TEMPLATE)
    stand_in = EchoEngine()
    monkeypatch.setattr(engines, "load", lambda *a, **k: stand_in)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["ok"] == 2
    rows = {r["prompt_id"]: r for r in pq.read_table(plan.completion_dir("s") / "00000.parquet").to_pylist()}
    [multi] = [r for r in rows.values() if r["turns"]]
    assert len(multi["turns"]) == 2
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = TOOLS_TEMPLATE.read_text()
    ids, mask = tokenize.to_sample(multi, "drop")
    answers = [tok.decode(t["output_ids"]) for t in multi["turns"]]
    conversation = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": answers[1]},
    ]
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(conversation, tokenize=False)
    assert "old answer" not in tok.decode(ids), "the source's answer is regenerated, never shown"
    generated = [i for i, m in zip(ids, mask, strict=True) if m]
    assert generated == multi["turns"][0]["output_ids"] + [2] + multi["turns"][1]["output_ids"] + [2]
    # the second request was the first turn's ids + answer + stop + the template's ids in between
    second = stand_in.requests  # the last round holds only the second turn
    assert len(second) == 1 and second[0].prompt_ids == ids[: len(second[0].prompt_ids)]


def test_a_template_that_rewrites_history_makes_each_turn_a_sample(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """turn_samples: auto (tests/test_multiturn.py has the rest, on a Qwen3-style template)."""
    rewriting = tmp_path / "rewrite.jinja"
    rewriting.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}[earlier answer]{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    plan = _multi_turn_plan(tmp_path, tiny_model, rewriting)
    monkeypatch.setattr(engines, "load", lambda *a, **k: EchoEngine())
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["error"] == 0 and stats["turns"]["per_turn"] == 1
    [multi] = [r for r in pq.read_table(plan.completion_dir("s") / "00000.parquet").to_pylist() if r["turns"]]
    assert multi["per_turn"] and "[earlier answer]" in tokenize_text(tiny_model, multi["turns"][1]["context_ids"])


def tokenize_text(model: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode(ids)


def test_prompts_that_do_not_fit_the_context_are_skipped_before_the_engine(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _multi_turn_plan(tmp_path, tiny_model, TOOLS_TEMPLATE, context_length=100)
    stand_in = EchoEngine()
    monkeypatch.setattr(engines, "load", lambda *a, **k: stand_in)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["skipped"] == 1 and stats["ok"] == 1
    assert all(len(r.prompt_ids) + 3 <= 100 for r in stand_in.requests)
    rows = pq.read_table(plan.completion_dir("s") / "00000.parquet").to_pylist()
    skipped = [r for r in rows if r["finish_reason"] == "skipped"]
    assert len(skipped) == 1 and "exceeds the context of 100" in skipped[0]["error"]


def test_thinking_switch_reaches_the_rendered_prompt(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    conv = generate.Conversation("p", 0, [{"role": "user", "content": "hi"}], None, [1])
    thinking = tok.decode(generate.Renderer(tok, {"enable_thinking": True}).next_context(conv))
    plain = tok.decode(generate.Renderer(tok, {"enable_thinking": False}).next_context(conv))
    assert thinking.endswith("<|im_start|>assistant\n")
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_gguf_header_gives_the_context_length(gguf_path: Path) -> None:
    from dflash_build import gguf_meta

    meta = gguf_meta.read_metadata(str(gguf_path))
    assert meta["general.architecture"] == "llama"
    assert gguf_meta.context_length(str(gguf_path)) == meta["llama.context_length"] == 8192
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_meta.read_metadata(str(TOOLS_TEMPLATE))


def test_a_shard_of_mostly_failed_rows_fails_and_keeps_its_journal(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of three prompts over the context: 4 of 6 rows skipped, over the 50% default."""
    long = " ".join(["word"] * 60)
    rows = [{"messages": [{"role": "user", "content": c}]} for c in ("short one", long, long + " again")]
    plan = _plan(tmp_path, tiny_model, rows, context_length=40)
    stand_in = EchoEngine()
    monkeypatch.setattr(engines, "load", lambda *a, **k: stand_in)
    with pytest.raises(generate.ShardFailedError) as err:
        generate.run(planned(plan, "generate", "s", "00000"))
    message = str(err.value)
    assert "s/00000: 4 of 6 rows could not be generated" in message
    assert "checks.max_failed_fraction" in message and "model.context_length" in message
    assert not (plan.completion_dir("s") / "00000.parquet").exists()
    journal = plan.journal_dir("s", "00000") / "rows.jsonl"
    assert len(journal.read_text().splitlines()) == 2, "the rows the engine finished are kept"


class RefusingEngine(EchoEngine):
    """Refuses every request as a server refuses a request naming a model it does not serve (the openai
    backend makes such an answer an error row)."""

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        self.requests = list(requests)
        for r in self.requests:
            yield Result(r.prompt_id, r.sample_idx, [], "error", error="HTTP 404: The model `default` does not exist")


def test_rows_the_engine_refused_are_asked_again_by_the_rerun(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard whose rows the server refused fails, with the refusals in its journal; once the cause is
    fixed, the rerun asks those rows again and publishes, instead of failing on the same journaled rows."""
    rows = [{"messages": [{"role": "user", "content": c}]} for c in ("one", "two", "three")]
    plan = _plan(tmp_path, tiny_model, rows)
    monkeypatch.setattr(engines, "load", lambda *a, **k: RefusingEngine())
    with pytest.raises(generate.ShardFailedError, match="6 of 6 rows"):
        generate.run(planned(plan, "generate", "s", "00000"))
    journal = plan.journal_dir("s", "00000") / "rows.jsonl"
    assert [json.loads(x)["finish_reason"] for x in journal.read_text().splitlines()] == ["error"] * 6
    fixed = EchoEngine()
    monkeypatch.setattr(engines, "load", lambda *a, **k: fixed)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert len(fixed.requests) == 6 and (stats["generated"], stats["error"], stats["resumed_turns"]) == (6, 0, 0)


def test_every_row_refused_by_the_template_fails_the_shard(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = tmp_path / "refuse.jinja"
    template.write_text("{{ raise_exception('this template refuses everything') }}")
    rows = [{"messages": [{"role": "user", "content": c}]} for c in ("one", "two")]
    plan = _plan(tmp_path, tiny_model, rows, chat_template=str(template))
    monkeypatch.setattr(engines, "load", lambda *a, **k: EchoEngine())
    with pytest.raises(generate.ShardFailedError, match="4 of 4 rows") as err:
        generate.run(planned(plan, "generate", "s", "00000"))
    assert "this template refuses everything" in str(err.value)


def test_max_failed_fraction_one_publishes_whatever_fails(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [{"messages": [{"role": "user", "content": " ".join(["word"] * 60)}]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(tiny_model), "context_length": 40},
        "sources": {"s": {"category": "c", "format": "messages", "files": [str(tmp_path / "in.jsonl")]}},
        "mix": {"categories": {"c": 1}},
        "checks": {"max_failed_fraction": 1.0},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "c.yaml"))
    prepare.run(planned(plan, "prepare", "s"))
    monkeypatch.setattr(engines, "load", lambda *a, **k: EchoEngine())
    assert generate.run(planned(plan, "generate", "s", "00000"))["skipped"] == 1


# -- the driver's steps, one by one ---------------------------------------------------------------------
def _work(tmp_path: Path, tiny_model: Path, rows: list[Any], **model: Any) -> generate.ShardWork:
    plan = _plan(tmp_path, tiny_model, rows, chat_template=str(TOOLS_TEMPLATE), **model)
    return generate.open_shard(plan, "s", "00000", generate.ShardPaths.of(planned(plan, "generate", "s", "00000")))


def test_open_shard_makes_one_conversation_per_prompt_and_sample(tmp_path: Path, tiny_model: Path) -> None:
    work = _work(tmp_path, tiny_model, ROWS[:2])
    assert len(work.convs) == 4 and {i for _, i in work.convs} == {0, 1}
    assert all(c.finish_reason is None and not c.turns for c in work.convs.values())


def test_next_requests_skips_over_the_context_and_continues_prefixes(tmp_path: Path, tiny_model: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": c}]} for c in ("short", " ".join(["word"] * 60))]
    work = _work(tmp_path, tiny_model, rows, context_length=40)
    progress = generate.Progress(len(work.convs), 0, "t")
    short = next(c for c in work.convs.values() if c.messages[0]["content"] == "short" and c.sample_idx == 0)
    short.prefix, short.prefix_from = [7, 8], "k/00000"
    requests, contexts = generate.next_requests(work, progress)
    assert len(requests) == 2 and set(contexts) == {(r.prompt_id, r.sample_idx) for r in requests}
    continued = next(r for r in requests if r.sample_idx == 0)
    assert continued.prompt_ids[-2:] == [7, 8] and continued.params.max_new_tokens == 1  # 3 minus the prefix
    skipped = [c for c in work.convs.values() if c.finish_reason == "skipped"]
    assert len(skipped) == 2 and all("exceeds the context of 40" in (c.error or "") for c in skipped)
    turn = generate.take_result(work, Result(continued.prompt_id, 0, [9], "length"), contexts[(continued.prompt_id, 0)])
    assert turn.output_ids == [7, 8, 9] and turn.continued and turn.reused_from == "k/00000"


def test_replay_applies_each_turn_once_and_skips_what_does_not_fit(tmp_path: Path, tiny_model: Path) -> None:
    """Two writers before shards had locks, or a damaged line: the first copy of a turn wins, the rest is
    generated again; nothing makes the journal unusable."""
    from dflash_build.store.journal import Journal

    work = _work(tmp_path, tiny_model, ROWS[:1])
    pid = next(iter(work.convs))[0]

    def row(sample: int, ids: list[int], **extra: Any) -> dict[str, Any]:
        base = {"prompt_id": pid, "sample_idx": sample, "turn": 0, "output_ids": ids, "finish_reason": "length"}
        return {**base, "stop_token_id": None, "error": None, **extra}

    journal = Journal(work.paths.journal, 1, 0)
    for r in (row(0, [5, 6]), row(0, [7, 8]), row(1, [9], turn=1), {**row(1, [3]), "prompt_id": "not-here"}):
        journal.append(r)
    journal.append({"prompt_id": pid})  # parses, but is no journal row
    journal.close()
    assert generate.replay(work, Journal(work.paths.journal, 1, 0)) == 1
    assert work.convs[(pid, 0)].turns[0].output_ids == [5, 6]
    assert not work.convs[(pid, 1)].turns, "a turn after a gap is generated again"


def test_paths_given_by_snakemake_are_the_ones_written(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path, tiny_model, ROWS[:1], chat_template=str(TOOLS_TEMPLATE))
    monkeypatch.setattr(engines, "load", lambda *a, **k: EchoEngine())
    own = planned(plan, "generate", "s", "00000")
    data, stats = tmp_path / "out" / "x.parquet", tmp_path / "out" / "x.json"
    generate.run(dataclasses.replace(own, outputs={"data": (data,), "stats": (stats,)}))
    assert data.exists() and stats.exists() and not own.output("data").exists()


def test_the_heartbeat_writes_progress_without_rows_and_names_a_silent_engine(caplog: pytest.LogCaptureFixture) -> None:
    """No row finishes for 1.6 s while two requests are in flight: progress lines keep coming, and one
    warning per silence names the engine; an answer ends the silence, a later one warns again."""
    import logging
    import time

    in_flight = {"n": 2}
    progress = generate.Progress(10, 3, "s/00000", every=0.3)
    with caplog.at_level(logging.INFO, logger="dflash_build.stages.generate"):
        progress.watch(lambda: in_flight["n"], "the server http://127.0.0.1:9", 0.5, then="it is looked at")
        time.sleep(1.6)
        progress.update(Result("p", 0, [5, 6], "stop", 2), row_finished=True)
        time.sleep(1.0)
        in_flight["n"] = 0  # nothing asked: silence is no stall
        time.sleep(1.0)
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("s/00000: 3/10 rows" in line for line in lines) >= 3, "progress while nothing finishes"
    stalls = [line for line in lines if "no answer from the server http://127.0.0.1:9" in line]
    assert len(stalls) == 2 == progress.stalls, lines
    assert all("while 2 requests are in flight (engine.stall_timeout 0.5s)" in s for s in stalls)
    assert all(s.endswith(": it is looked at") for s in stalls), "the warning says what happens next"
    assert any("s/00000: 4/10 rows" in line for line in lines)


def test_an_in_process_engine_is_stalled_only_when_its_decoding_steps_stop() -> None:
    """Long answers (steps going on, no row finishing) are no stall; steps that stop for stall_timeout
    while requests are in flight hand the engine to the stop, once."""
    import time

    steps, stalls = {"n": 0}, []
    progress = generate.Progress(10, 0, "s/00000", every=60)
    progress.watch(lambda: 4, "the in-process engine", 0.6, "stop", lambda: steps["n"], stalls.append)
    for _ in range(12):  # 1.2 s of steps and no finished row
        steps["n"] += 1
        time.sleep(0.1)
    assert stalls == [], "an engine that still decodes is not stalled"
    time.sleep(1.2)
    progress.close()
    assert len(stalls) == 1 and stalls[0].startswith("s/00000: no answer from the in-process engine for ")


def test_rows_outside_the_trainers_window_are_a_selection_and_never_fail_a_shard(tmp_path: Path) -> None:
    """Issue 40's probe: a shard whose prompts are all longer than trainer.max_length allows is published
    (its rows counted as outside_window); rows over the context still count, and the message says what
    to change for what happened, naming the journal only where it exists."""
    from dflash_build.stages.generate.accounting import ShardFailedError, check_failures
    from dflash_build.store import records as R

    window = f"{R.OUTSIDE_WINDOW} prompt of N tokens leaves N new tokens in trainer.max_length N"
    stats = {"source": "s", "shard": "00000", R.STAT_INPUT_ROWS: 6, R.STAT_ERROR: 0, R.STAT_SKIPPED: 6}
    check_failures({**stats, R.STAT_OUTSIDE_WINDOW: 6, "errors": {window: 6}}, 0.5, tmp_path / "rows.jsonl")
    over = "prompt of N tokens + max_new_tokens N exceeds the context of N"
    mixed = {**stats, R.STAT_OUTSIDE_WINDOW: 2, "errors": {window: 2, over: 4}}
    with pytest.raises(ShardFailedError) as err:
        check_failures(mixed, 0.5, tmp_path / "rows.jsonl")
    message = str(err.value)
    assert "4 of 4 rows could not be generated (0 error/abort, 4 skipped over the context; 2 more outside" in message
    assert "raise model.context_length" in message and "template errors" not in message
    assert "rows.jsonl" not in message and window not in message


_CACHED_TOKENIZER_IDS = """
import json, sys
from pathlib import Path
from dflash_build.spec import ModelSpec
from dflash_build.stages import generate
from dflash_build.stages.common import chat
model, cache, conversations = json.loads(sys.argv[1])
tok = chat.load_tokenizer(ModelSpec(model, None, None, cache["template"], {}), Path(cache["file"]))
ids = [generate.Renderer(tok, {}).next_context(generate.Conversation("p", 0, m, t, [len(m)])) for m, t in conversations]
print(json.dumps({"ids": ids, "torch": "torch" in sys.modules}))
"""


def test_a_cached_tokenizer_gives_the_very_ids_without_torch_and_a_damaged_cache_is_replaced(
    tmp_path: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The generate job's tokenizer from the user's cache (SmolLM2's real tokenizer): the ids of real
    multilingual prompts with tools equal a fresh AutoTokenizer's, in a new process without torch."""
    import subprocess
    import sys

    from dflash_build.spec import ModelSpec
    from dflash_build.stages.common import chat
    from tests import multilingual

    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look up a word.", "parameters": {}}}]
    conversations = [
        ([{"role": "user", "content": multilingual.MGSM_ITEM_0[lang]}], None) for lang in ("zh", "ja", "th")
    ]
    conversations.append(([{"role": "user", "content": multilingual.GSM8K_QUESTION}], tools))
    model = ModelSpec(str(tokenizer_dir), None, None, str(TOOLS_TEMPLATE), {})
    fresh = chat.load_tokenizer(model)
    expected = [
        generate.Renderer(fresh, {}).next_context(generate.Conversation("p", 0, m, t, [len(m)]))
        for m, t in conversations
    ]
    cache = tmp_path / "cache" / "tokenizers" / "k.pickle"

    chat.load_tokenizer(model, cache)
    assert cache.exists(), "the first job loads the tokenizer and writes the cache"
    cache.write_bytes(b"\x80\x05not a pickle")
    with caplog.at_level("WARNING"):
        assert (
            generate.Renderer(chat.load_tokenizer(model, cache), {}).next_context(
                generate.Conversation("p", 0, *conversations[0], [1])
            )
            == expected[0]
        )
    assert f"tokenizer cache {cache} does not load" in caplog.text
    # a later job, in a new process, loads the replaced cache: the same ids, and no torch
    arg = json.dumps([str(tokenizer_dir), {"template": str(TOOLS_TEMPLATE), "file": str(cache)}, conversations])
    run = subprocess.run([sys.executable, "-c", _CACHED_TOKENIZER_IDS, arg], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == {"ids": expected, "torch": False}
