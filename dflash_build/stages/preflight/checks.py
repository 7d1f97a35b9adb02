"""Preflight's findings, each a pure function of what was measured: the engine's interpreter and GPUs, the
model folder, an engine's self-report against the config, the pilot's answers; and the summary a reader
gets (JSON and Markdown). Every problem is one line that names the setting or package and the change."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_build.engines import probe, registry

FAIL, WARN = "fail", "warn"
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
# model types whose layers mix linear attention (a recurrent state per request) with full attention


@dataclass(frozen=True)
class Problem:
    level: str  # FAIL or WARN
    check: str  # environment, gpu, model, engine, pilot
    line: str


def environment(probed: probe.Probed, package: str, env_file: str, gpus_used: bool) -> tuple[dict, list[Problem]]:
    """The engine's interpreter: the engine's version, torch's and CUDA's, and each GPU it sees against the
    architectures its torch carries kernels for."""
    where = f"envs/{env_file}.yaml"
    if probed.error is not None:
        line = f"{probed.python} did not answer ({probed.error}); build the env {where}"
        return {}, [Problem(FAIL, "environment", line)]
    found = probed.found
    problems = []
    if "engine_error" in found:
        problems.append(
            Problem(
                FAIL,
                "environment",
                f"{probed.python} cannot import {package} ({found['engine_error']}): install the env {where} "
                "and name its interpreter (engine.options.python for vllm), or run the build from it",
            )
        )
    if gpus_used and "torch_error" in found:
        problems.append(Problem(FAIL, "environment", f"{probed.python}: torch: {found['torch_error']}"))
    if gpus_used and not found.get("gpus") and "torch_error" not in found:
        cuda = found.get("cuda") or "none: a CPU build"
        problems.append(
            Problem(
                FAIL,
                "gpu",
                f"torch {found.get('torch')} in {probed.python} sees no GPU (its CUDA: {cuda}): install a CUDA build "
                "of torch that matches the driver, or check CUDA_VISIBLE_DEVICES",
            )
        )
    arch_list = list(found.get("arch_list") or [])
    for gpu in found.get("gpus") or []:
        capability = (int(gpu["capability"][0]), int(gpu["capability"][1]))
        runs = probe.kernels_for(capability, arch_list)
        gpu["kernels"] = runs
        sm = f"sm_{capability[0]}{capability[1]}"
        if runs is None:
            problems.append(
                Problem(
                    FAIL,
                    "gpu",
                    f"GPU {gpu['index']} ({gpu['name']}, {sm}): torch {found.get('torch')} (CUDA {found.get('cuda')}) "
                    f"carries kernels for {', '.join(arch_list) or 'no architecture'} only: install a torch and "
                    f"{package} built for {sm} (on {sm} Blackwell GPUs: CUDA 12.8 or later wheels)",
                )
            )
        elif runs.startswith("compute_"):
            problems.append(
                Problem(
                    WARN,
                    "gpu",
                    f"GPU {gpu['index']} ({gpu['name']}, {sm}) runs torch's kernels as PTX compiled at load ({runs}): "
                    f"slower to start and untuned; a build for {sm} is faster",
                )
            )
    return found, problems


def model_folder(path: str, hybrid_needs: str | None) -> tuple[dict[str, Any], list[Problem]]:
    """The model: its weights there, its architecture and dtype, and what a hybrid needs of the engine
    (``hybrid_needs``: the backend's line for a hybrid target on these options, or None)."""
    folder = Path(path)
    if not folder.exists():
        return {}, [Problem(FAIL, "model", f"model.path {path} does not exist: copy the model there or fix the path")]
    if folder.is_file():
        return {"format": "gguf" if folder.suffix == ".gguf" else folder.suffix, "weights": [folder.name]}, []
    weights = sorted({p.name for pattern in WEIGHTS for p in folder.glob(pattern)})
    facts: dict[str, Any] = {"format": "folder", "weights": weights[:8], "weight_files": len(weights)}
    problems = []
    if not weights:
        problems.append(
            Problem(
                FAIL,
                "model",
                f"model.path {path} has no weight files ({', '.join(WEIGHTS[:2])}): only "
                f"{', '.join(sorted(p.name for p in folder.iterdir())[:5]) or 'nothing'}; copy the weights there",
            )
        )
    for index in folder.glob("*.index.json"):
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if missing := sorted(n for n in named if not (folder / n).exists()):
            problems.append(
                Problem(FAIL, "model", f"{index} names {len(missing)} weight files not there, e.g. {missing[0]}")
            )
    config_file = folder / "config.json"
    if not config_file.exists():
        problems.append(Problem(FAIL, "model", f"model.path {path} has no config.json"))
        return facts, problems
    config = json.loads(config_file.read_text())
    text = config.get("text_config") or config
    layer_types = list(text.get("layer_types") or [])
    facts |= {
        "architecture": (config.get("architectures") or [None])[0],
        "model_type": config.get("model_type"),
        "dtype": text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype"),
        "layers": text.get("num_hidden_layers"),
    }
    hybrid = registry.is_hybrid(config)
    facts["hybrid"] = hybrid
    if hybrid:
        facts["linear_attention_layers"] = layer_types.count("linear_attention") or None
        if hybrid_needs is not None:
            problems.append(Problem(WARN, "model", hybrid_needs))
    return facts, problems


def engine_memory(
    report: dict[str, Any], in_flight: InFlight, tokens_per_request: float, knob: str, slot: str
) -> Problem | None:
    """Whether the engine's KV cache holds the requests the build can keep in flight on it at the pilot's mean
    lengths. A failure where the cache caps the batch below what the engine would otherwise run (the
    requests the build reaches, within the engine's own cap); a warning where the rest only wait in its queue."""
    kv = report.get("kv_tokens")
    if kv is None or tokens_per_request <= 0:
        return None
    holds = int(kv // tokens_per_request)
    if holds >= in_flight.reached:
        return None
    said = f" (its log: {'; '.join(report['lines'])})" if report.get("lines") else ""
    would_run = in_flight.reached if in_flight.engine_cap is None else min(in_flight.reached, in_flight.engine_cap)
    held = f"engine {slot}: its KV cache holds {kv:,} tokens{said}, {holds} requests at the pilot's mean of "
    held += f"{tokens_per_request:.0f} tokens each, and the build keeps {in_flight.reached} in flight on it"
    if holds >= would_run:
        return Problem(
            WARN,
            "engine",
            f"{held}: the engine runs {in_flight.engine_cap} at once ({in_flight.cap_key}), which the cache "
            f"holds; the other {in_flight.reached - would_run} wait in its queue",
        )
    return Problem(
        FAIL,
        "engine",
        f"{held} ({in_flight.why}): the engine caps the batch at {holds}; raise {knob}, or lower "
        f"engine.options.max_inflight (x engine.jobs_per_engine) to at most {holds}",
    )


@dataclass(frozen=True)
class InFlight:
    """The requests a build can keep in flight on one engine: its in-flight setting, but never more than its
    jobs' shards hold nor its whole build; and the engine's own cap on running requests, where set."""

    reached: int
    why: str
    engine_cap: int | None = None
    cap_key: str = ""


def in_flight(
    per_job: int, jobs_per_engine: int, shard_requests: int, build_requests: int, engine_cap: int | None, cap_key: str
) -> InFlight:
    """``per_job``: the requests one job keeps in flight (max_inflight); ``shard_requests``: the most requests
    one shard holds (shard_size prompts x samples); ``build_requests``: every request of the build."""
    setting = per_job * jobs_per_engine
    reached = min(setting, min(per_job, shard_requests) * jobs_per_engine, build_requests)
    if reached == setting:
        why = f"max_inflight {per_job} x {jobs_per_engine} job(s) per engine"
    elif reached == build_requests:
        why = f"the build's {build_requests} requests, fewer than max_inflight {per_job} x {jobs_per_engine} job(s)"
    else:
        why = f"{jobs_per_engine} job(s) per engine of at most {shard_requests} requests a shard"
    return InFlight(reached, why, engine_cap, cap_key)


def length_share(
    source: str, finishes: Counter[str], limit: float, max_new_tokens: int, truncated: str
) -> Problem | None:
    """Too many answers at the budget: GPU time for rows `truncated: drop` throws away (a failure), or
    rows kept cut where the config keeps them on purpose (`truncated: keep`, the demo's: a warning)."""
    answered = sum(finishes.values())
    ended = finishes.get("length", 0) + finishes.get("window", 0)
    if not answered or ended / answered <= limit:
        return None
    kept = "truncated: keep keeps them cut" if truncated == "keep" else "truncated: drop drops them, GPU time lost"
    return Problem(
        WARN if truncated == "keep" else FAIL,
        "pilot",
        f"source {source}: {ended} of {answered} pilot answers end at max_new_tokens {max_new_tokens} (finish "
        f"reason length; preflight.max_length_share {limit:g}; {kept}): raise sampling.max_new_tokens (the "
        "source's or the top level) or check that the model stops (its stop ids, its template)",
    )


def thinking_switch(source: str, value: Any, same_render: bool, thinking: int, answered: int) -> Problem | None:
    """A template that renders the same with enable_thinking on and off ignores the switch: the variant
    would train on answers of the wrong mode; answers that think where it is off say the same."""
    if same_render:
        return Problem(
            FAIL,
            "pilot",
            f"source {source}: its chat template renders the same with enable_thinking {value} and its opposite, "
            "so the switch does nothing: give model.chat_template one that reads enable_thinking (Qwen3's does), or "
            "drop the setting",
        )
    if value is False and thinking:
        return Problem(
            FAIL,
            "pilot",
            f"source {source}: {thinking} of {answered} pilot answers open a reasoning block though enable_thinking "
            "is false: the template or the engine ignores the switch",
        )
    if value is True and answered and not thinking:
        return Problem(
            WARN, "pilot", f"source {source}: no pilot answer opens a reasoning block though enable_thinking is true"
        )
    return None


def verdict(problems: list[Problem]) -> str:
    return "FAIL" if any(p.level == FAIL for p in problems) else "PASS"


def summary(parts: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    return {"verdict": verdict(problems), **parts, "problems": [asdict(p) for p in problems]}


def render(summary: dict[str, Any]) -> str:
    """The summary for a reader: the verdict, each problem in one line, then what was measured."""
    lines = [f"# preflight: {summary['verdict']}", ""]
    problems = summary["problems"]
    for p in problems:
        lines.append(f"- **{p['level']}** ({p['check']}): {p['line']}")
    if not problems:
        lines.append("No problem found.")
    env = summary.get("environment") or {}
    if env:
        lines += ["", "## Environment", ""]
        lines.append(
            f"{summary['backend']} {env.get('engine', '?')} in {env.get('python')}; torch {env.get('torch', '?')}, "
            f"CUDA {env.get('cuda') or 'none'}"
        )
        for gpu in env.get("gpus") or []:
            cap = "sm_{}{}".format(*gpu["capability"])
            lines.append(f"- GPU {gpu['index']}: {gpu['name']} ({cap}), kernels: {gpu.get('kernels') or 'none'}")
    model = summary.get("model") or {}
    if model:
        lines += ["", "## Model", ""]
        lines.append(", ".join(f"{k} {v}" for k, v in model.items() if k != "weights" and v is not None))
    if summary.get("engines"):
        lines += ["", "## Engines", ""]
        lines.append("| slot | ready in (s) | KV cache tokens | peak running / waiting | peak KV usage | kernels |")
        lines.append("|---|---:|---:|---:|---:|---|")
        for e in summary["engines"]:
            kv = f"{e['kv_tokens']:,}" if e.get("kv_tokens") is not None else "?"
            load = f"{e['peak_running']:.0f} / {e.get('peak_waiting', 0):.0f}" if "peak_running" in e else "-"
            usage = f"{e['peak_kv_usage']:.1%}" if "peak_kv_usage" in e else "-"
            kernels = ", ".join(e.get("kernels") or []) or "-"
            lines.append(f"| {e['slot']} | {e['ready_seconds']} | {kv} | {load} | {usage} | {kernels} |")
    lines += _parity_lines(summary.get("parity"))
    pilot = summary.get("pilot") or {}
    if pilot.get("sources"):
        lines += ["", "## Pilot", ""]
        engines = f"{pilot['gpus']} GPUs" if summary.get("gpus_used") else "one CPU engine"
        lines.append(
            f"{pilot['rows']} rows, {pilot['generated']} answers generated in {pilot['seconds']:.1f} s: "
            f"{pilot['tokens_per_second']:.1f} output tok/s in total, {pilot['tokens_per_second_per_gpu']:.1f} per "
            f"engine ({engines}); at the build's batch ({pilot['speed_source']}): "
            f"{pilot.get('speed_tokens_per_second') or 0:.1f} tok/s per engine"
        )
        lines += ["", "| source | rows | generated | reused | finish reasons | degenerate | thinking | tool calls |"]
        lines.append("|---|---:|---:|---:|---|---|---:|---:|")
        for name, s in pilot["sources"].items():
            finishes = ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items()))
            degenerate = ", ".join(f"{k} {v}" for k, v in sorted(s["degenerate"].items())) or "-"
            lines.append(
                f"| {name} | {s['rows']} | {s['generated']} | {s['reused']} | {finishes} | {degenerate} | "
                f"{s['thinking']} | {s['tool_calls']} |"
            )
    return "\n".join(lines) + "\n"


def _parity_lines(parity: dict[str, Any] | None) -> list[str]:
    """engine.drafter's parity guard: the answers with the drafter against those without it."""
    if not parity:
        return []
    lines = ["", f"## Parity of engine.drafter: {parity['verdict']}", "", f"{parity['requests']} pilot requests."]
    if t0 := parity.get("temperature_0"):
        d, itself = t0["drafted"], t0["itself"]
        lines.append(
            f"- temperature 0: {d['identical']} of {d['answers']} identical with and without the drafter; the "
            f"engine without it agrees with itself on {itself['identical']} of {itself['answers']}; first "
            f"differing tokens: {', '.join(map(str, d['first_differ'])) or '-'}"
        )
    if sampled := parity.get("sampled"):
        for side in ("drafted", "plain"):
            s = sampled[f"{side}_sample"]
            n = len(s["lengths"])
            mean = sum(s["lengths"]) / n if n else 0.0
            finishes = ", ".join(f"{k} {v}" for k, v in sorted(Counter(s["finishes"]).items()))
            lines.append(f"- sampled, {side}: mean length {mean:.1f}, {finishes}, degenerate {sum(s['degenerate'])}")
    return lines
