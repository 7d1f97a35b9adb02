"""Typed configuration, built from the dict that :mod:`dflash_build.configfile` read, checked and filled.

The JSON schema (config/schema.yaml) checks types and refuses unknown keys, and holds every default;
this module checks what a schema cannot: cross-references (every source category has a mix share),
files that must exist, pinned revisions. Every error names the config key it is about.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import glob
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_build import configfile, configsources, language
from dflash_build.spec import (
    DEGENERATE_REASONS,
    AcceptanceRule,
    AcceptSpec,
    Calibration,
    Checks,
    Config,
    ConfigError,
    DecontaminationSpec,
    DedupSpec,
    Degenerate,
    DrafterSpec,
    EngineSpec,
    ExportSpec,
    HeldOut,
    LoopRule,
    ModelSpec,
    NearSpec,
    PackSpec,
    PreflightSpec,
    ReferenceSpec,
    SourceSpec,
    TrainerSpec,
    TrainSpec,
    parent_name,
    trained_drafter_of,
)
from dflash_build.store import layout
from dflash_build.trainers import registry as trainers


def _mix_languages(raw: Mapping[str, Any], categories: Mapping[str, float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for category, floors in raw.items():
        key = f"mix.languages.{category}"
        if category not in categories:
            near = difflib.get_close_matches(category, list(categories), n=1)
            hint = f"did you mean '{near[0]}'?" if near else f"categories: {', '.join(sorted(categories))}"
            raise ConfigError(key, f"'{category}' is not in mix.categories ({hint})")
        for code in floors:
            problem = language.unknown_code(code)
            if problem:
                raise ConfigError(f"{key}.{code}", problem)
        if sum(floors.values()) > 1 + 1e-9:
            raise ConfigError(key, f"the floors sum to {sum(floors.values()):g}, more than the whole category")
        out[str(category)] = {str(code): float(share) for code, share in floors.items()}
    return out


def _by_acceptance(raw: Mapping[str, Any], categories: Mapping[str, float], generate: str) -> dict[str, AcceptanceRule]:
    for category in raw:
        if category not in categories:
            near = difflib.get_close_matches(category, list(categories), n=1)
            hint = f"did you mean '{near[0]}'?" if near else f"categories: {', '.join(sorted(categories))}"
            raise ConfigError(f"mix.by_acceptance.{category}", f"'{category}' is not in mix.categories ({hint})")
    rules = {
        str(c): AcceptanceRule(float(r["fraction"]), float(r["pool"]), float(r["oversample"])) for c, r in raw.items()
    }
    for category, rule in rules.items():
        if rule.oversample != 1 and generate != "as_needed":
            raise ConfigError(
                f"mix.by_acceptance.{category}.oversample",
                f"applies under mix.generate: as_needed only (mix.generate is {generate}: every prompt is "
                "generated already); set mix.generate: as_needed or remove it",
            )
    return rules


def _dedup(raw: Mapping[str, Any], sources: Mapping[str, SourceSpec]) -> DedupSpec:
    names = sorted({s.config_name for s in sources.values()})  # a source with variants is ranked whole
    for i, name in enumerate(raw["prefer"]):
        if name not in names:
            parent = parent_name(name)
            near = [parent] if parent in names else difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else f" (sources: {', '.join(names)})"
            raise ConfigError(f"dedup.prefer.{i}", f"'{name}' is not a source{hint}")
    near = raw["near"]
    return DedupSpec(
        near=None if near is None else NearSpec(**near),
        across_sources=bool(raw["across_sources"]),
        prefer=tuple(raw["prefer"]),
    )


def _decontaminate(raw: Mapping[str, Any] | None) -> DecontaminationSpec | None:
    if raw is None:
        return None
    references = {}
    for name, ref in raw["references"].items():
        key = f"decontaminate.references.{name}"
        if ("files" in ref) == ("hf" in ref):
            raise ConfigError(
                key, "give exactly one of 'files' (local json/jsonl/parquet) or 'hf' (datasets.load_dataset)"
            )
        hf = configsources.hub(ref["hf"], f"{key}.hf") if "hf" in ref else None
        references[name] = ReferenceSpec(name, tuple(ref.get("files", ())), hf, ref["field"])
    return DecontaminationSpec(int(raw["ngram"]), references)


def _eval_benchmarks(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """`eval.benchmarks`, each a set of `decontaminate.references`."""
    if "eval" not in raw:
        return ()
    references = sorted((raw["decontaminate"] or {}).get("references", {}))
    for i, name in enumerate(raw["eval"]["benchmarks"]):
        if name not in references:
            near = difflib.get_close_matches(name, references, n=1)
            raise ConfigError(
                f"eval.benchmarks.{i}",
                f"no decontaminate.references set named {name!r}" + (f"; did you mean {near[0]!r}?" if near else ""),
            )
    return tuple(raw["eval"]["benchmarks"])


def _accept(raw: Mapping[str, Any]) -> AcceptSpec | None:
    """Config key `accept` (its drafters are checked against the engine's pinned release with the
    engine: ``engines.registry.check_serving``)."""
    accept = raw.get("accept")
    if accept is None:
        return None
    if "eval" not in raw:
        raise ConfigError("accept", "measures the eval split: set `eval` (a held-out share, benchmarks) too")
    dataset = Path(raw["dataset"]["out"]) / raw["dataset"]["name"]
    trained_at = trained_drafter_of(dataset) if raw.get("train") else None
    drafters = {name: _drafter(name, d, trained_at) for name, d in accept["drafters"].items()}
    if raw.get("train"):
        _check_trained_method(raw["train"], drafters)
    return AcceptSpec(
        drafters=drafters,
        max_new_tokens=int(accept["max_new_tokens"]),
        engine_options=dict(accept["engine_options"]),
        weakest=int(accept["weakest"]),
        calibration=Calibration(
            **{f.name: int(accept["calibration"][f.name]) for f in dataclasses.fields(Calibration)}
        ),
    )


def _check_trained_method(train: Mapping[str, Any], drafters: Mapping[str, DrafterSpec]) -> None:
    """A trained drafter is served as its recipe trains it (an EAGLE-3 head is no DFlash drafter)."""
    recipe = trainers.get(train["trainer"]).recipe(train["recipe"])
    for name, drafter in drafters.items():
        if drafter.trained and drafter.method != recipe.method:
            raise ConfigError(
                f"accept.drafters.{name}.method",
                f"the train stage's {train['recipe']} recipe trains a {recipe.method} drafter: set method: "
                f"{recipe.method}",
            )


def _degenerate(raw: Mapping[str, Any], sources: Mapping[str, SourceSpec]) -> Degenerate:
    loop = dict(raw["loop"])
    greedy = sorted(name for name, s in sources.items() if s.sampling.temperature == 0)
    again = [r for r in DEGENERATE_REASONS if (loop if r == "loop" else raw[r])["policy"] == "regenerate"]
    if again and greedy:
        raise ConfigError(
            f"degenerate.{again[0]}.policy",
            f"regenerate asks again with the next seed, which greedy sampling ignores (source '{greedy[0]}' samples "
            "at temperature 0): the same answer would come back; use drop",
        )
    return Degenerate(
        loop=LoopRule(loop["max_period"], loop["min_repeats"], loop["min_span"]),
        loop_policy=loop["policy"],
        stop_early=loop["stop_early"],
        repetitive_ngram=raw["repetitive"]["ngram"],
        repetitive_min_distinct=float(raw["repetitive"]["min_distinct"]),
        repetitive_min_tokens=raw["repetitive"]["min_tokens"],
        repetitive_policy=raw["repetitive"]["policy"],
        unclosed_reasoning_policy=raw["unclosed_reasoning"]["policy"],
        empty_policy=raw["empty"]["policy"],
        reasoning_markers=tuple(raw["reasoning_markers"]),
        retries=raw["retries"],
    )


def _checks(raw: Mapping[str, Any], categories: Mapping[str, float]) -> Checks:
    allow = raw["allow_shortfall"]
    if allow is True:
        allowed = frozenset(categories)
    else:
        allowed = frozenset(allow or [])
        unknown = sorted(allowed - set(categories))
        if unknown:
            raise ConfigError(
                "checks.allow_shortfall", f"{unknown} are not in mix.categories ({', '.join(sorted(categories))})"
            )
    return Checks(
        max_drop_fraction=float(raw["max_drop_fraction"]),
        max_failed_fraction=float(raw["max_failed_fraction"]),
        share_tolerance=float(raw["share_tolerance"]),
        allow_shortfall=allowed,
        min_free_gb=float(raw["min_free_gb"]),
    )


def _finite(value: Any, key: str) -> None:
    """JSON schema lets .nan and .inf through every bound; no config number may be either."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"{value!r} is not a finite number")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, f"{key}[{i}]")


