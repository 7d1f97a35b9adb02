"""Preflight (issue 68): the checks on what it measures (unit tier), and `dflash-build preflight` on the real
vLLM CPU server (workflow tier): a passing one whose pilot rows the build resumes and whose speed `plan`
uses, and each failure in one line naming the fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dflash_build.engines import probe
from dflash_build.engines.backends import vllm
from dflash_build.stages.preflight import checks
from dflash_build.store import layout
from tests.conftest import Workflow
from tests.test_vllm import vllm_config

DATA = Path(__file__).parent / "data"
# torch's arch lists as its wheels report them (torch.cuda.get_arch_list()): a CUDA 12.8 wheel built for
# Blackwell (sm_120) without Hopper, a CUDA 12.4 wheel up to Hopper with its PTX, and one without the PTX
SM120_WHEEL = ["sm_75", "sm_80", "sm_86", "sm_100", "sm_120", "compute_120"]
SM90_WHEEL = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]
SM90_NO_PTX = ["sm_80", "sm_86", "sm_90"]


def test_a_gpu_runs_a_wheel_by_cudas_rule() -> None:
    assert probe.kernels_for((12, 0), SM120_WHEEL) == "sm_120"
    assert probe.kernels_for((9, 0), SM120_WHEEL) is None, "an sm_120 wheel has nothing for an sm_90 GPU"
    assert probe.kernels_for((12, 0), SM90_NO_PTX) is None, "nor an sm_90 wheel for an sm_120 GPU"
    assert probe.kernels_for((12, 0), SM90_WHEEL) == "compute_90", "its PTX, compiled at load"
    assert probe.kernels_for((8, 9), SM90_WHEEL) == "sm_86", "a binary of the same major and a lower minor"
    assert probe.kernels_for((9, 0), ["sm_90a"]) == "sm_90a" and probe.kernels_for((10, 0), ["sm_90a"]) is None
    assert probe.kernels_for((12, 1), ["sm_120a"]) is None, "an arch-specific binary runs on its GPU only"


def _probed(arch_list: list[str], capability: list[int], **found: Any) -> probe.Probed:
    gpus = [{"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell", "capability": capability}]
    found = {"engine": "0.32.0", "torch": "2.9.0", "cuda": "12.4", "arch_list": arch_list, "gpus": gpus, **found}
    return probe.Probed("/env/bin/python", found)


def test_the_environment_names_a_gpu_its_torch_has_no_kernels_for() -> None:
    _, problems = checks.environment(_probed(SM90_NO_PTX, [12, 0]), "sglang", "sglang", gpus_used=True)
    [problem] = problems
    assert problem.level == checks.FAIL and problem.check == "gpu"
    assert (
        "GPU 0 (NVIDIA RTX PRO 6000 Blackwell, sm_120)" in problem.line and "sm_80, sm_86, sm_90 only" in problem.line
    )
    assert "install a torch and sglang built for sm_120" in problem.line
    _, problems = checks.environment(_probed(SM90_WHEEL, [12, 0]), "sglang", "sglang", gpus_used=True)
    assert [p.level for p in problems] == [checks.WARN], "PTX runs, slower to start"
    _, problems = checks.environment(_probed(SM120_WHEEL, [12, 0]), "sglang", "sglang", gpus_used=True)
    assert problems == []


def test_an_interpreter_without_the_engine_or_without_a_gpu_is_named() -> None:
    missing = probe.Probed("/env/bin/python", {"engine_error": "ModuleNotFoundError: No module named 'vllm'"})
    [problem] = checks.environment(missing, "vllm", "vllm", gpus_used=False)[1]
    assert (
        "/env/bin/python cannot import vllm (ModuleNotFoundError" in problem.line and "envs/vllm.yaml" in problem.line
    )
    cpu_torch = probe.Probed("/env/bin/python", {"engine": "0.32.0", "torch": "2.13.0+cpu", "cuda": None})
    [problem] = checks.environment(cpu_torch, "vllm", "vllm", gpus_used=True)[1]
    assert "sees no GPU (its CUDA: none: a CPU build)" in problem.line


def test_a_real_interpreter_answers_the_probe() -> None:
    probed = probe.probe(sys.executable, "transformers")
    assert probed.error is None and probed.found["engine"] and probed.found["torch"].startswith("2.")
    assert probe.probe(sys.executable, "no_such_engine").found["engine_error"].startswith("ModuleNotFoundError")
    assert probe.probe("/nonexistent/python", "vllm").error is not None


def test_the_model_folder_names_missing_weights_and_what_a_hybrid_needs(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16"}))
    facts, [problem] = checks.model_folder(str(folder), None)
    assert problem.level == checks.FAIL and f"model.path {folder} has no weight files" in problem.line
    assert facts["architecture"] == "Qwen3ForCausalLM" and facts["hybrid"] is False
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"w")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    [problem] = checks.model_folder(str(folder), None)[1]
    assert "names 1 weight files not there, e.g. model-00002-of-00002.safetensors" in problem.line
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"w")
    config = {"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    (folder / "config.json").write_text(json.dumps(config))
    needs = vllm.BACKEND.preflight.hybrid({})  # type: ignore[union-attr]
    facts, [problem] = checks.model_folder(str(folder), needs)
    assert facts["hybrid"] and facts["linear_attention_layers"] == 3
    assert problem.level == checks.WARN and "engine.options.enable_prefix_caching: false" in problem.line
    assert vllm.BACKEND.preflight.hybrid({"enable_prefix_caching": False}) is None  # type: ignore[union-attr]
    assert checks.model_folder(str(tmp_path / "gone"), None)[1][0].line.endswith(
        "does not exist: copy the model there or fix the path"
    )


def test_the_vllm_servers_own_report_is_read_from_its_log() -> None:
    """From a real vLLM 0.32.0 CPU server's start (tests/data): its KV cache, as it says it."""
    report = vllm.BACKEND.preflight.report((DATA / "vllm_cpu_server_start.log").read_text())  # type: ignore[union-attr]
    assert report["kv_tokens"] == 1_048_576
    assert report["lines"][-1] == "Maximum concurrency for 2,048 tokens per request: 512.00x"
    # a build that reaches 1,024 requests in flight (512 a job, two jobs per engine, shards of 2,000 rows)
    reached = checks.in_flight(512, 2, 2000, 100_000, None, "engine.options.max_num_seqs")
    problem = checks.engine_memory(report, reached, 1500.0, "engine.options.cpu_kvcache_space (GiB)", "cpu")
    assert (
        problem is not None and problem.level == checks.FAIL and "its KV cache holds 1,048,576 tokens" in problem.line
    )
    assert (
        "699 requests at the pilot's mean of 1500 tokens" in problem.line
        and "the build keeps 1024 in flight on it (max_inflight 512 x 2 job(s) per engine)" in problem.line
        and "raise engine.options.cpu_kvcache_space" in problem.line
    )
    assert checks.engine_memory(report, checks.in_flight(512, 1, 2000, 100_000, None, ""), 1500.0, "k", "cpu") is None


