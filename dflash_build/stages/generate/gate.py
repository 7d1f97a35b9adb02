"""The gate generate keeps for ``engine.drafter``: its parity guard (:mod:`dflash_build.stages.preflight.parity`)
passed on this engine identity, as the last preflight recorded it, or ``preflight.skip_parity`` says to build
anyway (a warning, and a line in the dataset's card)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build import plan as plan_mod
from dflash_build.engines import registry
from dflash_build.plan import Plan
from dflash_build.spec import ConfigError
from dflash_build.store import layout

log = logging.getLogger(__name__)


def identity(plan: Plan) -> dict[str, Any]:
    """What the verdict holds for: the backend, its keyed options, the drafter and the target's weights."""
    cfg = plan.config
    drafter = cfg.engine.drafter
    assert drafter is not None
    # its weights, not only its path: a drafter trained again in place is another drafter
    files = None if drafter.path is None else plan_mod.model_digest(Path(drafter.path), plan_mod.fingerprint_cache(cfg))
    return {
        "backend": cfg.engine.backend,
        "options": registry.keyed_options(cfg.engine.backend, cfg.engine.options),
        "drafter": dataclasses.asdict(drafter),
        "drafter_files": files,
        "model": plan.model_fingerprint.get("digest"),
    }


def identity_key(plan: Plan) -> str:
    return hashing.digest(identity(plan))[:16]


def require(plan: Plan) -> None:
    """Refuse to generate with ``engine.drafter`` unless its parity guard passed on this engine identity."""
    cfg = plan.config
    if cfg.engine.drafter is None:
        return
    if cfg.preflight.skip_parity:
        log.warning("engine.drafter: its parity guard is skipped (preflight.skip_parity): the dataset's card says so")
        return
    path = Path(layout.preflight_summary(cfg.logs, cfg.dataset_name))
    try:
        parity = json.loads(path.read_text()).get("parity") or {}
    except (OSError, ValueError):
        parity = {}
    served = cfg.engine.drafter.method + (f" {cfg.engine.drafter.path}" if cfg.engine.drafter.path else "")
    if parity.get("key") != identity_key(plan):
        raise ConfigError(
            "engine.drafter",
            f"the drafter ({served}) has no parity verdict on this engine ({cfg.engine.backend}, its options, this "
            "model): run `dflash-build preflight` (snakemake preflight) first, or set preflight.skip_parity: true",
        )
    if parity.get("verdict") != "PASS":
        raise ConfigError(
            "engine.drafter",
            f"the drafter ({served}) failed its parity guard in {path}: it changes the target's answers; fix or "
            "remove it, or set preflight.skip_parity: true",
        )