def _static_prefix(pattern: str) -> str:
    """The part of a glob pattern before its first wildcard: the folder it reads from."""
    parts = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return str(Path(*parts)) if parts else "."


def _exports(raw: Mapping[str, Any]) -> dict[str, ExportSpec]:
    """The exports, as the schema describes them: a setting with ``x-default-from`` takes that config
    value when it is null (a token export's max_length is the trainer's window unless it names its own),
    and a format's ``x-derived`` settings are the config values they name (the conversations export reads
    tool calls with the model's parser)."""
    exports = {}
    formats = configfile.schema()["properties"]["export"]["properties"]
    for fmt, given in (raw.get("export") or {}).items():
        schema = formats[fmt]
        # a format's own settings, each read (the schema filled them); the rest keep ExportSpec's neutral value
        settings = {name: given[name] for name in schema["properties"]}
        for name, sub in schema["properties"].items():
            if sub.get("x-default-from") and settings.get(name) is None:
                settings[name] = value_at(raw, sub["x-default-from"])
        for name, path in (schema.get("x-derived") or {}).items():
            settings[name] = value_at(raw, path)
        if "think" in settings:
            settings["think"] = tuple(settings["think"])
        spec = ExportSpec(format=fmt, **settings)
        if spec.long != "warn" and spec.max_length is None:
            raise ConfigError(f"export.{fmt}.max_length", f"long: {spec.long} needs the trainer's max_length")
        exports[fmt] = spec
    return exports


