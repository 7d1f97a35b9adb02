"""Every config error path, and what goes into which key."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import configfile
from dflash_build import plan as plan_mod
from dflash_build.spec import ConfigError
from tests.conftest import REPO, Workflow, write_jsonl


@pytest.fixture
def raw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer.json").write_text("{}")
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "hi"}, {"instruction": "yo"}])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p"}])
    return {
        "model": {"path": str(model)},
        "sources": {
            "a": {"category": "coding", "format": "alpaca", "files": ["a.jsonl"]},
            "b": {"category": "math", "format": "prompt", "files": ["b.jsonl"], "fields": {"prompt": "prompt"}},
        },
        "mix": {"categories": {"coding": 46, "math": 11}},
    }


def build(raw: dict[str, Any], tmp_path: Path) -> plan_mod.Plan:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(path))


def edit(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    *parents, last = dotted.split(".")
    node = out
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()


@pytest.mark.parametrize(
    ("dotted", "value", "key"),
    [
        ("sources.a.category", "cooking", "sources.a.category"),
        ("sources.a.hf", {"path": "org/data", "revision": "a" * 40}, "sources.a"),
        ("sources.a.files", _DELETE, "sources.a"),
        ("sources.a.fields", {"bogus": "x"}, "sources.a.fields.bogus"),
        ("sources.b.fields", {}, "sources.b.fields.prompt"),
        ("sources.a.sampling", {"top_k": -5}, "sources.a.sampling.top_k"),
        ("model.path", "/no/such/model", "model.path"),
        ("model.tokenizer", "/no/such/tokenizer", "model.tokenizer"),
        ("model.chat_template", "/no/such/template.jinja", "model.chat_template"),
        ("sources.a.files", ["nothing-*.jsonl"], "sources.a.files[0]"),
        ("sources.a.files", ["config.yaml"], "sources.a.files[0]"),
        ("mix.categories", {"coding": 46, "math": 11, "agent": 9}, "mix.categories.agent"),  # no source has it
    ],
)
def test_config_errors_name_their_key(raw: dict[str, Any], tmp_path: Path, dotted: str, value: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(edit(raw, dotted, value), tmp_path)
    assert err.value.key == key
    assert f"'{key}'" in str(err.value)


@pytest.mark.parametrize("revision", [None, "main", "v1.0"])
def test_hub_sources_need_a_pinned_commit(raw: dict[str, Any], tmp_path: Path, revision: str | None) -> None:
    changed = edit(raw, "sources.a", {"category": "coding", "format": "alpaca", "hf": {"path": "org/data"}})
    changed["sources"]["a"]["hf"]["revision"] = revision
    with pytest.raises(ConfigError, match=r"sources\.a\.hf\.revision"):
        build(changed, tmp_path)


def test_hub_source_without_max_samples_has_no_known_shard_count(raw: dict[str, Any], tmp_path: Path) -> None:
    changed = edit(
        raw, "sources.a", {"category": "coding", "format": "alpaca", "hf": {"path": "org/data", "revision": "a" * 40}}
    )
    with pytest.raises(ConfigError, match=r"sources\.a\.max_samples"):
        build(changed, tmp_path)
    changed["sources"]["a"]["max_samples"] = 10000
    plan = build(changed, tmp_path)
    assert plan.sources["a"].n_shards == 3  # 10000 rows / 4096 per shard


@pytest.mark.parametrize(
    ("dotted", "value", "key", "message"),
    [
        ("model.typo", 1, "model.typo", "is not a config key; valid keys here: path, revision, tokenizer"),
        ("sources.a.max_sample", 5, "sources.a.max_sample", "did you mean 'sources.a.max_samples'?"),
        ("sources.a.format", "csv", "sources.a.format", "'csv' is not a valid value; valid values: sharegpt"),
        ("sources.a.format", "alpacca", "sources.a.format", "did you mean 'alpaca'?"),
        ("model.tool_call_parser", "hermess", "model.tool_call_parser", "did you mean 'hermes'? valid values: null"),
        ("sources.a.sampling", {"temprature": 0.5}, "sources.a.sampling.temprature", "did you mean"),
        ("shard_size", 0, "shard_size", "0 is less than the minimum"),
        ("truncated", "maybe", "truncated", "'maybe' is not a valid value; valid values: drop, keep"),
        ("sources.bad name", {"category": "coding", "format": "alpaca", "files": ["a.jsonl"]}, "sources", "match"),
    ],
)
def test_schema_refuses_unknown_keys_and_bad_values(
    raw: dict[str, Any], tmp_path: Path, dotted: str, value: Any, key: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        build(edit(raw, dotted, value) if "." in dotted else dict(raw, **{dotted: value}), tmp_path)
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.workflow  # runs snakemake
def test_a_share_without_a_source_is_an_error_unless_its_shortfall_is_allowed(
    raw: dict[str, Any], tmp_path: Path
) -> None:
    shares = {"coding": 46, "math": 11, "agent": 9}
    with pytest.raises(ConfigError, match="no source has category 'agent', so the mix would fail"):
        build(edit(raw, "mix.categories", shares), tmp_path)
    wf = Workflow(tmp_path)
    wf.write_config(edit(raw, "mix.categories", shares))
    dry = wf.run("-n", check=False)  # the workflow refuses it when it plans, before any job
    assert dry.returncode != 0 and "config key 'mix.categories.agent'" in dry.stdout + dry.stderr
    allowed = edit(edit(raw, "mix.categories", shares), "checks", {"allow_shortfall": ["agent"]})
    assert set(build(allowed, tmp_path).config.mix_categories) == {"coding", "math", "agent"}


def test_mix_shares_are_weights(raw: dict[str, Any], tmp_path: Path) -> None:
    plan = build(raw, tmp_path)
    assert plan.config.mix_categories == pytest.approx({"coding": 46 / 57, "math": 11 / 57})


def _keys(plan: plan_mod.Plan, source: str) -> tuple[str, str, str]:
    sp = plan.sources[source]
    return sp.prompt_key, sp.gen_key, sp.tok_key


def test_what_goes_into_each_key(raw: dict[str, Any], tmp_path: Path) -> None:
    base = build(raw, tmp_path)
    a, b = _keys(base, "a"), _keys(base, "b")
    assert build(copy.deepcopy(raw), tmp_path).sources["a"].gen_key == a[1]

    sampled = build(edit(raw, "sources.a.sampling", {"temperature": 0.7}), tmp_path)
    assert _keys(sampled, "a")[0] == a[0] and _keys(sampled, "a")[1] != a[1]
    assert _keys(sampled, "b") == b

    options = build(edit(raw, "engine", {"options": {"batch_size": 99, "threads": 7}}), tmp_path)
    assert _keys(options, "a") == a and _keys(options, "b") == b

    thinking = build(edit(raw, "model.chat_template_kwargs", {"enable_thinking": False}), tmp_path)
    assert _keys(thinking, "a")[1] != a[1] and _keys(thinking, "b")[1] != b[1]

    truncated = build(dict(raw, truncated="keep"), tmp_path)
    assert _keys(truncated, "a")[:2] == a[:2] and _keys(truncated, "a")[2] != a[2]

    selected = build(edit(raw, "sources.a.max_samples", 1), tmp_path)
    assert _keys(selected, "a")[0] != a[0] and _keys(selected, "b") == b
    # ranked first (dedup.prefer), a's prompt set decides which of b's prompts b skips as copies
    ranked = edit(raw, "dedup", {"prefer": ["a"]})
    before, after = build(ranked, tmp_path), build(edit(ranked, "sources.a.max_samples", 1), tmp_path)
    assert _keys(after, "b")[0] == _keys(before, "b")[0] and _keys(after, "b")[1] != _keys(before, "b")[1]

    (Path(raw["model"]["path"]) / "model.safetensors").write_bytes(b"other weights")
    reweighted = build(raw, tmp_path)
    assert reweighted.model_fingerprint != base.model_fingerprint
    assert reweighted.template_fingerprint == base.template_fingerprint
    assert _keys(reweighted, "a")[1] != a[1] and _keys(reweighted, "b")[1] != b[1]


def test_prompt_key_follows_content_not_file_names(raw: dict[str, Any], tmp_path: Path) -> None:
    before = build(raw, tmp_path).sources["a"].prompt_key
    (tmp_path / "a.jsonl").rename(tmp_path / "renamed.jsonl")
    assert build(edit(raw, "sources.a.files", ["renamed.jsonl"]), tmp_path).sources["a"].prompt_key == before
    write_jsonl(tmp_path / "renamed.jsonl", [{"instruction": "hi"}, {"instruction": "changed"}])
    assert build(edit(raw, "sources.a.files", ["renamed.jsonl"]), tmp_path).sources["a"].prompt_key != before


def test_production_config_is_schema_valid_and_refuses_unpinned_revisions() -> None:
    from snakemake.utils import validate

    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(raw, str(configfile.SCHEMA_PATH))
    assert sum(raw["mix"]["categories"].values()) == pytest.approx(0.99)
    with pytest.raises(ConfigError, match=r"hf.revision"):
        cfg.from_dict(dict(raw, model={**raw["model"], "revision": "r"}))


def test_the_defaults_we_fill_are_snakemakes(raw: dict[str, Any]) -> None:
    """config.validate fills the schema's defaults as snakemake.utils.validate(set_default=True) does,
    on configs Snakemake's can fill: it calls setdefault on a null object (decontaminate: null), which
    ours leaves null."""
    from snakemake.utils import validate

    decontaminated = dict(raw, decontaminate={"references": {"b": {"files": ["b.jsonl"], "field": "prompt"}}})
    for config in (yaml.safe_load((REPO / "config" / "config.yaml").read_text()), decontaminated):
        theirs, ours = copy.deepcopy(config), copy.deepcopy(config)
        validate(theirs, str(configfile.SCHEMA_PATH))
        configfile.validate(ours)
        assert ours == theirs
    filled: dict[str, Any] = copy.deepcopy(raw)
    configfile.validate(filled)
    assert filled["decontaminate"] is None and filled["dedup"]["near"] is None
    filled["dedup"]["prefer"].append("x")  # a default is the caller's own copy, not the schema's
    again = copy.deepcopy(raw)
    configfile.validate(again)
    assert again["dedup"]["prefer"] == []


def _schema_defaults(schema: dict[str, Any], node: Any, path: str = "") -> list[str]:
    """The dotted path of every key of ``node`` (a filled config) that holds the schema's default."""
    found = []
    if not isinstance(node, dict):
        return found
    for name, value in node.items():
        sub = (schema.get("properties") or {}).get(name)
        if sub is None and isinstance(schema.get("additionalProperties"), dict):
            sub = schema["additionalProperties"]
        if sub is None:
            continue
        here = f"{path}.{name}" if path else name
        if "default" in sub and value == sub["default"]:
            found.append(here)
        found += _schema_defaults(sub, value, here)
    return found


