"""The acceptance measurements kept in the store (config `accept`, ``store/acceptance/KEY``): where each of
the config's drafters' measurement (and the engine's calibration) lies, which ones are in use, how one is
kept and read, and what `snakemake accept` would do. The `accept` stage measures and writes them;
`plan`, `gc` and `verify` read them from here, so no command imports the stage.

A measurement's folder is named by its key (:func:`dflash_build.keys.accept_key`): a drafter renamed in
the config is not measured again, a new drafter only itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash_build import hashing, keys
from dflash_build.engines import registry
from dflash_build.plan import Plan
from dflash_build.publish import acceptance as report_mod
from dflash_build.publish import release
from dflash_build.spec import DrafterSpec
from dflash_build.store import atomic, layout

log = logging.getLogger(__name__)

REQUESTS_FILE = layout.ACCEPTANCE_REQUESTS
SUMMARY_FILE = layout.ACCEPTANCE_SUMMARY


def engine_components(plan: Plan) -> dict[str, Any]:
    """The target and what of the engine changes its numbers: every measurement's key has them."""
    cfg = plan.config
    assert cfg.accept is not None
    options = {**cfg.engine.options, **cfg.accept.engine_options}
    return {
        "target": plan.model_fingerprint["digest"],
        "backend": cfg.engine.backend,
        "engine": registry.keyed_options(cfg.engine.backend, options),
    }


def accept_key(plan: Plan, drafter: DrafterSpec, split_key: str) -> str:
    """The key of ``drafter``'s measurement on the split ``split_key`` under this config."""
    cfg = plan.config
    assert cfg.accept is not None
    named = {
        "method": drafter.method,
        "fingerprint": plan.drafter_fingerprints.get(drafter.name),
        "options": drafter.options,
    }
    return keys.accept_key(
        engine_components(plan), named, split_key, cfg.accept.max_new_tokens, cfg.degenerate.components()
    )


def folders(plan: Plan, split_key: str) -> tuple[dict[str, Path], Path | None]:
    """By drafter, the folder of the config's drafters' measurements on the split ``split_key``, and its
    calibration's (None with accept.calibration.rows 0)."""
    cfg = plan.config
    assert cfg.accept is not None
    drafters = cfg.accept.drafters.items()
    by_name = {name: layout.acceptance_dir(cfg.store, accept_key(plan, d, split_key)) for name, d in drafters}
    spec = cfg.accept.calibration
    if not spec.rows:
        return by_name, None
    calibration = {"rows": spec.rows, "max_new_tokens": spec.max_new_tokens, "draft": spec.draft_tokens}
    key = keys.calibration_key(engine_components(plan), calibration, split_key)
    return by_name, layout.acceptance_dir(cfg.store, key)


def config_folders(plan: Plan) -> tuple[release.InPlace, dict[str, Path], Path | None] | None:
    """The eval split in place, by drafter the folder the config's drafters' measurements on it go to, and
    the calibration's (None without `accept` or a split in place)."""
    cfg = plan.config
    if cfg.accept is None or release.current(cfg.eval_dir) is None:
        return None
    placed = release.in_place(cfg.eval_dir)
    return placed, *folders(plan, placed.manifest["split_key"])


def in_use(plan: Plan, reports: list[Path]) -> set[Path]:
    """The measurement folders in use: those the config's drafters (and its calibration) key to on the eval
    split in place, and those each acceptance report in ``reports`` was made from."""
    in_place = config_folders(plan)
    used: set[Path] = set()
    if in_place is not None:
        used |= set(in_place[1].values()) | ({in_place[2]} if in_place[2] else set())
    for report in reports:
        if release.current(report) is not None:
            manifest = release.in_place(report).manifest
            names = [*manifest.get("measurements", {}).values(), *filter(None, [manifest.get("calibration")])]
            used |= {layout.acceptance_dir(plan.config.store, key) for key in names}
    return used


def keep(folder: Path, table: pa.Table, summary: dict[str, Any]) -> dict[str, Any]:
    """Write a measurement: its requests, then its summary (which marks it done) with their rows and digest."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_parquet(folder / REQUESTS_FILE, table)
    record = {"rows": table.num_rows, "sha256": hashing.sha256_file(folder / REQUESTS_FILE)}
    summary = {**summary, REQUESTS_FILE: record}
    atomic.write_json(folder / SUMMARY_FILE, summary)
    return summary


def kept(folder: Path) -> dict[str, Any] | None:
    """The measurement kept in ``folder``: None when there is none, or its summary is damaged (then the
    drafter is measured again, and the summary replaced)."""
    try:
        return json.loads((folder / SUMMARY_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("accept: %s is damaged (%s): measuring again", folder / SUMMARY_FILE, e)
        return None


def preview(plan: Plan) -> str | None:
    """`plan`'s line: which drafters `snakemake accept` would serve and which it reads from the store, and
    whether the engine's calibration found its figures untrustworthy."""
    cfg = plan.config
    if cfg.accept is None:
        return None
    return "\n".join([_preview(plan), *known_broken(plan)])


def known_broken(plan: Plan) -> list[str]:
    """A line for each sampling of the split the pinned engine is known to measure wrong (or die on) under
    speculation, with the setting that works: said before any server starts."""
    cfg = plan.config
    assert cfg.accept is not None
    speculative = registry.get(cfg.engine.backend).speculative
    assert speculative is not None
    options = {**cfg.engine.options, **cfg.accept.engine_options}
    label = report_mod.sampling_label
    samplings = {label(sp.spec.sampling.as_dict()): sp.spec.sampling for sp in plan.sources.values()}
    if cfg.eval_benchmarks:
        samplings[label(cfg.sampling.as_dict())] = cfg.sampling
    lines = []
    for name, sampling in sorted(samplings.items()):
        if (why := speculative.known_broken(options, sampling.as_dict())) is not None:
            lines.append(f"accept: at {name}: {why}")
    return lines


def _preview(plan: Plan) -> str:
    cfg = plan.config
    assert cfg.accept is not None
    names = list(cfg.accept.drafters)
    in_place = config_folders(plan)
    if in_place is None:
        return f"accept: measures {len(names)} drafters ({', '.join(names)}: a server each) once the eval split is in"
    placed, by_name, calibration_folder = in_place
    if placed.manifest.get("eval_key") != plan.eval_key:
        return (
            f"accept: measures up to {len(names)} drafters ({', '.join(names)}) once the eval split is rendered again: "
            f"the one in place ({placed.manifest['split_key']}) was rendered for other settings (sampling, "
            "template, model or prompts); the build renders it first, and a drafter is measured again only where "
            "its rows changed"
        )
    todo = [name for name, folder in by_name.items() if kept(folder) is None]
    read = [name for name in names if name not in todo]
    serve = f" ({', '.join(todo)}: a server each, {placed.manifest['rows']} eval requests)" if todo else ""
    reads = f" ({', '.join(read)})" if read else ""
    line = (
        f"accept: measures {len(todo)} of {len(names)} drafters{serve}, reads {len(read)} from the store{reads}; "
        f"on the eval split in place ({placed.manifest['split_key']}: a build that changes it measures every "
        "drafter again)"
    )
    verdict = None if calibration_folder is None else kept(calibration_folder)
    if verdict is not None and not verdict["trusted"]:
        line += f"\naccept: the engine's figures are {report_mod.trust_line({'calibration': verdict})}"
    return line