def value_at(raw: Mapping[str, Any], dotted: str) -> Any:
    """The value at a dotted key of a filled config (``trainer.max_length``)."""
    value: Any = raw
    for part in dotted.split("."):
        value = value[part]
    return value


def _check_dataset_dir(config: Config) -> None:
    """The mix replaces its folder whole: it must hold no input, no store, no logs and no model."""
    dataset = Path(os.path.abspath(config.dataset_dir))
    guarded: list[tuple[str, str]] = [("store", str(config.store)), ("logs", str(config.logs))]
    guarded.append(("model.path", config.model.path))
    for name, spec in config.sources.items():
        guarded += [(f"sources.{name}.files", _static_prefix(f)) for f in spec.files]
        if spec.hf is not None and spec.hf.is_local:
            guarded.append((f"sources.{name}.hf.path", spec.hf.path))
    for key, path in guarded:
        other = Path(os.path.abspath(path))
        if other == dataset or dataset in other.parents or (key in ("store", "logs") and other in dataset.parents):
            raise ConfigError(
                "dataset.out",
                f"the dataset folder '{config.dataset_dir}' overlaps {key} ('{path}'): the mix replaces that "
                "folder whole, so it must not hold or sit inside inputs, the store, the logs or the model",
            )


def _to_fill_in(raw: Mapping[str, Any]) -> list[str]:
    """Every hub dataset without a pinned commit (a placeholder such as PIN-A-COMMIT), by config key."""
    hubs = [(f"sources.{n}.hf", s.get("hf")) for n, s in raw["sources"].items()]
    references = (raw.get("decontaminate") or {}).get("references") or {}
    hubs += [(f"decontaminate.references.{n}.hf", r.get("hf")) for n, r in references.items()]
    return [
        f"{key}.revision ({hf.get('path')}: {hf.get('revision')!r})"
        for key, hf in hubs
        if hf is not None and configsources.unpinned(hf["path"], hf.get("revision"))
    ]