def test_every_schema_default_is_the_one_the_config_uses(raw: dict[str, Any], tmp_path: Path) -> None:
    """Each key the schema fills with a default, removed from a filled config: from_dict refuses (it reads
    the key: the schema's default is the only one) or builds the same config (a settings type's own
    default, e.g. PackSpec's, agrees with the schema's). Walked on a config that sets every optional part
    (a hub source, dedup.near, decontaminate, pack, exports, a trainer window)."""
    full = copy.deepcopy(raw)
    full["sources"]["h"] = {"category": "math", "format": "prompt", "fields": {"prompt": "p"}, "max_samples": 4,
                            "hf": {"path": str(tmp_path)}}  # fmt: skip
    full["dedup"] = {"near": {}}
    full["decontaminate"] = {"references": {"r": {"hf": {"path": str(tmp_path)}, "field": "q"}}}
    full["pack"] = {"seq_len": 64}
    full["export"] = {"specforge": {}, "speculators": {}, "conversations": {}}
    full["trainer"] = {"max_length": 256}
    full["eval"] = {}
    full["accept"] = {"drafters": {"d": {"method": "ngram"}}}
    configfile.validate(full)
    expected = cfg.from_dict(full)
    paths = _schema_defaults(configfile.schema(), full)
    assert {"engine.stall_timeout", "sources.h.hf.split", "decontaminate.references.r.hf.split"} <= set(paths)
    assert {"decontaminate.ngram", "checks.min_free_gb", "pack.window", "export.specforge.long"} <= set(paths)
    assert {"eval.share", "eval.cap", "accept.max_new_tokens", "accept.drafters.d.options"} <= set(paths)
    disagree = []
    for path in paths:
        config = copy.deepcopy(full)
        *parents, last = path.split(".")
        node = config
        for part in parents:
            node = node[part]
        del node[last]
        try:
            built = cfg.from_dict(config)
        except (KeyError, ConfigError):  # refused: the key is read, not defaulted again
            continue
        if built != expected:
            disagree.append(path)
    assert disagree == []


