"""The key contract (dflash_build.keys): complete, and true of the keys the plan computes.

Property-style: for random small configs, every edit of a keyed field changes exactly the keys its
decision names (for the sources it touches, and only those), and every unkeyed edit changes none.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import keys
from dflash_build import plan as plan_mod
from dflash_build.engines import registry, sglang_fields
from dflash_build.engines.backends import sglang as sglang_descriptor
from tests.conftest import REPO, write_jsonl

SCHEMA = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())


def schema_fields(node: dict[str, Any], prefix: str = "") -> set[str]:
    """Every config field the schema accepts; an object with a decision of its own is one field."""
    out: set[str] = set()
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        if path in keys.CONFIG_FIELDS or ("properties" not in sub and path != "sources"):
            out.add(path)
            continue
        if path == "sources":
            out.add("sources.*")
            out |= schema_fields(sub["additionalProperties"], "sources.*.")
        else:
            out |= schema_fields(sub, f"{path}.")
    return out


def test_every_schema_field_has_a_decision_and_every_decision_a_field() -> None:
    assert schema_fields(SCHEMA) == set(keys.CONFIG_FIELDS)
    assert all(
        d.why and d.key in (None, keys.PROMPT, keys.GEN, keys.TOK, keys.EVAL) for d in keys.CONFIG_FIELDS.values()
    )


@pytest.mark.parametrize("backend", sorted(registry.BACKENDS))
def test_every_engine_option_has_a_decision_and_a_reason(backend: str) -> None:
    """Each backend's descriptor decides every option it accepts (and, where it takes names it does not
    list, those too): the key it enters, or none, and why."""
    descriptor = registry.get(backend)
    assert descriptor.options, backend
    decisions = [*descriptor.options.values(), *([descriptor.undecided] if descriptor.undecided else [])]
    assert all(d.why and d.key in (None, keys.GEN) for d in decisions), backend
    assert all(not (d.driver and d.key) for d in decisions), "an option of the driver changes no answer"
    descriptor.check(dict.fromkeys(descriptor.options, 1))  # every listed option is accepted


def test_every_sglang_server_arg_has_a_decision_and_undecided_ones_are_keyed() -> None:
    """Any ServerArgs field passes through: decided in the descriptor, or keyed (it might change the answers)."""
    sglang = registry.get("sglang")
    table = {name for name, option in sglang.options.items() if not option.driver}
    assert table <= sglang_fields.SERVER_ARGS
    for field in sglang_fields.SERVER_ARGS - set(sglang_descriptor.DRIVER_FIELDS):
        decision = sglang.decision(field)
        assert decision is not None and (field in table or decision.key == keys.GEN)


# -- the decisions hold for the keys the plan computes ---------------------------------------------------
class Workspace:
    """Files a random config can point at, and a way to compute its keys."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name, n in (("a", 9), ("b", 5), ("c", 3)):
            write_jsonl(root / f"{name}.jsonl", [{"instruction": f"{name} task {i}"} for i in range(n)])
        write_jsonl(root / "a2.jsonl", [{"instruction": f"a other task {i}"} for i in range(9)])
        self.model = root / "model"
        self.model.mkdir()
        (self.model / "model.safetensors").write_bytes(b"weights-1")
        (self.model / "config.json").write_text('{"model_type": "llama"}')
        (self.model / "tokenizer.json").write_text("{}")
        (root / "weights-2").mkdir()
        (root / "weights-2" / "model.safetensors").write_bytes(b"weights-2")
        (root / "weights-2" / "config.json").write_text('{"model_type": "llama"}')
        (root / "weights-2" / "tokenizer.json").write_text("{}")
        (root / "tok").mkdir()
        (root / "tok" / "tokenizer.json").write_text('{"other": true}')
        write_jsonl(root / "hfdata" / "train.jsonl", [{"instruction": f"hub-shaped task {i}"} for i in range(4)])
        write_jsonl(root / "ref.jsonl", [{"q": "a benchmark question of many words " * 3}])
        write_jsonl(root / "ref2.jsonl", [{"q": "another benchmark question, worded otherwise " * 3}])
        (root / "t1.jinja").write_text("{{ messages }}")
        (root / "t2.jinja").write_text("{{ messages }}!")

    def keys(self, raw: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
        path = self.root / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        plan = plan_mod.build(cfg.load(path))
        return {name: (sp.prompt_key, sp.gen_key, sp.tok_key) for name, sp in plan.sources.items()}

    def eval_key(self, raw: dict[str, Any]) -> str | None:
        path = self.root / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        return plan_mod.build(cfg.load(path)).eval_key

    def reuse_keys(self, raw: dict[str, Any]) -> dict[str, str]:
        """The key each source's rows are found under in the row index (a conversation's for turns: all)."""
        path = self.root / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        plan = plan_mod.build(cfg.load(path))
        return {
            n: sp.reuse_key if sp.spec.turns == "first" else sp.conversation_reuse_key for n, sp in plan.sources.items()
        }


def random_config(ws: Workspace, rng: random.Random) -> dict[str, Any]:
    names = rng.sample(["a", "b", "c"], rng.randint(1, 3))
    sources = {
        n: {"category": rng.choice(["x", "y"]), "format": "alpaca", "files": [str(ws.root / f"{n}.jsonl")]}
        for n in names
    }
    for n in names:  # the first source is multi-turn, so turn_samples decides something (EDITS)
        sources[n]["turns"] = "all" if n == min(names) else rng.choice(["first", "all"])
    sampling = {"temperature": rng.choice([0.0, 0.6, 1.0]), "top_k": rng.choice([0, 20]), "seed": rng.randint(0, 9)}
    filters: dict[str, Any] = {}
    if rng.random() < 0.5:  # the filters on, at their defaults, or off: each edit below holds either way
        filters["dedup"] = {"near": {}}
    if rng.random() < 0.5:  # the first source ranked: the others skip its prompts, so its edits reach them
        filters.setdefault("dedup", {})["prefer"] = [min(names)]
    if rng.random() < 0.5:
        filters["decontaminate"] = {"references": {"bench": {"files": [str(ws.root / "ref.jsonl")], "field": "q"}}}
    return {
        **filters,
        "store": str(ws.root / "store"),
        "model": {
            "path": str(ws.model),
            "chat_template": str(ws.root / "t1.jinja"),
            "tool_call_parser": rng.choice([None, "hermes"]),
        },
        "engine": {"backend": "transformers", "options": {"device": "cpu", "batch_size": rng.randint(1, 8)}},
        "sampling": sampling,
        "shard_size": rng.choice([2, 4]),
        "mix": {"categories": {"x": 1, "y": 1}},
        # sources draw their categories at random: one may end up with none (a config error otherwise)
        "checks": {"allow_shortfall": True},
        "sources": sources,
    }


# mutates the config; returns the one source it touches (or the set of them; None: every source)
Edit = Callable[[dict[str, Any], Workspace], str | set[str] | None]


def _first(c: dict[str, Any]) -> str:
    return sorted(c["sources"])[0]


def _set(path: str, value: Any) -> Edit:
    def edit(c: dict[str, Any], ws: Workspace) -> None:
        node = c
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value(node.get(last)) if callable(value) else value

    return edit


def _tool_call_parser(c: dict[str, Any], ws: Workspace) -> set[str]:
    """Another parser: it decides where the conversations of turns: all sources go on, nothing else."""
    c["model"]["tool_call_parser"] = "qwen3_coder" if c["model"].get("tool_call_parser") else "hermes"
    return {n for n, s in c["sources"].items() if s.get("turns") == "all"}


def _tool_match(c: dict[str, Any], ws: Workspace) -> set[str]:
    """tool_match on the first (turns: all) source: it decides something only with a parser."""
    name = _first(c)
    c["sources"][name]["tool_match"] = "name"
    return {name} if c["model"].get("tool_call_parser") else set()


def _source(field: str, value: Any) -> Edit:
    def edit(c: dict[str, Any], ws: Workspace) -> str:
        name = _first(c)
        node = c["sources"][name]
        *parents, last = field.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value(ws, name) if callable(value) else value
        return name

    return edit


def _readme(c: dict[str, Any], ws: Workspace) -> None:
    (ws.model / "README.md").write_text(f"a model card, edited {random.random()}")


def _config_json(c: dict[str, Any], ws: Workspace) -> None:
    (ws.model / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": random.random()}))


def _to_hf(c: dict[str, Any], ws: Workspace) -> str:
    name = _first(c)
    del c["sources"][name]["files"]
    c["sources"][name]["hf"] = {"path": str(ws.root / "hfdata")}
    return name


def _near(setting: str, value: Any) -> Edit:
    def edit(c: dict[str, Any], ws: Workspace) -> None:
        near = c.setdefault("dedup", {}).get("near") or {}
        c["dedup"]["near"] = {**near, setting: value}

    return edit


def _references(c: dict[str, Any], ws: Workspace) -> None:
    c["decontaminate"] = {"references": {"bench": {"files": [str(ws.root / "ref2.jsonl")], "field": "q"}}}


def _reference_ngram(c: dict[str, Any], ws: Workspace) -> None:
    if "decontaminate" not in c:
        _references(c, ws)
    c["decontaminate"]["ngram"] = 8


def _shard_count(c: dict[str, Any], ws: Workspace) -> None:
    c["shard_size"] = 1  # 3+ rows per source: a new shard count for every source


# (edit, the first key it changes, or None for no key)
EDITS: dict[str, tuple[Edit, str | None]] = {
    "store": (_set("store", lambda v: v + "-2"), None),
    "logs": (_set("logs", "other-logs"), None),
    "dataset.name": (_set("dataset.name", "other"), None),
    "dataset.rows_per_file": (_set("dataset.rows_per_file", 7), None),
    "model.path": (lambda c, ws: c["model"].update(path=str(ws.root / "weights-2")), keys.GEN),
    "model.path README": (_readme, None),
    "model.path config.json": (_config_json, keys.GEN),
    "model.tokenizer": (lambda c, ws: c["model"].update(tokenizer=str(ws.root / "tok")), keys.GEN),
    "model.chat_template": (_set("model.chat_template", lambda v: v.replace("t1", "t2")), keys.GEN),
    "model.chat_template_kwargs": (_set("model.chat_template_kwargs", {"enable_thinking": False}), keys.GEN),
    "model.context_length": (_set("model.context_length", 4096), keys.GEN),
    "engine.options.dtype": (_set("engine.options.dtype", "bfloat16"), keys.GEN),
    "engine.options.batch_size": (_set("engine.options.batch_size", lambda v: v + 1), None),
    "engine.options.threads": (_set("engine.options.threads", 3), None),
    "engine.gpus": (_set("engine.gpus", ["0", "1"]), None),
    "engine.base_port": (_set("engine.base_port", 32000), None),
    "engine.journal_flush_rows": (_set("engine.journal_flush_rows", 5), None),
    "sampling.temperature": (_set("sampling.temperature", lambda v: v + 0.25), keys.GEN),
    "sampling.top_p": (_set("sampling.top_p", 0.5), keys.GEN),
    "sampling.top_k": (_set("sampling.top_k", lambda v: v + 5), keys.GEN),
    "sampling.min_p": (_set("sampling.min_p", 0.1), keys.GEN),
    "sampling.max_new_tokens": (_set("sampling.max_new_tokens", 77), keys.GEN),
    "sampling.seed": (_set("sampling.seed", lambda v: v + 1), keys.GEN),
    "sampling.samples_per_prompt": (_set("sampling.samples_per_prompt", 2), keys.GEN),
    "trainer.max_length": (lambda c, ws: c.update(trainer={"max_length": 4096}), keys.GEN),
    # without a window it decides nothing: the edit sets one, with another minimum than the default
    "trainer.min_new_tokens": (lambda c, ws: c.update(trainer={"max_length": 4096, "min_new_tokens": 8}), keys.GEN),
    "shard_size": (_shard_count, keys.PROMPT),
    "truncated": (_set("truncated", "keep"), keys.TOK),
    # the random configs run the transformers backend, which stops loops: the loop rule is in gen_key
    "degenerate.loop.policy": (_set("degenerate.loop.policy", "keep"), keys.GEN),
    "degenerate.loop.max_period": (_set("degenerate.loop.max_period", 32), keys.GEN),
    "degenerate.loop.min_repeats": (_set("degenerate.loop.min_repeats", 4), keys.GEN),
    "degenerate.loop.min_span": (_set("degenerate.loop.min_span", 200), keys.GEN),
    "degenerate.loop.stop_early": (_set("degenerate.loop.stop_early", False), keys.GEN),
    "degenerate.repetitive.policy": (_set("degenerate.repetitive.policy", "keep"), keys.TOK),
    "degenerate.repetitive.ngram": (_set("degenerate.repetitive.ngram", 3), keys.TOK),
    "degenerate.repetitive.min_distinct": (_set("degenerate.repetitive.min_distinct", 0.3), keys.TOK),
    "degenerate.repetitive.min_tokens": (_set("degenerate.repetitive.min_tokens", 64), keys.TOK),
    "degenerate.unclosed_reasoning.policy": (_set("degenerate.unclosed_reasoning.policy", "keep"), keys.TOK),
    "degenerate.empty.policy": (_set("degenerate.empty.policy", "keep"), keys.TOK),
    "degenerate.reasoning_markers": (_set("degenerate.reasoning_markers", ["<r>", "</r>"]), keys.TOK),
    # the bound of a regenerate policy, which these configs do not use: nothing re-keys (with one, gen_key:
    # test_degenerate's regenerate test builds under two)
    "degenerate.retries": (_set("degenerate.retries", 3), None),
    "mix.seed": (_set("mix.seed", 5), None),
    "dedup.near.threshold": (_near("threshold", 0.6), keys.PROMPT),
    "dedup.near.ngram": (_near("ngram", 3), keys.PROMPT),
    "dedup.near.num_perm": (_near("num_perm", 64), keys.PROMPT),
    "dedup.near.seed": (_near("seed", 7), keys.PROMPT),
    "dedup.across_sources": (_set("dedup.across_sources", False), None),
    # these two change which sources rank above which: the gen keys follow from _above (below)
    "dedup.prefer": (lambda c, ws: c.setdefault("dedup", {}).update(prefer=[sorted(c["sources"])[-1]]), None),
    "decontaminate.references": (_references, keys.PROMPT),
    "decontaminate.ngram": (_reference_ngram, keys.PROMPT),
    "eval.share": (_set("eval", {"share": 0.1}), keys.PROMPT),
    "eval.cap": (_set("eval", {"cap": 3}), keys.PROMPT),
    "mix.budget_tokens": (_set("mix.budget_tokens", 1000), None),
    "mix.languages": (_set("mix.languages", {"x": {"zh": 0.2}}), None),
    "checks.share_tolerance": (_set("checks.share_tolerance", 0.3), None),
    "preflight.rows": (_set("preflight.rows", 3), None),
    "preflight.speed_rows": (_set("preflight.speed_rows", 0), None),
    "preflight.max_length_share": (_set("preflight.max_length_share", 0.9), None),
    "checks.max_failed_fraction": (_set("checks.max_failed_fraction", 1.0), None),
    "sources.*.files": (_source("files", lambda ws, n: [str(ws.root / "a2.jsonl")]), keys.PROMPT),
    "sources.*.hf": (_to_hf, keys.PROMPT),
    "sources.*.format": (_source("format", "prompt"), keys.PROMPT),
    "sources.*.fields": (_source("fields", {"input": "context"}), keys.PROMPT),
    "sources.*.roles": (_source("roles", {"narrator": "user"}), keys.PROMPT),
    "sources.*.max_samples": (_source("max_samples", 2), keys.PROMPT),
    "sources.*.languages": (_source("languages", ["en", "und"]), keys.PROMPT),
    "sources.*.seed": (_source("seed", 3), keys.PROMPT),
    "sources.*.filters.min_chars": (_source("filters.min_chars", 3), keys.PROMPT),
    "sources.*.turns": (_source("turns", "first"), keys.PROMPT),
    "sources.*.turn_samples": (_source("turn_samples", "per_turn"), keys.GEN),
    "sources.*.chat_template_kwargs_from": (
        _source("chat_template_kwargs_from", {"enable_thinking": {"field": "instruction", "default": True}}),
        keys.PROMPT,
    ),
    "sources.*.sampling": (_source("sampling", {"temperature": 0.33}), keys.GEN),
    "model.tool_call_parser": (_tool_call_parser, keys.GEN),
    "sources.*.tool_match": (_tool_match, keys.GEN),
    "sources.*.history": (_source("history", "source"), keys.PROMPT),
    "sources.*.chat_template_kwargs": (_source("chat_template_kwargs", {"enable_thinking": True}), keys.GEN),
    "sources.*.max_drop_fraction": (_source("max_drop_fraction", 0.9), None),
}
ORDER = (keys.PROMPT, keys.GEN, keys.TOK)


def test_the_edit_catalogue_covers_every_keyed_field() -> None:
    keyed = {f for f, d in keys.CONFIG_FIELDS.items() if d.key is not None}
    keyed -= {"sources.*", "sources.*.category"}  # below
    keyed -= {"model.revision"}  # a hub model: test_a_hub_models_commit_is_its_identity
    keyed -= {"sources.*.filters.max_chars"}  # the same mechanism as min_chars
    keyed -= {"variants", "sources.*.variants"}  # they rename sources: test_each_variant_edit_re_keys_its_variant_only
    keyed -= {"eval.benchmarks"}  # the eval split's alone: test_the_benchmarks_of_the_eval_split_are_keyed_by_...
    assert keyed <= {e.split(" ")[0] for e in EDITS}


def _edited(
    ws: Workspace, base: dict[str, Any], name: str, edit: Edit, measure: Callable[[dict[str, Any]], Any]
) -> tuple[dict[str, Any], str | set[str] | None, Any]:
    """One edit of the catalogue on a copy of ``base``: the config, what it touched, and ``measure`` of it
    (the model files an edit rewrites are put back after)."""
    config = copy.deepcopy(base)
    readme, config_json = ws.model / "README.md", (ws.model / "config.json").read_text()
    touched = edit(config, ws)
    if name == "sources.*.format":
        config["sources"][touched]["fields"] = {"prompt": "instruction"}
    if name == "sources.*.fields":
        config["sources"][touched]["fields"] = {"input": "instruction"}
    try:
        return config, touched, measure(config)
    finally:
        readme.unlink(missing_ok=True)
        (ws.model / "config.json").write_text(config_json)


@pytest.mark.parametrize("seed", range(4))
def test_every_edit_changes_exactly_the_keys_its_decision_names(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    ws = Workspace(tmp_path)
    base = random_config(ws, rng)
    before = ws.keys(base)
    for name, (edit, first_key) in EDITS.items():
        config, touched, after = _edited(ws, base, name, edit, ws.keys)
        above_before, above_after = _above(base, before), _above(config, after)
        for source, old in before.items():
            changed = {k for k, a, b in zip(ORDER, old, after[source], strict=True) if a != b}
            hit = touched is None or (source in touched if isinstance(touched, set) else touched == source)
            expected = set(ORDER[ORDER.index(first_key) :]) if first_key is not None and hit else set()
            if above_before[source] != above_after[source]:  # which of its prompts it skips as copies
                expected |= {keys.GEN, keys.TOK}
            assert changed == expected, f"edit {name!r} on source {source}: changed {changed}, expected {expected}"


# The edits that re-key a source's generation but not what its held-out prompts ask the engine (each
# for the component keys.NOT_IN_EVAL_KEY names): the eval split stays, and so does every measurement on it.
NOT_IN_EVAL = {"engine.options.dtype", "trainer.max_length", "trainer.min_new_tokens", "model.context_length"}
NOT_IN_EVAL |= {"model.tool_call_parser", "sources.*.tool_match", "sources.*.turn_samples"}
NOT_IN_EVAL |= {"dedup.across_sources", "dedup.prefer", "sampling.max_new_tokens", "sampling.samples_per_prompt"}
NOT_IN_EVAL |= {f"degenerate.loop.{k}" for k in ("policy", "max_period", "min_repeats", "min_span", "stop_early")}


@pytest.mark.parametrize("seed", range(3))
def test_the_eval_key_changes_exactly_with_what_the_split_asks(tmp_path: Path, seed: int) -> None:
    """With `eval` on, every edit of the catalogue that re-keys a source's prompts or generation re-keys the
    eval split, but those of NOT_IN_EVAL; an unkeyed edit re-keys nothing (so a sampling, template, kwargs,
    model or prompt edit renders the split again: Snakemake's params trigger)."""
    rng = random.Random(seed)
    ws = Workspace(tmp_path)
    base = {**random_config(ws, rng), "eval": {"share": 0.5}}
    keys_before, eval_before = ws.keys(base), ws.eval_key(base)
    assert eval_before is not None
    for name, (edit, _first_key) in EDITS.items():
        _, _, (keys_after, eval_after) = _edited(ws, base, name, edit, lambda c: (ws.keys(c), ws.eval_key(c)))
        rekeyed = any(keys_before[s][:2] != keys_after[s][:2] for s in keys_before)
        expected = rekeyed and name.split(" ")[0] not in NOT_IN_EVAL
        assert (eval_after != eval_before) == expected, f"edit {name!r}: eval key changed {eval_after != eval_before}"


def test_the_benchmarks_of_the_eval_split_are_keyed_by_content_kwargs_and_sampling(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(5))
    base["decontaminate"] = {"references": {"bench": {"files": [str(ws.root / "ref.jsonl")], "field": "q"}}}
    base["eval"] = {"share": 0.5, "benchmarks": ["bench"]}
    for source in base["sources"].values():  # the sources' own sampling: only the benchmark rows use the top level
        source["sampling"] = {"temperature": 0.5}
    before = ws.eval_key(base)
    without = copy.deepcopy(base)
    without["eval"]["benchmarks"] = []
    assert ws.eval_key(without) != before
    for edit in (
        lambda c: c["sampling"].update(top_k=7),
        lambda c: c["model"].update(chat_template_kwargs={"enable_thinking": False}),
        lambda c: c["decontaminate"]["references"]["bench"].update(files=[str(ws.root / "ref2.jsonl")]),
    ):
        config = copy.deepcopy(base)
        edit(config)
        assert ws.eval_key(config) != before
    assert ws.eval_key({**base, "eval": {"share": 0.5, "benchmarks": ["bench"]}}) == before


# The edits that change what the engine is asked besides each row's prompt ids and seed: the model, its
# numerics, the sampling and its base seed (and turns, which makes a source's rows conversations).
REQUEST_EDITS = {"model.path", "model.path config.json", "engine.options.dtype", "sources.*.sampling"}
REQUEST_EDITS |= {f"sampling.{k}" for k in ("temperature", "top_p", "top_k", "min_p", "seed")} | {"sources.*.turns"}


@pytest.mark.parametrize("seed", range(4))
def test_a_row_is_found_for_reuse_only_under_the_same_model_numerics_seed_and_sampling(
    tmp_path: Path, seed: int
) -> None:
    """Every other edit (template, tokenizer, template kwargs, budgets, prompt set, scheme-like settings)
    leaves the row index's key as it was: reuse then checks each row's prompt ids, seed, stop ids and
    budget against the request this build sends (tests/test_request_reuse.py)."""
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(seed))
    before = ws.reuse_keys(base)
    for name, (edit, _) in EDITS.items():
        _, touched, after = _edited(ws, base, name, edit, ws.reuse_keys)
        for source, old in before.items():
            hit = touched is None or (source in touched if isinstance(touched, set) else touched == source)
            moved = (
                name in REQUEST_EDITS
                and hit
                and not (name == "sources.*.turns" and base["sources"][source].get("turns") == "first")
            )
            assert (after.get(source, old) != old) is moved, f"edit {name!r} on source {source}"


def _variant_config(ws: Workspace) -> dict[str, Any]:
    return {
        "store": str(ws.root / "store"),
        "model": {"path": str(ws.model), "chat_template": str(ws.root / "t1.jinja")},
        "engine": {"backend": "transformers", "options": {"device": "cpu"}},
        "mix": {"categories": {"x": 1}},
        "variants": {
            "think": {"share": 3, "sampling": {"temperature": 0.6}, "chat_template_kwargs": {"enable_thinking": True}},
            "nothink": {
                "share": 1,
                "sampling": {"temperature": 0.7},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        },
        "sources": {
            "a": {"category": "x", "format": "alpaca", "files": [str(ws.root / "a.jsonl")]},
            "b": {"category": "x", "format": "alpaca", "files": [str(ws.root / "b.jsonl")], "variants": {}},
        },
    }


# (edit, {source: the first key it changes}); every other source keeps all three keys
VARIANT_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], dict[str, str]]] = {
    "one variant's temperature": (
        lambda c: c["variants"]["nothink"]["sampling"].update(temperature=0.9),
        {"a@nothink": keys.GEN},
    ),
    "one variant's template kwargs": (
        lambda c: c["variants"]["think"]["chat_template_kwargs"].update(preserve_thinking=True),
        {"a@think": keys.GEN},
    ),
    "a share (the draw)": (
        lambda c: c["variants"]["think"].update(share=1),
        {"a@think": keys.PROMPT, "a@nothink": keys.PROMPT},
    ),
    "a tolerance": (lambda c: c["variants"]["think"].update(tolerance=0.3), {}),
    "the source's own sampling, under both": (
        lambda c: c["sources"]["a"].update(sampling={"top_p": 0.5}),
        {"a@think": keys.GEN, "a@nothink": keys.GEN},
    ),
}