def from_dict(raw: Mapping[str, Any]) -> Config:
    """Build the typed config from a schema-validated dict with its defaults filled (:func:`validate`):
    every default is the schema's, written nowhere else."""
    _finite(raw, "")
    if len(unpinned := _to_fill_in(raw)) > 1:  # all at once: pinning them one error at a time is N runs
        raise ConfigError(
            unpinned[0].split(" ")[0],
            f"{len(unpinned)} hub datasets need a pinned revision (a 40-hex-digit commit; content behind a branch "
            f"can change under the same key): {', '.join(unpinned)}",
        )
    mix = raw["mix"]
    # Shares are weights: 46/26/11/9/7 sums to 99 and means exactly what it says.
    weights = {str(k): float(v) for k, v in mix["categories"].items()}
    total = sum(weights.values())
    categories = {k: v / total for k, v in weights.items()}
    checks = _checks(raw["checks"], categories)
    sources: dict[str, SourceSpec] = {}
    held_out = HeldOut(float(raw["eval"]["share"]), int(raw["eval"]["cap"])) if "eval" in raw else None
    for name, s in raw["sources"].items():
        built = configsources.sources(name, s, raw["sampling"], raw["variants"], categories, checks)
        sources.update({n: dataclasses.replace(spec, held_out=held_out) for n, spec in built.items()})
    _check_rule_names(sources)
    _check_supplied(categories, sources, checks)
    trainer = _trainer(raw["trainer"])
    dataset = raw["dataset"]
    config = Config(
        store=Path(raw["store"]),
        logs=Path(raw["logs"]),
        dataset_name=dataset["name"],
        dataset_out=Path(dataset["out"]),
        rows_per_file=dataset["rows_per_file"],
        model=_model(raw["model"]),
        engine=_engine(raw["engine"]),
        shard_size=raw["shard_size"],
        truncated=raw["truncated"],
        mix_categories=categories,
        mix_budget_tokens=mix["budget_tokens"],
        mix_seed=mix["seed"],
        mix_languages=_mix_languages(mix["languages"], categories),
        mix_generate=mix["generate"],
        mix_by_acceptance=_by_acceptance(mix["by_acceptance"], categories, mix["generate"]),
        sources=sources,
        checks=checks,
        preflight=PreflightSpec(**raw["preflight"]),
        degenerate=_degenerate(raw["degenerate"], sources),
        pack=PackSpec(**raw["pack"]) if raw.get("pack") else None,
        exports=_exports(raw),
        trainer=trainer,
        dedup=_dedup(raw["dedup"], sources),
        decontaminate=_decontaminate(raw["decontaminate"]),
        held_out=held_out,
        eval_benchmarks=_eval_benchmarks(raw),
        sampling=configsources.sampling(raw["sampling"], {}, "sampling"),
        accept=_accept(raw),
        train=_train(raw),
        raw=copy.deepcopy(dict(raw)),
    )
    _check_dataset_dir(config)
    return config


def _trainer(raw: Mapping[str, Any]) -> TrainerSpec:
    trainer = TrainerSpec(**raw)
    if trainer.max_length is not None and trainer.min_new_tokens >= trainer.max_length:
        raise ConfigError("trainer.min_new_tokens", f"must be below trainer.max_length ({trainer.max_length})")
    return trainer


def edited(config: Config, edits: Mapping[str, Any]) -> Config:
    """``config`` with ``edits`` (dotted key -> value, as a user would write them in the file) applied to
    the dict it was built from, validated and built as a file would be."""
    raw = copy.deepcopy(dict(config.raw))
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    configfile.validate(raw)
    return from_dict(raw)


def _check_rule_names(sources: Mapping[str, SourceSpec]) -> None:
    rule_names: dict[str, str] = {}
    for name in sources:
        other = rule_names.setdefault(layout.prepare_rule_name(name), name)
        if other != name:
            raise ConfigError(
                f"sources.{sources[name].config_name}",
                f"its rule name {layout.prepare_rule_name(name)} is also that of source '{other}'; rename one",
            )


def _check_supplied(categories: Mapping[str, float], sources: Mapping[str, SourceSpec], checks: Checks) -> None:
    """Every category with a share has a source (or may fall short), or the mix fails after generation."""
    supplied = {s.category for s in sources.values()}
    for category, share in categories.items():
        if share > 0 and category not in supplied and category not in checks.allow_shortfall:
            raise ConfigError(
                f"mix.categories.{category}",
                f"has a share of {share:.1%} but no source has category '{category}', so the mix would fail "
                f"after every shard is generated; add a source with `category: {category}`, remove the share, "
                f"or allow it with checks.allow_shortfall: [{category}]",
            )