@pytest.mark.workflow  # runs snakemake
def test_snakemake_stops_before_any_job_on_a_bad_config(tmp_path: Path) -> None:
    wf = Workflow(tmp_path)
    wf.write_config({"model": {"path": "x"}, "sources": {}, "mix": {"categories": {"c": 1}}, "stroe": "s"})
    proc = wf.run("-n", check=False)
    assert proc.returncode != 0
    assert "config key 'stroe': is not a config key; did you mean 'store'?" in proc.stdout + proc.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    ("typo", "value", "closest"),
    [
        ("stroe", "s", "store"),
        ("sources.a.sampling.temprature", 0.3, "sources.a.sampling.temperature"),
        ("sources.a.temprature", 0.3, "sources.a.sampling.temperature"),  # one level too high
        ("sampling.max_new_token", 9, "sampling.max_new_tokens"),
        ("engine.shraed", True, "engine.shared"),
        ("mix.budget_token", 9, "mix.budget_tokens"),
        ("checks.share_tolerence", 0.1, "checks.share_tolerance"),
    ],
)
def test_an_unknown_key_is_answered_with_the_closest_valid_key_in_one_line(
    raw: dict[str, Any], tmp_path: Path, typo: str, value: Any, closest: str
) -> None:
    parent, _, last = typo.rpartition(".")
    edited = copy.deepcopy(raw)
    node = edited
    for part in parent.split(".") if parent else []:
        node = node.setdefault(part, {})
    node[last] = value
    with pytest.raises(ConfigError) as err:
        build(edited, tmp_path)
    assert str(err.value) == f"config key '{typo}': is not a config key; did you mean '{closest}'?"