def test_the_kv_check_judges_the_requests_the_build_reaches_not_its_in_flight_setting() -> None:
    """A build of 40 rows never has 512 requests in flight whatever max_inflight says (issue 79): a cache that
    holds 91 of them passes; one that holds 30 fails; where the engine's own cap runs fewer at once than the
    build sends and the cache holds that many, the rest only queue: a warning."""
    report = {"kv_tokens": 46_592, "lines": []}
    forty = checks.in_flight(256, 2, 40, 40, None, "engine.options.max_num_seqs")
    assert forty.reached == 40 and "the build's 40 requests" in forty.why
    assert checks.engine_memory(report, forty, 512.0, "knob", "cpu") is None, "91 held, 40 reached"
    short = checks.engine_memory(report, forty, 1500.0, "knob", "cpu")  # 31 held
    assert short is not None and short.level == checks.FAIL and "caps the batch at 31" in short.line
    # shards of 16 rows, two jobs per engine: 32 reached, however many rows the build has
    assert checks.in_flight(256, 2, 16, 10_000, None, "").reached == 32
    queued = checks.engine_memory(
        report, checks.in_flight(256, 2, 2000, 10_000, 24, "engine.options.max_num_seqs"), 1500.0, "knob", "cpu"
    )
    assert queued is not None and queued.level == checks.WARN, "the engine runs 24 at once: the cache holds them"
    assert "the engine runs 24 at once (engine.options.max_num_seqs)" in queued.line and "488 wait" in queued.line
    assert (
        checks.engine_memory(  # the engine's cap above what the cache holds: the cache is what caps it
            report, checks.in_flight(256, 2, 2000, 10_000, 64, "engine.options.max_num_seqs"), 1500.0, "knob", "cpu"
        ).level
        == checks.FAIL
    )  # type: ignore[union-attr]
    assert vllm.BACKEND.preflight.batch_cap({"max_num_seqs": 24}) == 24  # type: ignore[union-attr]
    assert vllm.BACKEND.preflight.batch_cap({}) is None  # type: ignore[union-attr]


