"""`dflash-build explain`: what a target's key is made of, and for a missing one what differs from the
nearest key built before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_build import keys
from dflash_build.plan import Plan
from dflash_build.store import layout


def _components_in(stage_dir: Path, stage: str) -> dict[str, Any] | None:
    if stage == layout.PROMPTS.folder:
        manifest = stage_dir / layout.MANIFEST
        return json.loads(manifest.read_text())["components"] if manifest.exists() else None
    for stats_file in layout.sidecars(stage_dir):
        return json.loads(stats_file.read_text())["components"]
    return None


def _current(plan: Plan, stage: str, source: str) -> tuple[str, dict[str, Any]]:
    sp = plan.sources[source]
    key = layout.STAGES[stage].key  # prompt_key, and prompt_components beside it
    return getattr(sp, key), getattr(sp, key.removesuffix("_key") + "_components")


def explain(plan: Plan, stage: str, source: str, shard: str | None = None) -> list[str]:
    """Key components of a target, and for a missing one what differs from the nearest built key."""
    if source not in plan.sources:
        raise KeyError(f"source '{source}' is not in the config (sources: {', '.join(plan.sources)})")
    key, components = _current(plan, stage, source)
    folder = layout.stage_dir(plan.config.store, layout.STAGES[stage], source, key)
    target = layout.shard_file(folder, shard) if shard else folder
    lines = [f"{target} ({layout.STAGES[stage].rule}, key {key})"]
    lines += [f"  {k} = {json.dumps(v)}" for k, v in sorted(keys.flatten(components).items())]
    if target.exists():
        lines.append("built: nothing to do")
        return lines
    lines.append("missing: it will be built")
    lines += _nearest(plan, stage, source, key, components)
    return lines


def _nearest(plan: Plan, stage: str, source: str, key: str, components: dict[str, Any], depth: int = 0) -> list[str]:
    indent = "  " * (depth + 1)
    best: tuple[int, str, list[str]] | None = None
    for other in layout.source_keys(plan.config.store, layout.STAGES[stage], source):
        if other.name == key:
            continue
        old = _components_in(other, stage)
        if old is None:
            continue
        changes = keys.diff(old, components)
        if best is None or len(changes) < best[0]:
            best = (len(changes), other.name, changes)
    if best is None:
        return [f"{indent}no earlier {layout.STAGES[stage].rule} output of '{source}' in the store to compare with"]
    _, other_key, changes = best
    lines = [f"{indent}differs from {stage}/{source}/{other_key} in:"]
    for change in changes:
        lines.append(f"{indent}  {change}")
    order = list(layout.STAGES)
    upstream = order[order.index(stage) - 1] if order.index(stage) else None
    if upstream and any(c.startswith(layout.STAGES[upstream].key + ":") for c in changes):
        up_key, up_components = _current(plan, upstream, source)
        lines.append(f"{indent}{layout.STAGES[upstream].key} changed because:")
        lines += _nearest(plan, upstream, source, up_key, up_components, depth + 1)
    return lines


def parse_target(plan: Plan, target: str) -> tuple[str, str, str | None]:
    """(stage, source, shard) of a store path such as store/completions/SRC/KEY/00000.parquet."""
    parts = Path(target).parts
    store_parts = plan.config.store.parts
    rest = parts[len(store_parts) :] if parts[: len(store_parts)] == store_parts else parts
    if len(rest) < 2 or rest[0] not in layout.STAGES:
        raise ValueError(
            f"'{target}' is not a store path like "
            f"{layout.shard_file(layout.stage_dir(plan.config.store, layout.COMPLETIONS, 'SOURCE', 'KEY'), 'SHARD')}"
        )
    shard = layout.shard_of(Path(rest[3])) if len(rest) > 3 else None
    return rest[0], rest[1], shard