@pytest.mark.parametrize("edit", list(VARIANT_EDITS))
def test_each_variant_edit_re_keys_its_variant_only(tmp_path: Path, edit: str) -> None:
    """A variant is a source of its own: editing one variant's sampling re-keys that variant's rows only,
    the draw table re-keys the prompts of each variant of the source, and a source that opts out
    (``variants: {}``) keeps its keys."""
    ws = Workspace(tmp_path)
    base = _variant_config(ws)
    before = ws.keys(base)
    assert set(before) == {"a@think", "a@nothink", "b"}
    change, first = VARIANT_EDITS[edit]
    config = copy.deepcopy(base)
    change(config)
    after = ws.keys(config)
    for source, old in before.items():
        changed = {k for k, a, b in zip(ORDER, old, after[source], strict=True) if a != b}
        expected = set(ORDER[ORDER.index(first[source]) :]) if source in first else set()
        assert changed == expected, f"{edit}: {source} changed {changed}, expected {expected}"


def test_a_source_without_variants_keeps_its_keys_when_others_get_them(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    plain = _variant_config(ws)
    del plain["variants"]
    del plain["sources"]["b"]["variants"]
    with_variants = ws.keys(_variant_config(ws))
    assert ws.keys(plain)["b"] == with_variants["b"]
    # a's prompts are split by the draw: each variant's prompt key is its own, its gen key its sampling's
    assert len({with_variants["a@think"][0], with_variants["a@nothink"][0], ws.keys(plain)["a"][0]}) == 3


def _above(raw: dict[str, Any], keyed: dict[str, tuple[str, str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The contract of dedup.across_sources, stated apart from the code: a source skips the prompts the
    sources of dedup.prefer before it keep (all of them, for a source the list does not name), so their
    names and prompt keys decide its gen key; with across_sources off, nothing does."""
    dedup = raw.get("dedup") or {}
    names = sorted(raw["sources"])
    if dedup.get("across_sources") is False:
        return {n: [] for n in names}
    prefer = [n for n in dedup.get("prefer", []) if n in names]
    above = {n: prefer[: prefer.index(n)] if n in prefer else prefer for n in names}
    return {n: [(a, keyed[a][0]) for a in above[n]] for n in names}


def test_a_reference_sets_content_is_its_identity(tmp_path: Path) -> None:
    """Decontamination's reference files enter every prompt key by content: an edit in place changes
    every source's prompt key; the same content under another name changes none."""
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(3))
    base["decontaminate"] = {"references": {"bench": {"files": [str(ws.root / "ref.jsonl")], "field": "q"}}}
    before = ws.keys(base)
    renamed = copy.deepcopy(base)
    (ws.root / "elsewhere.jsonl").write_bytes((ws.root / "ref.jsonl").read_bytes())
    renamed["decontaminate"]["references"]["bench"]["files"] = [str(ws.root / "elsewhere.jsonl")]
    assert ws.keys(renamed) == before
    write_jsonl(ws.root / "ref.jsonl", [{"q": "an edited benchmark question " * 3}])
    after = ws.keys(base)
    assert all(after[s][0] != before[s][0] for s in before)


def test_category_and_source_name_enter_the_prompt_key(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(9))
    name = _first(base)
    before = ws.keys(base)[name]
    other = copy.deepcopy(base)
    other["sources"][name]["category"] = "y" if base["sources"][name]["category"] == "x" else "x"
    assert ws.keys(other)[name][0] != before[0]
    renamed = copy.deepcopy(base)
    renamed["sources"]["renamed"] = renamed["sources"].pop(name)
    assert ws.keys(renamed)["renamed"][0] != before[0]


@pytest.mark.parametrize(
    ("backend", "option", "value", "keyed"),
    [
        ("sglang", "quantization", "fp8", True),
        ("sglang", "kv_cache_dtype", "fp8_e5m2", True),
        ("sglang", "enable_deterministic_inference", True, True),
        ("sglang", "mem_fraction_static", 0.5, False),
        ("sglang", "cuda_graph_max_bs_decode", 64, False),
        ("sglang", "mamba_ssm_dtype", "float32", True),
        ("sglang", "page_size", 64, False),
        ("sglang", "enable_watermark", True, True),  # undecided: keyed
        ("sglang", "max_inflight", 8, False),
        ("sglang", "retries", 1, False),
        ("openai", "prompt", "text", True),
        ("openai", "concurrency", 64, False),
        ("transformers", "device", "cuda", True),  # the default dtype follows the device
    ],
)
def test_engine_option_edits(tmp_path: Path, backend: str, option: str, value: Any, keyed: bool) -> None:
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(1))
    base["engine"] = {"backend": backend, "options": {"urls": ["http://127.0.0.1:1"]} if backend == "openai" else {}}
    changed = copy.deepcopy(base)
    changed["engine"]["options"][option] = value
    before, after = ws.keys(base), ws.keys(changed)
    for source in before:
        assert (before[source][1] != after[source][1]) is keyed
        assert before[source][0] == after[source][0]


def test_spelling_out_a_default_changes_no_key(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(2))
    explicit = copy.deepcopy(base)
    explicit["engine"]["options"]["dtype"] = "float32"  # the CPU default
    assert ws.keys(base) == ws.keys(explicit)
    base["engine"] = {"backend": "sglang", "options": {}}
    explicit["engine"] = {"backend": "sglang", "options": {"dtype": "auto", "enable_deterministic_inference": False}}
    assert ws.keys(base) == ws.keys(explicit)


def test_a_hub_models_commit_is_its_identity(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(3))
    base["model"] = {"path": "org/model", "revision": "a" * 40, "chat_template": str(ws.root / "t1.jinja")}
    other = copy.deepcopy(base)
    other["model"]["revision"] = "b" * 40
    before, after = ws.keys(base), ws.keys(other)
    assert all(before[s][0] == after[s][0] and before[s][1] != after[s][1] for s in before)


def test_the_reuse_key_is_the_request_without_the_prompt_and_the_budgets() -> None:
    """keys.reuse_key is the one rule, for a plan and for a sidecar's recorded components alike: rows that
    differ in their prompt set, budget, template or scheme are found (reuse checks each row's request);
    another model, engine numerics or sampling never; the generation key tells the settings apart."""
    sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "seed": 0}
    base = {
        "scheme": 1,
        "prompt_key": "a" * 16,
        "model": "m",
        "template": "t",
        "engine": {"dtype": "auto"},
        "sampling": {**sampling, "max_new_tokens": 64, "samples_per_prompt": 1},
    }
    same = [
        {**base, "prompt_key": "b" * 16},
        {**base, "trainer_window": {"max_length": 128, "min_new_tokens": 8}},
        {**base, "sampling": {**base["sampling"], "max_new_tokens": 8, "samples_per_prompt": 3}},
        {**base, "template": "t2", "scheme": 2, "chat_template_kwargs": {"enable_thinking": True}},
    ]
    assert {keys.reuse_key(c) for c in same} == {keys.reuse_key(base)}
    other = [
        {**base, "model": "n"},
        {**base, "engine": {"dtype": "bfloat16"}},
        {**base, "sampling": {**base["sampling"], "temperature": 0.7}},
        {**base, "sampling": {**base["sampling"], "seed": 1}},
    ]
    assert keys.reuse_key(base) not in {keys.reuse_key(c) for c in other}
    assert keys.reuse_key(base) != keys.reuse_key(base, conversations=True)
    assert keys.generation_key(same[3]) != keys.generation_key(base) == keys.generation_key(same[0])


@pytest.mark.parametrize(
    ("max_length", "prompt", "budget", "skipped"),
    [(None, 5000, 64, False), (128, 40, 64, False), (128, 100, 28, True), (128, 90, 38, False), (128, 200, -72, True)],
)
def test_the_window_budget_has_one_rule(max_length: int | None, prompt: int, budget: int, skipped: bool) -> None:
    """TrainerSpec.budget and leaves_too_little are what generate applies and `plan` estimates with."""
    from dflash_build.ops.estimate import window_effect
    from dflash_build.spec import TrainerSpec

    trainer = TrainerSpec(max_length=max_length, min_new_tokens=32)
    assert trainer.budget(64, prompt) == budget and trainer.leaves_too_little(budget) is skipped
    effect = window_effect([(prompt, 64)], 1, 64, trainer, drop=False)
    if max_length is not None:
        assert effect is not None and effect.skipped_rows == float(skipped)
        assert effect.output_tokens == (0 if skipped else min(64, budget))


# -- the keys the shipped configs have, pinned ----------------------------------------------------------
PINNED_KEYS = REPO / "tests" / "data" / "pinned_keys.json"


def shipped_keys(root: Path) -> dict[str, dict[str, list[str]]]:
    """Every source's keys (prompt, gen, tok: the store's paths) of the demo config (SmolLM2's
    GGUF) and of the production config on its upstream-shaped fixtures with a stand-in model folder."""
    from tests.conftest import smollm2_gguf
    from tests.test_production_rehearsal import production_config, substitute

    model = root / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer.json").write_text("{}")
    demo = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    demo["model"]["path"] = str(smollm2_gguf())
    demo["model"]["chat_template"] = str(REPO / demo["model"]["chat_template"])
    for source in demo["sources"].values():
        source["files"] = [str(REPO / f) for f in source["files"]]
    out = {}
    for name, raw in (("demo", demo), ("production", substitute(production_config(), model))):
        raw["store"] = str(root / f"store-{name}")
        (root / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        plan = plan_mod.build(cfg.load(root / f"{name}.yaml"))
        out[name] = {s: [sp.prompt_key, sp.gen_key, sp.tok_key] for s, sp in sorted(plan.sources.items())}
    return out


def test_the_shipped_configs_keep_their_keys(tmp_path: Path) -> None:
    """A refactor re-keys nothing: the demo's and the production config's keys are the pinned ones. A
    change that means to re-key (a *_VERSION bump) says so in CHANGELOG.md and rewrites the pin with
    ``DFLASH_BUILD_PIN_KEYS=1 pytest tests/test_keys.py -k shipped``."""
    keys_now = shipped_keys(tmp_path)
    if os.environ.get("DFLASH_BUILD_PIN_KEYS"):
        PINNED_KEYS.write_text(json.dumps(keys_now, indent=1, sort_keys=True) + "\n")
    assert keys_now == json.loads(PINNED_KEYS.read_text())


def test_an_acceptance_measurement_is_keyed_by_what_changes_its_numbers(tmp_path: Path) -> None:
    """accept_key: the target, the drafter's files, method and options, the engine's numerics, the split and
    the budget; not the speed options, the report's settings or the drafter's name."""
    from dflash_build import measurements

    ws = Workspace(tmp_path)
    base = random_config(ws, random.Random(4))
    base["engine"] = {"backend": "vllm", "options": {"device": "cpu"}}
    base["eval"] = {"share": 0.5}
    drafter = {"method": "draft_model", "path": str(ws.root / "weights-2"), "options": {"num_speculative_tokens": 3}}
    base["accept"] = {"drafters": {"d": drafter}}

    def key(raw: dict[str, Any], split: str = "split-1") -> str:
        path = ws.root / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        plan = plan_mod.build(cfg.load(path))
        assert plan.config.accept is not None
        return measurements.accept_key(plan, next(iter(plan.config.accept.drafters.values())), split)

    before = key(base)
    keyed: list[Callable[[dict[str, Any]], None]] = [
        lambda c: c["model"].update(path=str(ws.root / "weights-2")),
        lambda c: c["accept"]["drafters"]["d"]["options"].update(num_speculative_tokens=4),
        lambda c: c["accept"]["drafters"]["d"].update(path=str(ws.model)),
        lambda c: c["accept"].update(max_new_tokens=64),
        lambda c: c["accept"].update(engine_options={"dtype": "bfloat16"}),
        lambda c: c["engine"]["options"].update(dtype="bfloat16"),
    ]
    unkeyed: list[Callable[[dict[str, Any]], None]] = [
        lambda c: c["accept"].update(engine_options={"max_num_seqs": 8}),
        lambda c: c["accept"].update(weakest=2),
        lambda c: c["accept"].update(drafters={"renamed": c["accept"]["drafters"]["d"]}),
        lambda c: c["accept"].update(calibration={"rows": 2}),
    ]
    for i, edit in enumerate(keyed + unkeyed):
        config = copy.deepcopy(base)
        edit(config)
        assert (key(config) != before) == (i < len(keyed)), f"edit {i}"
    assert key(base, "split-2") != before, "another split (its rows' digest)"
