"""Degenerate answers (issue 72): the loop rule on each prefix, a repetitive answer, reasoning left open and
an empty answer caught on token ids; answers that repeat for a reason spared; the engine's early stop
writing exactly the prefix the rule names; tokenize dropping and counting by its policy."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from dflash_build import loops
from dflash_build.engines.base import Request, SamplingParams
from dflash_build.spec import Degenerate, LoopRule
from dflash_build.stages import tokenize
from dflash_build.stages.common import degenerate
from tests.conftest import REPO

RULE = LoopRule()
DATA = REPO / "tests" / "data" / "degenerate" / "repeats_for_a_reason.jsonl"


def _words(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def test_the_loop_rule_fires_on_the_first_prefix_a_run_makes_long_enough() -> None:
    prose, span = _words(50), [11, 12, 13, 14, 15, 16, 17]
    looping = prose + span * 40
    assert loops.loop_end(looping, RULE) == 50 + RULE.min_span, "fires where the run reaches min_span"
    assert loops.loop_end(looping[: 50 + RULE.min_span - 1], RULE) is None, "not a token earlier"
    assert loops.loop_end(prose, RULE) is None
    long_period = _words(40, seed=1)  # period 40: three periods (120 tokens) are needed, not min_span
    assert loops.loop_end(long_period * 3, RULE) == 120 and loops.loop_end(long_period * 3 + [], RULE) is not None
    assert loops.loop_end(long_period * 2 + long_period[:39], RULE) is None
    assert loops.loop_end(_words(200) + [5] * 95, RULE) is None and loops.loop_end([5] * 96, RULE) == 96


def test_a_running_rows_checks_read_only_their_tail_and_find_what_the_whole_scan_finds() -> None:
    """The engines check a running row every 16 tokens from its last clear prefix (``clear``): on 300 random
    rows with a loop of a random period somewhere, the first check that fires names the prefix the scan of
    the whole row names."""
    rng = random.Random(0)
    for _ in range(300):
        period = rng.randrange(1, 70)
        span = _words(period, seed=rng.randrange(10**6))
        ids = _words(rng.randrange(600), seed=1) + span * rng.randrange(1, 12) + _words(rng.randrange(50), seed=2)
        found, clear = None, 0
        for n in range(loops.CHECK_EVERY, len(ids) + loops.CHECK_EVERY, loops.CHECK_EVERY):
            found, clear = loops.loop_end(ids[:n], RULE, clear=clear), min(n, len(ids))
            if found is not None:
                break
        assert found == loops.loop_end(ids, RULE), (period, len(ids))


def test_a_planted_loop_an_unclosed_think_and_an_empty_answer_are_each_caught(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    detector = degenerate.Detector.for_tokenizer(Degenerate(), tok)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = enc("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")
    answer = enc("Sunlight scatters off the molecules of the air, and blue light scatters the most.")
    assert detector.reason(prompt, answer, "stop") is None

    loop = answer + enc(" I think so." * 60)
    assert detector.reason(prompt, loop, "length") == degenerate.LOOP
    assert detector.reason(prompt, loop[:120], "loop") == degenerate.LOOP, "a row the engine stopped"

    thinking = prompt + enc("<think>\n")  # a template that opens the block in the render (Qwen3's)
    open_answer = enc("The user asks about the sky. Rayleigh scattering goes as the inverse fourth power")
    assert detector.reason(thinking, open_answer, "length") == degenerate.UNCLOSED
    assert detector.reason(prompt, enc("<think>\nLet me see") + open_answer, "stop") == degenerate.UNCLOSED
    closed = open_answer + enc(".\n</think>\n\n") + answer
    assert detector.reason(thinking, closed, "stop") is None

    assert detector.reason(prompt, [], "stop") == degenerate.EMPTY
    assert detector.reason(prompt, enc("  \n\n"), "stop") == degenerate.EMPTY
    assert detector.reason(thinking, open_answer + enc("\n</think>\n\n"), "stop") == degenerate.EMPTY
    assert detector.reason(prompt, [], "length") is None, "a budget of nothing is no answer the model gave"

    repetitive = [t for i in range(80) for t in enc(f" item {i % 7},")]  # varied, never one run long enough
    assert detector.reason(prompt, repetitive, "length") in (degenerate.REPETITIVE, degenerate.LOOP)
    assert degenerate.distinct_ratio(repetitive, 4) < Degenerate().repetitive_min_distinct


def _false_positives(tok: Any) -> dict[str, list[list[int]]]:
    sets: dict[str, list[list[int]]] = {}
    for line in DATA.read_text().splitlines():
        row = json.loads(line)
        sets.setdefault(row["shape"], []).append(tok.encode(row["text"], add_special_tokens=False))
    return sets


def test_answers_that_repeat_for_a_reason_are_not_caught(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    detector = degenerate.Detector.for_tokenizer(Degenerate(), tok)
    sets = _false_positives(tok)
    assert len(sets) == 8 and all(len(a) > 100 for answers in sets.values() for a in answers)
    for shape, answers in sets.items():
        for ids in answers:
            # stopped on its own, or cut by a budget: neither is a loop, however it repeats
            assert detector.reason([], ids, "stop") is None, shape
            assert detector.reason([], ids, "length") is None, shape
    # the planted fault: the same table with one row pasted 12 times is a loop
    table = sets["markdown table"][0]
    row = tok.encode("| Qwen3-8B | 8B | 128K | Apache-2.0 |\n", add_special_tokens=False)
    assert detector.reason([], table + row * 12, "stop") == degenerate.LOOP


def test_the_transformers_engine_stops_a_loop_at_the_prefix_the_rule_names(tiny_model: Path) -> None:
    """The tiny random model loops greedily (it repeats a short span): run whole and with the rule, the
    stopped row is the whole row's prefix where the rule first fires, and costs fewer tokens."""
    from dflash_build.engines.transformers_backend import TransformersEngine

    engine = TransformersEngine(str(tiny_model), {"device": "cpu", "dtype": "float32", "batch_size": 4}, [2])
    rule = LoopRule(max_period=16, min_repeats=3, min_span=24)
    params = SamplingParams(0.0, 1.0, 0, 0.0, 160)
    prompts = [[1, *_words(6, seed=i)] for i in range(4)]
    whole = {r.prompt_id: r for r in engine.generate([Request(str(i), 0, p, params, 7) for i, p in enumerate(prompts)])}
    stopped = {
        r.prompt_id: r for r in engine.generate([Request(str(i), 0, p, params, 7, rule) for i, p in enumerate(prompts)])
    }
    looped = [k for k, r in whole.items() if loops.loop_end(r.output_ids, rule) is not None]
    assert looped, "the tiny model loops greedily: the test needs one"
    for key in looped:
        end = loops.loop_end(whole[key].output_ids, rule)
        assert stopped[key].finish_reason == "loop" and stopped[key].output_ids == whole[key].output_ids[:end]
    for key in set(whole) - set(looped):
        assert dataclasses.astuple(stopped[key]) == dataclasses.astuple(whole[key]), "no loop: the same row"
    assert sum(len(r.output_ids) for r in stopped.values()) < sum(len(r.output_ids) for r in whole.values())