def test_the_pilots_answers_are_judged() -> None:
    assert checks.length_share("s", Counter(stop=3, length=2), 0.5, 64, "drop") is None
    problem = checks.length_share("s", Counter(stop=1, length=3), 0.5, 64, "drop")
    assert problem is not None and "3 of 4 pilot answers end at max_new_tokens 64" in problem.line
    assert problem.level == checks.FAIL and "truncated: drop drops them" in problem.line
    kept = checks.length_share("s", Counter(stop=1, length=3), 0.5, 64, "keep")
    assert kept is not None and kept.level == checks.WARN, "the config keeps cut answers on purpose (the demo)"
    assert "render the same" not in (checks.thinking_switch("s", True, False, 2, 4) or checks.Problem("", "", "")).line
    same = checks.thinking_switch("s@think", True, True, 0, 4)
    assert same is not None and same.level == checks.FAIL and "the switch does nothing" in same.line
    thinks = checks.thinking_switch("s", False, False, 2, 4)
    assert thinks is not None and "2 of 4 pilot answers open a reasoning block" in thinks.line
    none = checks.thinking_switch("s", True, False, 0, 4)
    assert none is not None and none.level == checks.WARN
    assert checks.verdict([none]) == "PASS" and checks.verdict([none, same]) == "FAIL"


# -- on the real vLLM CPU server ---------------------------------------------------------------------------
def _summary(wf: Workflow) -> dict[str, Any]:
    config = json.loads(json.dumps(__import__("yaml").safe_load((wf.workdir / "config.yaml").read_text())))
    path = wf.workdir / layout.preflight_summary(config.get("logs", "logs"), config["dataset"]["name"])
    return json.loads(path.read_text())


def _sidecars(wf: Workflow, source: str) -> list[dict[str, Any]]:
    return [
        json.loads(p.read_text())
        for p in sorted((wf.workdir / "store" / "completions" / source).glob("*/*.stats.json"))
    ]


@pytest.mark.workflow
def test_a_preflight_passes_its_pilot_rows_are_the_builds_and_plan_uses_its_speed(
    tmp_path: Path, vllm_model: Path
) -> None:
    """A demo-shaped config on vLLM's CPU server passes; its engine's own report and the pilot's speed are in
    the summary, `plan` prices the build at that speed, and the build resumes the pilot's rows: none of them
    is generated again."""
    config = vllm_config(vllm_model, tmp_path / "data")
    config["preflight"] = {"rows": 2, "speed_rows": 4}
    wf = Workflow.at(tmp_path / "work", config)
    proc = wf.cli("preflight")
    assert "# preflight: PASS\n" in proc.stdout, proc.stdout
    summary = _summary(wf)
    assert summary["verdict"] == "PASS" and summary["environment"]["engine"] == "0.32.0"
    assert summary["model"]["architecture"] == "Qwen3ForCausalLM" and summary["model"]["hybrid"] is False
    [engine] = summary["engines"]
    assert engine["kv_tokens"] == 1_048_576 and engine["ready_seconds"] > 0, engine  # cpu_kvcache_space: 1 GiB
    # read from the server's own /metrics while the pilot ran (the names are vLLM's: a sample may fall between
    # requests, so the peaks are bounds, not counts)
    assert {"peak_running", "peak_waiting", "peak_kv_usage"} <= set(engine), engine
    assert engine["peak_running"] <= 4 and engine["peak_kv_usage"] < 0.01, engine
    pilot = summary["pilot"]
    assert pilot["speed_source"] == "questions" and pilot["sources"]["questions"]["rows"] == 4
    assert pilot["sources"]["chats"]["rows"] == 2 and pilot["rows"] == 6 and pilot["output_tokens"] > 0
    assert pilot["speed_tokens_per_second"] > 0
    plan = wf.cli("plan").stdout
    assert f"speed: preflight measured {pilot['speed_tokens_per_second']:.1f} output tok/s per GPU" in plan
    hours = float(plan.split(" GPU-hours\n", 1)[0].rsplit(" ", 1)[1])  # plan's total line
    assert summary["build"] == {"rows_to_generate": 8, "gpu_hours": pytest.approx(hours, abs=0.01)}
    assert "The build: 8 rows to generate" in proc.stdout, "12 + 2 conversations, less the pilot's 6"

    wf.build()
    questions = _sidecars(wf, "questions")  # two shards of 6 rows: the pilot took 4 of the first's
    assert [(s["resumed_turns"], s["generated"]) for s in questions] == [(4, 2), (0, 6)], "the pilot's rows resumed"
    [chats] = _sidecars(wf, "chats")
    assert chats["generated"] == 0 and chats["resumed_turns"] == pilot["sources"]["chats"]["generated"]