def test_a_wrong_value_is_named_by_its_key_without_the_schema(raw: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build(edit(raw, "sources.a.sampling", {"top_p": 3}), tmp_path)
    assert str(err.value) == "config key 'sources.a.sampling.top_p': 3 is greater than the maximum of 1"


DUPLICATED = """\
model:
  path: {model}
sources:
  a: {{category: coding, format: alpaca, files: [a.jsonl]}}
  b: {{category: math, format: prompt, files: [b.jsonl]}}
  a:
    category: math
    format: alpaca
    files: [a.jsonl]
mix:
  categories: {{coding: 46, math: 11}}
"""


@pytest.mark.workflow  # runs snakemake
def test_a_key_given_twice_is_refused_with_both_lines(raw: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(DUPLICATED.format(model=raw["model"]["path"]))
    message = f"config key 'sources.a': given twice under sources in {path} (lines 4 and 6)"
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.load(path)
    proc = Workflow(tmp_path).run("-n", check=False)  # the workflow reads its config files the same way
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr
    assert not (tmp_path / "store").exists()
    nested = DUPLICATED.format(model=raw["model"]["path"]).replace(
        "  a:\n    category: math", "  c:\n    category: math"
    )
    path.write_text(nested.replace("format: alpaca\n    files", "format: alpaca\n    format: prompt\n    files"))
    with pytest.raises(ConfigError, match=re.escape("config key 'sources.c.format': given twice under sources.c")):
        cfg.load(path)


def test_per_source_template_kwargs_change_only_that_sources_gen_key(raw: dict[str, Any], tmp_path: Path) -> None:
    base = build(raw, tmp_path)
    changed = build(edit(raw, "sources.a.chat_template_kwargs", {"enable_thinking": False}), tmp_path)
    assert changed.sources["a"].gen_components["chat_template_kwargs"] == {"enable_thinking": False}
    assert changed.sources["a"].gen_key != base.sources["a"].gen_key
    assert changed.sources["b"].gen_key == base.sources["b"].gen_key
    model_wide = build(edit(raw, "model.chat_template_kwargs", {"enable_thinking": True}), tmp_path)
    merged = build(
        edit(
            edit(raw, "model.chat_template_kwargs", {"enable_thinking": True}),
            "sources.a.chat_template_kwargs",
            {"x": 1},
        ),
        tmp_path,
    )
    assert merged.sources["a"].gen_components["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}
    assert model_wide.sources["b"].gen_key == merged.sources["b"].gen_key


@pytest.mark.parametrize(
    ("dotted", "value", "key"),
    [
        ("sampling", {"top_p": float("nan")}, "sampling.top_p"),
        ("sources.a.sampling", {"temperature": float("inf")}, "sources.a.sampling.temperature"),
        ("mix.categories", {"coding": float("nan"), "math": 1}, "mix.categories.coding"),
    ],
)
def test_non_finite_numbers_are_refused(raw: dict[str, Any], tmp_path: Path, dotted: str, value: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg.from_dict(_defaults(edit(raw, dotted, value)))
    assert err.value.key == key


def _defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """Schema defaults filled in (the schema lets non-finite numbers through)."""
    validated = copy.deepcopy(raw)
    configfile.fill_defaults(validated)
    return validated


@pytest.mark.parametrize(
    ("variants", "where", "key"),
    [
        ({"x": {"share": 1, "every": True}}, "variants", "variants.x"),
        ({"x": {}}, "variants", "variants.x"),
        ({"x": {"share": 1, "sampling": {"top_k": -3}}}, "sources.a.variants", "sources.a.variants.x.sampling.top_k"),
        ({"x@y": {"share": 1}}, "variants", "variants"),  # @ joins a source and its variant
    ],
)
def test_variant_errors_name_their_key(
    raw: dict[str, Any], tmp_path: Path, variants: dict[str, Any], where: str, key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        build(edit(raw, where, variants), tmp_path)
    assert err.value.key == key


def test_a_source_with_variants_is_ranked_and_named_by_its_own_name(raw: dict[str, Any], tmp_path: Path) -> None:
    raw = {**raw, "variants": {"think": {"share": 2}, "fast": {"share": 1, "sampling": {"temperature": 0.9}}}}
    raw["sources"]["b"]["variants"] = {}
    raw["dedup"] = {"prefer": ["a"]}
    plan = build(raw, tmp_path)
    assert sorted(plan.sources) == ["a@fast", "a@think", "b"]
    assert plan.sources["a@fast"].spec.sampling.temperature == 0.9
    assert plan.sources["a@think"].spec.sampling.temperature == 0.6  # the source's (the default)
    assert plan.sources["b"].above == ()  # no variant: ranked apart from a's variants
    with pytest.raises(ConfigError, match="did you mean 'a'") as err:
        build({**raw, "dedup": {"prefer": ["a@think"]}}, tmp_path)
    assert err.value.key == "dedup.prefer.0"


def test_sources_whose_rule_names_collide_are_refused(raw: dict[str, Any], tmp_path: Path) -> None:
    collide = edit(raw, "sources", {**raw["sources"], "a-b": raw["sources"]["a"], "a_b": raw["sources"]["a"]})
    with pytest.raises(ConfigError, match="prepare_a_b is also that of source 'a-b'") as err:
        build(collide, tmp_path)
    assert err.value.key == "sources.a_b"


def test_names_that_cannot_be_files_are_refused_by_the_schema(raw: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"too long|longer than"):
        build(edit(raw, "sources", {**raw["sources"], "s" * 300: raw["sources"]["a"]}), tmp_path)


@pytest.mark.parametrize(
    "dataset",
    [
        {"out": ".", "name": "store"},  # the store itself
        {"out": "store", "name": "mix"},  # inside the store
        {"out": ".", "name": "logs"},
        {"out": "..", "name": "HERE"},  # the working directory: holds the inputs and the store
        {"out": ".", "name": "model"},
    ],
)
def test_the_dataset_folder_may_not_overlap_inputs_store_logs_or_model(
    raw: dict[str, Any], tmp_path: Path, dataset: dict[str, str]
) -> None:
    dataset = {k: v.replace("HERE", tmp_path.name) for k, v in dataset.items()}
    with pytest.raises(ConfigError, match="overlaps") as err:
        build(edit(raw, "dataset", dataset), tmp_path)
    assert err.value.key == "dataset.out"
    build(edit(raw, "dataset", {"out": "dist", "name": "mix"}), tmp_path)  # the usual place is fine


def test_a_dataset_folder_over_a_globbed_input_folder_is_refused(raw: dict[str, Any], tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "c.jsonl", [{"instruction": "x"}])
    changed = edit(raw, "sources.a.files", ["data/*.jsonl"])
    with pytest.raises(ConfigError, match=r"sources\.a\.files"):
        build(edit(changed, "dataset", {"out": ".", "name": "data"}), tmp_path)


def test_the_trainer_window_keys_generation_only_when_set_and_is_the_exports_default(
    raw: dict[str, Any], tmp_path: Path
) -> None:
    base = build(raw, tmp_path)
    assert "trainer_window" not in base.sources["a"].gen_components, "configs without a window keep their keys"
    windowed = build(edit(raw, "trainer", {"max_length": 4096}), tmp_path)
    assert windowed.sources["a"].gen_components["trainer_window"] == {"max_length": 4096, "min_new_tokens": 32}
    assert all(windowed.sources[s].gen_key != base.sources[s].gen_key for s in base.sources)
    assert windowed.sources["a"].prompt_key == base.sources["a"].prompt_key, "the prompts stay"
    exported = edit(raw, "trainer", {"max_length": 4096})
    exported["export"] = {"specforge": {}, "speculators": {"max_length": 2048}, "conversations": {}}
    exports = build(exported, tmp_path).config.exports
    assert (exports["specforge"].max_length, exports["speculators"].max_length) == (4096, 2048)
    assert exports["conversations"].max_length is None
    with pytest.raises(ConfigError, match=r"trainer\.min_new_tokens"):
        build(edit(raw, "trainer", {"max_length": 64, "min_new_tokens": 64}), tmp_path)


def test_history_needs_turns_all_and_per_turn_samples(tmp_path: Path) -> None:
    for source, key in (
        ({"history": "source"}, "sources.s.history"),
        ({"turns": "all", "history": "source", "turn_samples": "sequence"}, "sources.s.turn_samples"),
    ):
        raw = {
            "model": {"path": "m"},
            "sources": {"s": {"category": "c", "format": "messages", "files": ["f.jsonl"], **source}},
        }
        raw["mix"] = {"categories": {"c": 1}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError) as e:
            cfg.load(tmp_path / "c.yaml")
        assert e.value.key == key, e.value


# -- one place for every default ----------------------------------------------------------------------------
CONFIG_MAPPINGS = ("raw", "options", "engine_options", "settings", "given", "config")


def _defaults_in_code(tree: ast.Module) -> list[int]:
    """Lines of ``raw.get("name", VALUE)`` (a config mapping or engine options, VALUE a literal): a default
    written in code."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
            continue
        receiver = node.func.value
        name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
        if name in CONFIG_MAPPINGS and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
            default = node.args[1]
            if isinstance(default, ast.Constant | ast.Tuple | ast.List | ast.Dict) and ast.unparse(default) != "()":
                found.append(node.lineno)
    return found


def test_no_default_is_written_outside_the_schema_and_the_backend_descriptors() -> None:
    """A config key's default is the schema's (``default``, or ``x-default`` for a key it cannot fill in);
    an engine option's is its backend's descriptor's (engines/backends/). Nothing else writes one."""
    written = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / "dflash_build").rglob("*.py"))
        if "backends" not in path.parts
        for line in _defaults_in_code(ast.parse(path.read_text()))
    ]
    assert not written, written
    assert _defaults_in_code(ast.parse('raw.get("tool_match", "arguments")\noptions.get("urls")')) == [1]


@pytest.mark.parametrize("key", ["tool_match", "history", "turn_samples"])
def test_a_key_the_schema_cannot_fill_takes_its_unfilled_default(key: str, tmp_path: Path) -> None:
    """x-default: what a turns: all source has when it does not set the key (and turns: first refuses it)."""
    data = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    raw = {"model": {"path": str(tmp_path)}, "mix": {"categories": {"x": 1}}}
    raw["sources"] = {"a": {"category": "x", "format": "messages", "files": [str(data)], "turns": "all"}}
    (tmp_path / "config.json").write_text("{}")
    schema_default = configfile.unfilled_default(f"sources.*.{key}")
    assert getattr(cfg.from_dict(_defaults(raw)).sources["a"], key) == schema_default
    raw["sources"]["a"].update({"turns": "first", key: schema_default})
    with pytest.raises(ConfigError, match=f"sources.a.{key}"):
        cfg.from_dict(_defaults(raw))


def test_vllm_that_cannot_start_here_fails_plan_in_one_line_naming_the_setting(
    raw: dict[str, Any], tmp_path: Path
) -> None:
    """Without a GPU (nothing on PATH lists one, no scheduler) vLLM needs `device: cpu`; from an interpreter
    without vLLM, `python` naming one (the venv `make setup` builds): said by `plan`, before any job."""
    import subprocess
    import sys

    def plan(engine: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "engine": engine}))
        env = {"PATH": str(tmp_path / "no-tools"), "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-m", "dflash_build", "--configfile", "config.yaml", "plan"]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    no_device = plan({"backend": "vllm"})
    assert no_device.returncode == 2 and len(no_device.stderr.strip().splitlines()) == 1, no_device.stderr
    assert "config key 'engine.options.device'" in no_device.stderr and "device: cpu" in no_device.stderr
    no_vllm = plan({"backend": "vllm", "options": {"device": "cpu"}})
    assert no_vllm.returncode == 2 and len(no_vllm.stderr.strip().splitlines()) == 1, no_vllm.stderr
    assert "config key 'engine.options.python'" in no_vllm.stderr and ".venv-vllm/bin/python" in no_vllm.stderr