def _row(pid: str, output: list[int], finish: str, stop: int | None = None) -> dict[str, Any]:
    return {"prompt_id": pid, "sample_idx": 0, "prompt_ids": [1, 5, 6], "output_ids": output,
            "stop_token_id": stop, "finish_reason": finish}  # fmt: skip


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_tokenize_follows_each_reasons_policy_and_counts_every_one(policy: str) -> None:
    cfg = Degenerate(loop_policy=policy, empty_policy=policy)
    detector = degenerate.Detector(cfg)
    rows = [
        _row("ok", _words(30), "stop", 2),
        _row("loop", _words(10) + [7, 8, 9] * 40, "length"),
        _row("stopped", _words(10) + [7, 8, 9] * 33, "loop"),
        _row("empty", [], "stop", 2),
    ]
    kept = []
    for row in rows:
        (sample,) = tokenize.to_samples(row, "keep")
        assert not isinstance(sample, str)
        why = tokenize.degenerate_reason(detector, tokenize._turns(row))
        if why is None or cfg.policy(why) == "keep":
            kept.append(row["prompt_id"])
    assert kept == (["ok"] if policy == "drop" else ["ok", "loop", "stopped", "empty"])


# Prompts of the demo on which SmolLM2-135M-Instruct loops greedily (measured: bench/degenerate.py's run,
# each stopped by the default rule at 112-121 tokens), and one it answers.
LOOPING = [
    "Write a bash command that counts the lines of every .py file in a folder.",
    "Write a minimal Dockerfile for a Python web app.",
    "Write a haiku about autumn leaves.",
]
ANSWERED = ["What is the capital of France? Answer in one word."]