@pytest.mark.workflow
def test_an_engine_env_without_the_engine_or_a_model_without_weights_fails_before_any_engine(
    tmp_path: Path, vllm_model: Path
) -> None:
    """Each in one line naming the fix, before any engine starts: the interpreter without vLLM at the
    workflow's parse (engine.options.python), the weightless model folder in the summary."""
    config = vllm_config(vllm_model, tmp_path / "data")
    config["engine"]["options"] = {**config["engine"]["options"], "python": sys.executable}
    wf = Workflow.at(tmp_path / "work", config)
    proc = wf.cli("preflight", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if "engine.options.python" in x]
    assert f"{sys.executable} has no vLLM to run the server with" in line

    weightless = tmp_path / "weightless"
    shutil.copytree(vllm_model, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    config = vllm_config(vllm_model, tmp_path / "data")
    config["model"]["path"] = str(weightless)
    wf = Workflow.at(tmp_path / "work-2", config)
    proc = wf.cli("preflight", check=False)
    assert proc.returncode == 1 and "# preflight: FAIL" in proc.stdout, proc.stdout + proc.stderr
    [problem] = _summary(wf)["problems"]
    assert problem["check"] == "model" and f"model.path {weightless} has no weight files" in problem["line"]
    assert "engines" not in _summary(wf) and not (wf.workdir / "logs" / "engines").exists(), "no engine started"


@pytest.mark.workflow
def test_an_engine_option_the_release_refuses_at_start_fails_in_its_own_words(tmp_path: Path, vllm_model: Path) -> None:
    config = vllm_config(vllm_model, tmp_path / "data")
    config["engine"]["options"] = {**config["engine"]["options"], "max_model_len": 1_000_000}
    wf = Workflow.at(tmp_path / "work", config)
    proc = wf.cli("preflight", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [problem] = _summary(wf)["problems"]
    assert problem["check"] == "engine" and "max_model_len" in problem["line"] and "\n" not in problem["line"], problem
    assert problem["line"].startswith("the vllm engine on cpu did not start: "), "the engine's own words, one line"


IGNORES_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.workflow
def test_a_small_kv_cache_a_template_that_ignores_the_switch_and_answers_at_the_budget_each_fail(
    tmp_path: Path, vllm_model: Path
) -> None:
    """Settings the build would run for days with, each a FAIL line naming its fix: in-flight requests the KV
    cache cannot hold (vLLM's CPU build: cpu_kvcache_space), a template that renders enable_thinking the
    same either way for the variants that set it, a budget every answer runs into, tools the template drops."""
    config = vllm_config(vllm_model, tmp_path / "data")
    # a KV cache of 2 blocks (256 tokens on the CPU build): 12 requests of the pilot's 20 tokens, fewer than
    # this small build keeps in flight (its every row at once: 6 prompts x 4 samples, 2 chats)
    config["engine"]["options"] = {**config["engine"]["options"], "num_gpu_blocks_override": 2, "max_model_len": 128}
    config["sources"]["questions"]["sampling"]["samples_per_prompt"] = 4
    template = tmp_path / "plain.jinja"
    template.write_text(IGNORES_THINKING)
    config["model"]["chat_template"] = str(template)
    config["sources"]["questions"]["variants"] = {  # each a source of its own: questions@think, questions@direct
        "think": {"share": 1, "chat_template_kwargs": {"enable_thinking": True}},
        "direct": {"share": 1, "chat_template_kwargs": {"enable_thinking": False}},
    }
    config["sampling"]["max_new_tokens"] = 2
    config["truncated"] = "drop"  # as production: a row cut at the budget is GPU time thrown away
    config["preflight"] = {"rows": 2, "speed_rows": 2}
    wf = Workflow.at(tmp_path / "work", config)
    proc = wf.cli("preflight", check=False)
    assert proc.returncode == 1 and "# preflight: FAIL" in proc.stdout, proc.stdout + proc.stderr
    lines = {p["line"] for p in _summary(wf)["problems"] if p["level"] == "fail"}
    [memory] = [x for x in lines if "its KV cache holds" in x]
    # each variant holds half the 6 prompts, in one shard: 12 requests; two jobs per engine keep 24 in flight
    shard = sum(1 for _ in (tmp_path / "data" / "questions.jsonl").open()) // 2 * 4
    assert "its KV cache holds 256 tokens" in memory and "12 requests at the pilot's mean of 20 tokens" in memory
    held = f"the build keeps {2 * shard} in flight on it (2 job(s) per engine of at most {shard} requests a shard)"
    assert held in memory, memory
    assert "raise engine.options.cpu_kvcache_space" in memory
    for variant, value in (("think", True), ("direct", False)):
        same = f"source questions@{variant}: its chat template renders the same with enable_thinking {value} "
        assert any(x.startswith(same) for x in lines), lines
    assert any("source questions@think:" in x and "pilot answers end at max_new_tokens 2" in x for x in lines)
    # and the conversations with tools, which the template drops: their source's job would fail on them
    assert "source chats: config key 'model.chat_template': this source has rows with tools, but the chat " in "".join(
        lines
    )
    assert all(x.count("\n") == 0 for x in lines), "one line each"
    assert f"- **fail** (engine): {memory}" in proc.stdout


@pytest.mark.workflow
def test_the_target_drafting_for_itself_passes_the_parity_guard_and_another_drafter_is_refused(
    tmp_path: Path, vllm_model: Path
) -> None:
    """engine.drafter on vLLM's CPU server at temperature 0, the target drafting for itself (draft_model): its
    answers are the plain server's token for token, so the guard passes under the engine's identity; a drafter
    with other options has no verdict there, and its generate job refuses in one line naming engine.drafter.
    It builds from empty, as a preflight runs before the build (167 s on 2 busy cores: three server starts)."""
    from tests.conftest import shared_engine

    config = vllm_config(vllm_model, tmp_path / "data")
    config["sampling"].update(temperature=0.0, top_k=0)  # the pinned CPU build's speculation: greedy only
    drafter = {"method": "draft_model", "path": str(vllm_model), "options": {"num_speculative_tokens": 3}}
    config["engine"] = {**shared_engine(vllm_model, "vllm", max_inflight=8), "drafter": drafter}
    config["preflight"] = {"rows": 2, "speed_rows": 0}
    wf = Workflow.at(tmp_path / "work", config)
    # three servers on two cores: drafted and plain (the guard's own, one after the other), the pilot's shared one
    proc = subprocess.run(wf.cli_command("preflight"), cwd=wf.workdir, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "# preflight: PASS\n" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    parity = _summary(wf)["parity"]
    assert parity["verdict"] == "PASS" and parity["identity"]["drafter"]["method"] == "draft_model", parity
    greedy = parity["temperature_0"]
    assert greedy["drafted"]["share"] == 1.0 and greedy["itself"]["share"] == 1.0, greedy
    assert greedy["drafted"]["answers"] == parity["requests"] >= 4, "2 rows of each source, first turns"
    assert "## Parity of engine.drafter: PASS" in proc.stdout

    config["engine"]["drafter"]["options"] = {"num_speculative_tokens": 2}  # another identity: no verdict
    config["engine"]["shared"] = False  # refused before any engine: none is warmed for it
    wf.write_config(config)
    refused = wf.run(check=False)
    assert refused.returncode != 0
    logs = [p.read_text(errors="replace") for p in (wf.workdir / "logs").rglob("*") if p.is_file()]
    said = refused.stdout + refused.stderr + "\n".join(logs)
    lines = [x.strip() for x in said.splitlines() if "has no parity verdict" in x and "engine.drafter" in x]
    assert lines, said[-4000:]
    line = lines[0]
    assert "dflash-build preflight" in line and "preflight.skip_parity: true" in line, line