def _model(model: Mapping[str, Any]) -> ModelSpec:
    if model["revision"] is None and not os.path.exists(model["path"]):
        raise ConfigError("model.path", f"'{model['path']}' does not exist (a hub id needs model.revision)")
    for opt in ("tokenizer", "chat_template"):
        if model[opt] is not None and not os.path.exists(model[opt]):
            raise ConfigError(f"model.{opt}", f"'{model[opt]}' does not exist")
    return ModelSpec(
        path=model["path"],
        revision=model["revision"],
        tokenizer=model["tokenizer"],
        chat_template=model["chat_template"],
        chat_template_kwargs=dict(model["chat_template_kwargs"]),
        context_length=model["context_length"],
        tool_call_parser=model["tool_call_parser"],
    )


def _engine(engine: Mapping[str, Any]) -> EngineSpec:
    if engine["gpus"] is not None and len(set(map(str, engine["gpus"]))) != len(engine["gpus"]):
        raise ConfigError("engine.gpus", f"lists a GPU twice: {engine['gpus']}")
    spec = EngineSpec(
        backend=engine["backend"],
        options=dict(engine["options"]),
        gpus=None if engine["gpus"] is None else tuple(str(g) for g in engine["gpus"]),
        lock_dir=Path(engine["lock_dir"]),
        gpu_wait_seconds=float(engine["gpu_wait_seconds"]),
        base_port=int(engine["base_port"]),
        journal_flush_rows=int(engine["journal_flush_rows"]),
        journal_flush_seconds=float(engine["journal_flush_seconds"]),
        shared=bool(engine["shared"]),
        jobs_per_engine=int(engine["jobs_per_engine"]),
        idle_timeout=float(engine["idle_timeout"]),
        start_timeout=float(engine["start_timeout"]),
        stall_timeout=float(engine["stall_timeout"]),
        drafter=None if engine["drafter"] is None else _drafter("generation", engine["drafter"]),
    )
    return spec


def _drafter(name: str, raw: Mapping[str, Any], trained_at: Path | None = None) -> DrafterSpec:
    """``trained_at``: where the train stage publishes its drafter (for accept's drafters; None where a
    trained drafter cannot be named, engine.drafter)."""
    if not raw.get("trained"):
        return DrafterSpec(name, raw["method"], raw.get("path"), dict(raw.get("options") or {}))
    key = f"accept.drafters.{name}"
    if trained_at is None:
        raise ConfigError(f"{key}.trained", "the `train` stage's drafter needs a `train` section: add one")
    if raw.get("path") is not None:
        raise ConfigError(f"{key}.path", f"a trained drafter is the train stage's ({trained_at}): leave path out")
    return DrafterSpec(name, raw["method"], str(trained_at), dict(raw.get("options") or {}), trained=True)


def _train(raw: Mapping[str, Any]) -> TrainSpec | None:
    """Config key `train`: the trainer, its recipe and settings checked against the pinned trainer's own
    keys (defaults filled in), before any job."""
    train = raw.get("train")
    if train is None:
        return None
    trainer = trainers.get(train["trainer"])
    settings = trainer.settings(train["recipe"], train["settings"])
    if trainer.max_gpus is not None and train["gpus"] > trainer.max_gpus:
        raise ConfigError(
            "train.gpus", f"{trainer.name} trains on {trainer.max_gpus or 'no'} GPUs here (the CPU); set it to 0"
        )
    return TrainSpec(
        trainer=trainer.name,
        recipe=train["recipe"],
        target=train["target"] or raw["model"]["path"],
        python=train["python"],
        gpus=int(train["gpus"]),
        settings=settings,
    )


def load(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Config:
    """Load, schema-validate (filling defaults) and build a config file outside Snakemake."""
    raw = configfile.read_file(path)
    raw.update(overrides or {})
    configfile.validate(raw)
    return from_dict(raw)
