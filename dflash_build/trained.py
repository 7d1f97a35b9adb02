"""The drafters the train stage trained, kept in the store (config `train`, ``store/drafters/KEY``): the
key a dataset version would be trained under, whether it was, what that would cost, and what `plan`
says of it. The stage trains and writes them; `plan`, `gc` and `verify` read them from here, so no command
imports the stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_build import keys
from dflash_build import plan as plan_mod
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import ConfigError
from dflash_build.store import layout
from dflash_build.trainers import registry as trainers


def key(plan: Plan, dataset_version: str) -> str:
    """The train key of ``dataset_version`` (a version folder's name: its manifest's digest) under this
    config's trainer, recipe, target and the settings that change the weights."""
    spec = plan.config.train
    assert spec is not None
    trainer = trainers.get(spec.trainer)
    return keys.train_key(
        dataset_version,
        target_digest(plan),
        {"trainer": trainer.name, "version": trainer.version, "recipe": spec.recipe},
        trainer.keyed(spec.recipe, spec.settings),
    )


def target_digest(plan: Plan) -> str:
    """The trainer's target by content: the build's model's fingerprint when it is the same folder."""
    spec = plan.config.train
    assert spec is not None
    if Path(spec.target) == Path(plan.config.model.path):
        return str(plan.model_fingerprint["digest"])
    if (digest := plan_mod.model_digest(Path(spec.target), plan_mod.fingerprint_cache(plan.config))) is None:
        raise ConfigError("train.target", f"'{spec.target}' holds no model files (weights, config.json)")
    return digest


def record(folder: Path) -> dict[str, Any] | None:
    """A trained drafter's record (None: none, or its training has not finished)."""
    try:
        return json.loads((folder / layout.TRAINED_RECORD).read_text())
    except (OSError, ValueError):
        return None


def rate(store: Path) -> tuple[float, dict[str, Any]] | None:
    """Dataset tokens (times epochs) per GPU-second of the store's latest finished training (a CPU one counts
    as one GPU), and its record: what `plan` estimates the next one's GPU-hours with."""
    found = []
    for folder in layout.trained_entries(store):
        rec = record(folder)
        run = (rec or {}).get("run") or {}
        tokens, seconds = (rec or {}).get("dataset", {}).get("tokens"), run.get("train_seconds")
        if rec is not None and tokens and seconds:
            epochs = epochs_of(rec["settings"])
            gpus = max(1, rec["trainer"].get("gpus") or 1)
            found.append(((folder / layout.TRAINED_RECORD).stat().st_mtime, tokens * epochs / (seconds * gpus), rec))
    if not found:
        return None
    _, per_gpu_second, rec = max(found, key=lambda f: f[0])
    return per_gpu_second, rec


def epochs_of(settings: dict[str, Any] | Any) -> int:
    """The passes over the dataset a training's settings ask for (the recipes name it num_epochs)."""
    return int(next((v["num_epochs"] for v in settings.values() if "num_epochs" in v), 1) or 1)


def preview(plan: Plan, mixes_again: bool = False) -> list[str]:
    """`plan`'s lines: whether `snakemake train` would train, on which dataset version, and why; with a
    training in the store to measure the rate from, its GPU-hours. ``mixes_again``: the build would mix the
    dataset again first (ops.standing.mixes_again), so the version in place is not the one trained on."""
    cfg = plan.config
    spec = cfg.train
    if spec is None:
        return []
    trainer = trainers.get(spec.trainer)
    what = f"{trainer.name} {trainer.version} {spec.recipe}, {spec.gpus or 'no'} GPU{'s' if spec.gpus != 1 else ''}"
    placed = release.current(cfg.dataset_dir)
    if placed is None or release.unrecorded(cfg.dataset_dir):
        return [f"train: trains a drafter ({what}) once the dataset is built"]
    version = placed.name
    if mixes_again:
        return [
            f"train: trains a drafter ({what}) on the dataset the build makes next: the mix runs again first (its "
            f"sources or settings changed), so not on version {version} in place"
        ]
    folder = layout.trained_dir(cfg.store, key(plan, version))
    if record(folder) is not None:
        return [f"train: the drafter trained on dataset version {version} is in the store ({folder}): nothing to train"]
    manifest = json.loads((placed / layout.MANIFEST).read_text())
    line = f"train: trains a drafter on dataset version {version} ({what}): never trained under this key"
    if (measured := rate(cfg.store)) is not None:
        per_gpu_second, _ = measured
        epochs = epochs_of(spec.settings)
        hours = manifest.get("tokens", 0) * epochs / per_gpu_second / 3600
        line += (
            f"; about {hours:.2f} GPU-hours at the store's last training's {per_gpu_second:,.0f} tokens per GPU-second"
        )
    return [line]


def in_use(plan: Plan, drafter_folders: list[Path]) -> set[Path]:
    """The store's drafters in use: those a published drafter folder in ``drafter_folders`` was made from
    (what gc keeps; one trained again under the same key would cost its training again)."""
    used = set()
    for folder in drafter_folders:
        if release.current(folder) is not None:
            used.add(layout.trained_dir(plan.config.store, release.in_place(folder).manifest["key"]))
    return used