def _generated_rows(store: Path, gen_key: str = "*") -> dict[str, dict[str, Any]]:
    import pyarrow.parquet as pq

    paths = sorted((store / "completions").glob(f"*/{gen_key}/*.parquet"))
    return {r["prompt_id"]: r for p in paths for r in pq.read_table(p).to_pylist()}


def _sidecars(store: Path, stage: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((store / stage).rglob("*.stats.json"))]


@pytest.mark.workflow
@pytest.mark.slow
def test_the_demo_model_looping_is_stopped_dropped_and_counted_and_never_trained_on(
    tmp_path: Path, smollm2: Path
) -> None:
    """Issue 72 on a real model in the demo's engine: SmolLM2 through the transformers backend's shared server,
    greedy, 128 new tokens (its weights dequantized once per test run: the GGUF reader is not under test and
    costs 15 s a load). The rows that loop are stopped before the budget (finish reason loop), dropped
    by tokenize, counted in the sidecars, the manifest and the card, and in neither the dataset nor the
    conversations export. Then with stop_early off the same rows run to the budget (continued from their
    stopped prefix: nothing is generated twice), cost more tokens, and are dropped after the fact: the
    dataset is the same."""
    import pyarrow.parquet as pq
    import yaml

    from tests.conftest import Workflow, own_ports, write_jsonl

    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config["model"]["path"] = str(smollm2)
    config["model"]["chat_template"] = str(REPO / config["model"]["chat_template"])
    config["sampling"].update(max_new_tokens=128, temperature=0.0)
    config["engine"].update(lock_dir=str(tmp_path / "locks"), base_port=own_ports())
    config["mix"] = {"categories": {"code-other": 1.0}}
    config["checks"] = {"allow_shortfall": True}
    config.pop("pack"), config.pop("export")
    config["export"] = {"conversations": {}}
    rows = [{"messages": [{"role": "user", "content": text}]} for text in LOOPING + ANSWERED]
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    config["sources"] = {
        "prompts": {"category": "code-other", "files": [str(tmp_path / "prompts.jsonl")], "format": "messages"}
    }
    wf = Workflow(tmp_path)
    wf.write_config(config)
    wf.build()

    store = tmp_path / "store" / "demo"
    (generated,) = _sidecars(store, "completions")
    stopped = _generated_rows(store, generated["gen_key"])
    loops_found = {pid for pid, r in stopped.items() if r["finish_reason"] == "loop"}
    n = len(loops_found)
    assert n >= 2, {pid: (r["finish_reason"], r["n_output_tokens"]) for pid, r in stopped.items()}
    assert all(stopped[pid]["n_output_tokens"] < 128 for pid in loops_found), "stopped before the budget"
    assert generated["loops_stopped"] == len(loops_found)
    assert generated["loop_tokens"] == sum(stopped[pid]["n_output_tokens"] for pid in loops_found)
    status = wf.cli("status").stdout.splitlines()
    row = next(x for x in status if x.startswith("prompts "))
    assert status[1].split()[-1] == "loops" and row.split()[-1] == str(n), "status counts the rows stopped"
    (tokenized,) = _sidecars(store, "tokens")
    assert tokenized["dropped"].get("loop") == len(loops_found) and tokenized["degenerate"] == {"loop": {"en": n}}

    dataset = tmp_path / "dist" / "demo"
    samples = [r for f in sorted((dataset / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert {r["prompt_id"] for r in samples} == set(stopped) - loops_found, "every other row is trained on"
    answers = [[t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m] for r in samples]
    assert all(loops.loop_end(a, RULE) is None for a in answers), "no sample loops"
    manifest = json.loads((dataset / "manifest.json").read_text())
    counted = manifest["degenerate"]
    assert counted["found"] == {"loop": len(loops_found)} and counted["dropped"] == len(loops_found)
    assert counted["by_source"] == {"prompts": {"loop": n}} and counted["by_category"] == {"code-other": {"loop": n}}
    card = (dataset / "README.md").read_text()
    assert "## Degenerate answers" in card and f"| prompts | {n} | 0 | 0 | 0 | {n} | 0 |" in card, card
    exported = "".join(p.read_text() for p in (tmp_path / "dist" / "demo-conversations" / "data").glob("*.jsonl"))
    assert all(pid not in exported for pid in loops_found) and all(
        pid in exported for pid in set(stopped) - loops_found
    )

    # stop_early off: the stopped rows are continued from their prefix to the budget, the others reused whole
    config["degenerate"] = {"loop": {"stop_early": False}}
    wf.write_config(config)
    wf.build()
    (after,) = [s for s in _sidecars(store, "completions") if s["gen_key"] != generated["gen_key"]]
    whole = _generated_rows(store, after["gen_key"])
    for pid in loops_found:
        assert whole[pid]["finish_reason"] == "length" and whole[pid]["n_output_tokens"] == 128
        assert whole[pid]["output_ids"][: stopped[pid]["n_output_tokens"]] == stopped[pid]["output_ids"]
    for pid in set(stopped) - loops_found:
        assert whole[pid]["output_ids"] == stopped[pid]["output_ids"]
    assert after["continued"] == n and after["reused"] == len(ANSWERED), after
    assert after["output_tokens"] > generated["output_tokens"], "the stop saved tokens"
    again = [r for f in sorted((dataset / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert sorted(r["input_ids"] for r in again) == sorted(r["input_ids"] for r in samples), "the same dataset"


class _LoopsOnItsFirstSeeds:
    """Stand-in (the engine is not under test, generate's regenerate policy is): a loop to the budget for
    a row's first ``loops`` attempts' seeds, then an answer that stops."""

    def __init__(self, base_seed: int, loops: int) -> None:
        self.base_seed, self.loops = base_seed, loops
        self.requests: list[Request] = []

    def generate(self, requests: Any) -> Any:
        from dflash_build.engines.base import Result
        from dflash_build.stages.generate import row_seed

        for r in requests:
            self.requests.append(r)
            looping = {row_seed(self.base_seed, r.prompt_id, r.sample_idx, 0, k) for k in range(self.loops)}
            if r.seed in looping:
                yield Result(r.prompt_id, r.sample_idx, ([7, 8, 9] * 100)[: r.params.max_new_tokens], "length")
            else:
                yield Result(r.prompt_id, r.sample_idx, [1000, 2000, 3000, 4000], "stop", stop_token_id=2)

    def close(self) -> None:
        pass


def _regenerating(tmp_path: Path, tiny_model: Path, budget: int, **degenerate: Any) -> Any:
    import yaml

    from dflash_build import config as cfg
    from dflash_build import plan as plan_mod
    from tests.conftest import write_jsonl

    write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": f"task {i}"}]} for i in range(4)])
    raw = {
        "store": str(tmp_path / "store"),
        "dataset": {"name": "d", "out": str(tmp_path / "dist")},
        "model": {"path": str(tiny_model)},
        "sampling": {"temperature": 0.6, "max_new_tokens": budget, "seed": 5},
        "sources": {"s": {"category": "c", "format": "messages", "files": [str(tmp_path / "in.jsonl")]}},
        "mix": {"categories": {"c": 1}},
        "degenerate": {"loop": {"policy": "regenerate"}, **degenerate},
        "truncated": "keep",  # a loop to the budget is then dropped for what it is, not for its length
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(tmp_path / "c.yaml"))


@pytest.mark.parametrize(("loops", "retries"), [(1, 2), (3, 2)])
def test_a_degenerate_row_is_asked_again_with_the_next_seed_up_to_the_bound(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, loops: int, retries: int
) -> None:
    """Policy regenerate: a loop is asked again with its next attempt's seed (row_seed(..., attempt)); the
    row keeps the first answer that is not degenerate, or, after `retries` more attempts, its last one,
    which tokenize drops. The sidecar counts both; a rebuild under another budget reuses the answers as
    they are (the same generation settings judged the attempts before them): no request is sent."""
    import pyarrow.parquet as pq

    from dflash_build import engines
    from dflash_build.stages import generate, prepare
    from dflash_build.stages.generate import row_seed
    from dflash_build.stages.registry import planned

    plan = _regenerating(tmp_path, tiny_model, 200, retries=retries)
    engine = _LoopsOnItsFirstSeeds(5, loops)
    monkeypatch.setattr(engines, "load", lambda *a, **k: engine)
    prepare.run(planned(plan, "prepare", "s"))
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    rows = pq.read_table(planned(plan, "generate", "s", "00000").output("data")).to_pylist()
    final = min(loops, retries)  # the attempt each row ends on
    assert len(engine.requests) == 4 * (final + 1), "one request per attempt"
    for row in rows:
        assert row["seed"] == row_seed(5, row["prompt_id"], 0, 0, final)
        # the stand-in answers whole (it stops no loop): the last attempt's loop ran to its budget
        assert row["finish_reason"] == ("stop" if loops <= retries else "length")
    assert stats["regenerated"] == 4 * final and stats["regenerated_rows"] == 4
    tokenized = tokenize.run(planned(plan, "tokenize", "s", "00000"))
    assert tokenized["rows_out"] == (4 if loops <= retries else 0)
    assert tokenized["dropped"] == ({} if loops <= retries else {"loop": 4})

    again = _regenerating(tmp_path, tiny_model, 300, retries=retries)
    assert again.sources["s"].gen_key != plan.sources["s"].gen_key
    engine.requests.clear()
    stats = generate.run(planned(again, "generate", "s", "00000"))
    if loops <= retries:
        assert engine.requests == [] and stats["reused"] == 4, "a later attempt's answer is reused as it is"
        reused = pq.read_table(planned(again, "generate", "s", "00000").output("data")).to_pylist()
        assert [r["seed"] for r in reused] == [r["seed"] for r in rows]


class _DiesAfter(_LoopsOnItsFirstSeeds):
    """The stand-in, killed mid-shard: it raises once it has answered ``answers`` requests (the next one
    in flight is lost, as a crash loses it)."""

    def __init__(self, base_seed: int, loops: int, answers: int) -> None:
        super().__init__(base_seed, loops)
        self.answers = answers

    def generate(self, requests: Any) -> Any:
        for result in super().generate(requests):
            if len(self.requests) > self.answers:
                raise RuntimeError("the job dies")
            yield result


def _regenerate_job(root: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, reused: bool) -> Any:
    """Shard 00000's generate job under policy regenerate (retries 2), its prompts prepared; ``reused``: a
    build under policy drop generated every row's first attempt before (a loop), so this one takes those
    from the store and asks from the second attempt on."""
    from dflash_build import engines
    from dflash_build.stages import generate, prepare
    from dflash_build.stages.registry import planned

    root.mkdir()
    if reused:
        before = _regenerating(root, tiny_model, 200, loop={"policy": "drop"})
        monkeypatch.setattr(engines, "load", lambda *a, **k: _LoopsOnItsFirstSeeds(5, 2))
        prepare.run(planned(before, "prepare", "s"))
        generate.run(planned(before, "generate", "s", "00000"))
    plan = _regenerating(root, tiny_model, 200, retries=2)
    if not reused:
        prepare.run(planned(plan, "prepare", "s"))
    return planned(plan, "generate", "s", "00000")


@pytest.mark.parametrize("reused", [False, True])
def test_a_resumed_job_never_asks_an_attempt_it_rejected_again(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, reused: bool
) -> None:
    """Issue 79: policy regenerate journals every attempt it rejects, so a job that dies after rejecting
    attempts resumes from each row's next attempt: no seed is asked twice (the GPU time of a rejected
    attempt is spent once), and the shard is the one a job that never died writes. With the first
    attempts reused from an earlier build, the resumed job's reuse does not take them back either."""
    import pyarrow.parquet as pq

    from dflash_build import engines
    from dflash_build.ops import estimate, status
    from dflash_build.stages import generate
    from dflash_build.stages.generate import row_seed

    def run_on(engine: Any, job: Any) -> dict[str, Any]:
        monkeypatch.setattr(engines, "load", lambda *a, **k: engine)
        return generate.run(job)

    job = _regenerate_job(tmp_path / "whole", tiny_model, monkeypatch, reused)
    run_on(_LoopsOnItsFirstSeeds(5, 2), job)
    whole = pq.read_table(job.output("data")).to_pylist()

    asked = 4 if reused else 8  # the attempts it rejects before it dies: the second only, or the first two
    dying = _DiesAfter(5, 2, asked)
    job = _regenerate_job(tmp_path / "dies", tiny_model, monkeypatch, reused)
    with pytest.raises(RuntimeError, match="the job dies"):
        run_on(dying, job)
    rejected = {r.seed for r in dying.requests[:asked]}
    assert len(rejected) == asked
    # `plan` and `status` read the journal too: a rejected attempt leaves its row to do
    (planned,), _, _ = estimate.estimate_with_disk(job.plan)
    assert (planned.rows_journaled, planned.rows_to_generate) == (0, 4)
    assert status.collect(job.plan).sources[0].rows_done == 0

    resumed = _LoopsOnItsFirstSeeds(5, 2)
    stats = run_on(resumed, job)
    seeds = [r.seed for r in resumed.requests]
    assert not rejected & set(seeds), "a rejected attempt is asked again"
    prompts = sorted({r.prompt_id for r in dying.requests})
    assert sorted(seeds) == sorted(row_seed(5, pid, 0, 0, 2) for pid in prompts), "each row's third attempt, once"
    assert pq.read_table(job.output("data")).to_pylist() == whole, "the shard a job that never died writes"
    assert stats["regenerated_rows"] == 4


def test_regenerate_under_greedy_sampling_is_refused_in_one_line(tmp_path: Path, tiny_model: Path) -> None:
    from dflash_build.spec import ConfigError

    with pytest.raises(ConfigError, match=r"degenerate.loop.policy.*greedy sampling ignores.*temperature 0"):
        _regenerating_greedy(tmp_path, tiny_model)


def _regenerating_greedy(tmp_path: Path, tiny_model: Path) -> Any:
    import yaml

    from dflash_build import config as cfg
    from tests.conftest import write_jsonl

    write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "task"}]}])
    raw = {
        "model": {"path": str(tiny_model)},
        "sampling": {"temperature": 0.0},
        "sources": {"s": {"category": "c", "format": "messages", "files": [str(tmp_path / "in.jsonl")]}},
        "mix": {"categories": {"c": 1}},
        "degenerate": {"loop": {"policy": "regenerate"}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return cfg.load(tmp_path / "c.yaml")
