"""Each config source as the source specs it builds (:func:`sources`: itself, or one per sampling
variant), with its sampling, hub reference, languages and per-turn settings checked: the source half of
:mod:`dflash_build.config`. Every error names the config key it is about."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from dflash_build import configfile, inputs, language
from dflash_build.spec import (
    SAMPLING_FIELDS,
    Checks,
    ConfigError,
    HubSpec,
    Sampling,
    SourceSpec,
    TemplateKwargFrom,
    VariantDraw,
    variant_source_name,
)


def sampling(base: Mapping[str, Any], override: Mapping[str, Any], key: str) -> Sampling:
    merged = {**base, **override}
    missing = [f for f in SAMPLING_FIELDS if f not in merged]
    if missing:
        raise ConfigError(key, f"missing sampling fields {missing}")
    if merged["top_k"] < -1:
        raise ConfigError(f"{key}.top_k", "must be -1, 0 (disabled) or positive")
    return Sampling(**{f: merged[f] for f in SAMPLING_FIELDS})


def _source(
    name: str, raw: Mapping[str, Any], base_sampling: Mapping[str, Any], mix: Mapping[str, float], checks: Checks
) -> SourceSpec:
    key = f"sources.{name}"
    has_files, has_hf = "files" in raw, "hf" in raw
    if has_files == has_hf:
        raise ConfigError(key, "give exactly one of 'files' (local json/jsonl/parquet) or 'hf' (datasets.load_dataset)")
    if raw["category"] not in mix:
        raise ConfigError(
            f"{key}.category", f"'{raw['category']}' has no share in mix.categories ({', '.join(sorted(mix))})"
        )
    fmt = inputs.get(raw["format"])
    for field_name in raw["fields"]:
        if field_name not in fmt.fields:
            raise ConfigError(f"{key}.fields.{field_name}", f"format '{fmt.name}' reads only {', '.join(fmt.fields)}")
    for field_name in fmt.required:
        if field_name not in raw["fields"]:
            raise ConfigError(
                f"{key}.fields.{field_name}", f"format '{fmt.name}' needs the name of the {field_name} column"
            )
    hf = hub(raw["hf"], f"{key}.hf") if has_hf else None
    filters = raw["filters"]
    return SourceSpec(
        name=name,
        category=raw["category"],
        format=raw["format"],
        files=tuple(raw.get("files", ())),
        hf=hf,
        fields=dict(raw["fields"]),
        roles=dict(raw["roles"]),
        max_samples=raw["max_samples"],
        seed=raw["seed"],
        min_chars=filters["min_chars"],
        max_chars=filters["max_chars"],
        sampling=sampling(base_sampling, raw["sampling"], f"{key}.sampling"),
        chat_template_kwargs=dict(raw["chat_template_kwargs"]),
        turns=raw["turns"],
        max_drop_fraction=raw.get("max_drop_fraction", checks.max_drop_fraction),
        turn_samples=_turn_samples(raw, key),
        tool_match=_tool_match(raw, key),
        history=_history(raw, key),
        chat_template_kwargs_from=_kwargs_from(raw["chat_template_kwargs_from"], key),
        languages=_languages(raw["languages"], f"{key}.languages"),
        weight=raw["weight"],
    )


def sources(
    name: str,
    raw: Mapping[str, Any],
    base_sampling: Mapping[str, Any],
    variants: Mapping[str, Any],
    mix: Mapping[str, float],
    checks: Checks,
) -> dict[str, SourceSpec]:
    """A config source as the sources it builds: itself, or one source per sampling variant (its own
    ``variants``, else the top level's), each with the variant's sampling and template kwargs merged
    over its own."""
    own = raw.get("variants")
    table = own if own is not None else variants
    if not table:
        return {name: _source(name, raw, base_sampling, mix, checks)}
    key = f"sources.{name}.variants" if own is not None else "variants"
    draw = _draw(table, key)
    out = {}
    for variant, settings in sorted(table.items()):
        merged = {
            **raw,
            "sampling": {**raw["sampling"], **settings["sampling"]},
            "chat_template_kwargs": {**raw["chat_template_kwargs"], **settings["chat_template_kwargs"]},
        }
        spec = _source(name, merged, base_sampling, mix, checks)
        weight, share = spec.weight, draw.share(variant)
        if weight is not None and share is not None:  # as_needed: the variant's part of the source's weight
            weight *= share
        full = variant_source_name(name, variant)
        out[full] = dataclasses.replace(
            spec,
            name=full,
            variant=variant,
            parent=name,
            draw=draw,
            weight=weight,
            variant_tolerance=settings["tolerance"],
        )
    return out


def _draw(table: Mapping[str, Any], key: str) -> VariantDraw:
    for variant, settings in table.items():
        if settings["every"] == ("share" in settings):
            raise ConfigError(
                f"{key}.{variant}",
                "give exactly one of 'share' (the part of the prompts drawn to it) or 'every: true' (every prompt)",
            )
        if settings["sampling"].get("top_k", 0) < -1:  # named here: the merged sampling would name the source
            raise ConfigError(f"{key}.{variant}.sampling.top_k", "must be -1, 0 (disabled) or positive")
    shares = {v: float(s["share"]) for v, s in table.items() if not s["every"]}
    return VariantDraw(shares, tuple(sorted(v for v, s in table.items() if s["every"])))


def _languages(raw: Any, key: str) -> tuple[str, ...] | None:
    if raw is None:
        return None
    for i, code in enumerate(raw):
        problem = language.unknown_code(code)
        if problem:
            raise ConfigError(f"{key}.{i}", problem)
    return tuple(raw)


def _tool_match(raw: Mapping[str, Any], key: str) -> str:
    if "tool_match" in raw and raw["turns"] != "all":
        raise ConfigError(f"{key}.tool_match", "applies to turns: all only (turns: first answers the first turn only)")
    return str(raw.get("tool_match", configfile.unfilled_default("sources.*.tool_match")))


def _history(raw: Mapping[str, Any], key: str) -> str:
    if "history" not in raw:
        return str(configfile.unfilled_default("sources.*.history"))
    if raw["turns"] != "all":
        raise ConfigError(f"{key}.history", "applies to turns: all only (turns: first has no history to regenerate)")
    if raw["history"] == "source" and raw.get("turn_samples") == "sequence":
        raise ConfigError(
            f"{key}.turn_samples",
            "history: source prompts each turn on the dataset's history, so each turn is a sample of its own: "
            "per_turn or auto",
        )
    return str(raw["history"])


def _turn_samples(raw: Mapping[str, Any], key: str) -> str:
    if "turn_samples" in raw and raw["turns"] != "all":
        raise ConfigError(f"{key}.turn_samples", "applies to turns: all only (turns: first makes one sample a row)")
    return str(raw.get("turn_samples", configfile.unfilled_default("sources.*.turn_samples")))


def _kwargs_from(raw: Mapping[str, Any], key: str) -> dict[str, TemplateKwargFrom]:
    out = {}
    for kwarg, spec in raw.items():
        mapping = spec.get("map")
        for value in mapping or {}:
            if not isinstance(value, str):
                raise ConfigError(
                    f"{key}.chat_template_kwargs_from.{kwarg}.map",
                    f"{value!r} is not a string: quote each value as the column holds it "
                    "(YAML reads a bare on/off/yes/no as a boolean)",
                )
        out[kwarg] = TemplateKwargFrom(spec["field"], None if mapping is None else dict(mapping), spec.get("default"))
    return out


_COMMIT = re.compile(r"[0-9a-f]{40}")


def unpinned(path: str, revision: str | None) -> bool:
    """A hub dataset (not a local folder) without a 40-hex-digit commit."""
    return not os.path.isdir(path) and not _COMMIT.fullmatch(revision or "")


def hub(h: Mapping[str, Any], key: str) -> HubSpec:
    hf = HubSpec(h["path"], h["name"], h["split"], h["revision"], h["data_files"])
    if unpinned(hf.path, hf.revision):
        raise ConfigError(
            f"{key}.revision",
            f"hub dataset '{hf.path}' needs a pinned revision: a 40-hex-digit commit, not {hf.revision!r} "
            "(content behind a branch can change under the same key)",
        )
    return hf
