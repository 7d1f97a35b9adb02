"""A config file read and checked as a dict: a strict YAML loader (a key given twice is an error), the
schema's checks with a one-line message naming the key (and the closest valid key), and the schema's
defaults filled in. :mod:`dflash_build.config` builds the typed config from the result.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dflash_build.spec import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                where = ".".join(self._path(node)) or "the top level"
                raise ConfigError(
                    ".".join([*self._path(node), str(key)]),
                    f"given twice under {where} in {key_node.start_mark.name} (lines {seen[key]} and {line}); "
                    "YAML would silently keep only the second",
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def _path(self, node: yaml.Node) -> list[str]:
        return self._paths.get(id(node), [])

    def compose_document(self) -> yaml.Node | None:  # type: ignore[override]
        root = super().compose_document()  # type: ignore[no-untyped-call]
        self._paths: dict[int, list[str]] = {}
        todo: list[tuple[yaml.Node, list[str]]] = [(root, [])] if root is not None else []
        while todo:
            node, path = todo.pop()
            self._paths[id(node)] = path
            if isinstance(node, yaml.MappingNode):
                todo += [(value, [*path, str(key.value)]) for key, value in node.value]
            elif isinstance(node, yaml.SequenceNode):
                todo += [(item, path) for item in node.value]
        return root


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file as a dict; a key given twice in a mapping is a ConfigError with both line numbers."""
    with open(path, encoding="utf-8") as f:
        raw = yaml.load(f, Loader=_StrictLoader)  # a SafeLoader: no arbitrary objects
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError("", f"{path} holds a {type(raw).__name__}, not a mapping of config keys")
    return raw or {}


@functools.cache
def schema() -> dict[str, Any]:
    with open(SCHEMA_PATH, encoding="utf-8") as f:  # libyaml's loader: every job reads the schema
        return dict(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))


def _known_keys(schema: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Every key path the schema names (``*`` for a free name such as a source's), by its last part."""
    out: dict[str, str] = {}
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        out.setdefault(path, name)
        if isinstance(sub, Mapping):
            out.update(_known_keys(sub, path))
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping) and "properties" in extra:
        out.update(_known_keys(extra, f"{prefix}.*" if prefix else "*"))
    return out


def _closest(unknown: str, where: str, siblings: list[str]) -> str:
    """'did you mean ...' for an unknown key: a sibling first, else the nearest key anywhere."""
    import difflib

    near = difflib.get_close_matches(unknown, siblings, n=1, cutoff=0.6)
    if near:
        return f"{where}.{near[0]}" if where else near[0]
    paths = _known_keys(schema())
    anywhere = difflib.get_close_matches(unknown, sorted(set(paths.values())), n=1, cutoff=0.75)
    if not anywhere:
        return ""
    # of several keys with that name, the one that shares most of the unknown key's place
    placed = [_placed(p.split("."), where.split(".")) for p, name in paths.items() if name == anywhere[0]]
    here = where.split(".")
    return ".".join(max(placed, key=lambda parts: sum(a == b for a, b in zip(parts, here, strict=False))))


def _placed(candidate: list[str], where: list[str]) -> list[str]:
    """``candidate`` with its free names (``*``) filled in from ``where`` as far as the two agree."""
    out = []
    for i, part in enumerate(candidate):
        same_place = i < len(where) and out == where[:i]
        out.append(where[i] if part == "*" and same_place else ("NAME" if part == "*" else part))
    return out


def _enum_message(value: Any, allowed: list[Any]) -> str:
    """'is not one of ...' for a value outside an enum, with the closest valid value first."""
    import difflib

    names = [str(a) for a in allowed if a is not None]
    near = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f"did you mean '{near[0]}'? " if near else ""
    shown = ", ".join("null" if a is None else str(a) for a in allowed)
    return f"{value!r} is not a valid value; {hint}valid values: {shown}"


def check_schema(raw: Mapping[str, Any]) -> None:
    """The schema's checks, with a short message naming the key: an unknown key gets the closest valid one.

    ``snakemake.utils.validate`` then fills the defaults; its own message for a bad config quotes the
    whole schema.
    """
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    errors = list(Draft202012Validator(schema()).iter_errors(raw))
    if not errors:
        return
    error = best_match(errors)
    where = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        allowed = list((error.schema.get("properties") or {}).keys())
        unknown = sorted(str(k) for k in error.instance if k not in allowed)
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        near = _closest(unknown[0], where, allowed)
        hint = f"; did you mean '{near}'?" if near else f"; valid keys here: {', '.join(allowed)}"
        raise ConfigError(key, f"is not a config key{hint}")
    if error.validator == "enum":
        raise ConfigError(where, _enum_message(error.instance, error.validator_value))
    shown = repr(error.instance)
    message = (
        error.message.replace(shown, f"{shown[:60]}... ({len(shown)} characters)") if len(shown) > 80 else error.message
    )
    raise ConfigError(where, message)


@functools.cache
def _default_filler() -> Any:
    """A validator of the schema that fills each missing key that has a ``default``, as
    ``snakemake.utils.validate(set_default=True)`` does, built once: Snakemake's reads the schema file
    again through its YAML template engine each time (0.3 s, in every job and command)."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator: Any, properties: Any, instance: Any, schema: Any) -> Any:
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from check_properties(validator, properties, instance, schema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})(schema())


def fill_defaults(raw: dict[str, Any]) -> None:
    """The schema's defaults into ``raw``, in place (a schema error raises jsonschema's ValidationError)."""
    _default_filler().validate(raw)


def validate(raw: dict[str, Any]) -> None:
    """Check ``raw`` against the schema (a one-line error naming the key) and fill its defaults, in place."""
    check_schema(raw)
    fill_defaults(raw)


def unfilled_default(path: str) -> Any:
    """The default the schema writes as ``x-default`` for a key it does not fill in (``path``: dotted, ``*``
    for a source's name): the config must see whether a source set it, since it applies to ``turns: all``
    only (``sources.*.tool_match``)."""
    node: Any = schema()
    for part in path.split("."):
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    return node["x-default"]
