"""The drafter trained on the dataset (config key `train`): the trainer backend (:mod:`dflash_build.trainers`)
trains it on the published dataset version's own rows (``input_ids``, ``loss_mask``: the target's exact
tokens) and the build publishes its checkpoint to ``dist/NAME-drafter``, which accept's `trained` drafter
is.

The checkpoint is kept in the store by :func:`dflash_build.keys.train_key`: the dataset version (the
digest of its manifest, which lists every file's digest), the target's fingerprint, the trainer, its pinned
release and recipe, and the settings that change the weights. A rebuilt dataset with other rows trains
again; the same rows (a rerun, a rebuild that changed nothing) take the drafter from the store. A training
that fails leaves the trainer's scratch (``KEY.work``) to look at and the drafter in place as it was; the
next run trains again (neither trainer's runner resumes: Automodel would resume from any checkpoint in its
folder, whatever its settings, and SpecForge's managed run needs a fresh one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dflash_build import hashing, running, trained
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import ConfigError, TrainSpec
from dflash_build.stages.common import chat
from dflash_build.stages.common.job import Job, StageFailure
from dflash_build.store import atomic, layout
from dflash_build.trainers import base
from dflash_build.trainers import registry as trainers

log = logging.getLogger(__name__)

RUN_FILE = "run.json"  # in the work folder: what the trainer is asked for


def run(job: Job) -> dict[str, Any]:
    """Train on the dataset version in place (or take the drafter trained on it before) and publish it."""
    plan = job.plan
    spec = plan.config.train
    assert spec is not None
    trainer = trainers.get(spec.trainer)
    placed = release.in_place(job.published("dataset"))
    check_target(plan, spec)
    key = trained.key(plan, placed.version.name)
    folder = layout.trained_dir(plan.config.store, key)
    record = trained.record(folder)
    if record is not None:
        log.info("train: trained on dataset version %s before (%s): nothing to run", placed.version.name, folder)
        running.progress(step="trained before: nothing to run")
    else:
        check_environment(trainer, spec)
        record = train(plan, spec, trainer, placed, key, folder)
    publish(job.output("record"), folder, record)
    return record


def check_target(plan: Plan, spec: TrainSpec) -> None:
    """The trainer's target is a model folder its recipe loads, and it tokenizes as the dataset was
    tokenized (another model's tokens would train the drafter on ids that mean other words). One line,
    before the trainer starts."""
    target = Path(spec.target)
    trainer = trainers.get(spec.trainer)
    recipe = trainer.recipe(spec.recipe)
    try:
        conf = json.loads((target / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            "train.target" if spec.target != plan.config.model.path else "model.path",
            f"{target} is no model folder the trainer can load ({type(e).__name__}: no readable config.json); "
            "set train.target to the target's Hugging Face folder",
        ) from None
    architectures = conf.get("architectures") or []
    if recipe.targets and not set(architectures) & set(recipe.targets):
        raise ConfigError(
            "train.target",
            f"{target} is a {', '.join(architectures) or 'model of no stated architecture'}: {trainer.name} "
            f"{trainer.version}'s {spec.recipe} recipe trains drafters for {', '.join(recipe.targets)} only",
        )
    if Path(spec.target) != Path(plan.config.model.path):
        dataset = chat.load_tokenizer(plan.config.model, plan.tokenizer_cache())
        own = chat.load_tokenizer(dataclasses.replace(plan.config.model, path=spec.target, tokenizer=None))
        if dataset.get_vocab() != own.get_vocab():
            raise ConfigError(
                "train.target",
                f"{target} tokenizes otherwise than {plan.config.model.tokenizer or plan.config.model.path}, which "
                "the dataset was tokenized with: the drafter would learn another model's token ids",
            )


def check_environment(trainer: base.Trainer, spec: TrainSpec) -> None:
    """The trainer's interpreter has the trainer at its pinned release (one line naming what to run)."""
    python = spec.python or sys.executable
    found = base.installed_version(python, trainer.package)
    setup = (
        f"`make setup` builds {trainer.venv} with {trainer.name} {trainer.version}: "
        f"`train.python: {trainer.venv}/bin/python`"
    )
    if found is None:
        raise ConfigError("train.python", f"{python} has no {trainer.package} to train with; {setup}")
    if found != trainer.version:
        raise ConfigError(
            "train.python",
            f"{python} has {trainer.package} {found}, and this build is tested on {trainer.version}; {setup}",
        )
    if (why := trainer.runs_here()) is not None:
        raise ConfigError("train.trainer", why)


def train(
    plan: Plan, spec: TrainSpec, trainer: base.Trainer, placed: release.InPlace, key: str, folder: Path
) -> dict[str, Any]:
    """Run the trainer on the dataset's rows; the checkpoint it leaves becomes ``folder``, its record (which
    this returns) last."""
    work = layout.trained_work_dir(plan.config.store, key)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "drafter"  # the trainer writes it whole or not at all; moved into place below
    if out.exists():  # a run that finished its checkpoint and was stopped before it was moved
        log.info("train: the trainer's checkpoint of the last run is complete (%s): taking it", out)
    else:
        run_spec = base.Run(
            spec.recipe, Path(spec.target), tuple(placed.files), out, work / "trainer", spec.settings, spec.gpus
        )
        atomic.write_json(work / RUN_FILE, run_spec.as_dict())
        argv = trainer.command(spec.python or sys.executable, work / RUN_FILE, run_spec)
        started = time.monotonic()
        returncode, tail = _follow(argv, trainer)
        if returncode != 0 or not out.is_dir():
            raise StageFailure(
                f"train: {trainer.name} stopped (exit {returncode}) on dataset version {placed.version.name}: "
                f"{tail or 'no output'}; its scratch is {work / 'trainer'}, the drafter in place stays, and the "
                "next run trains again"
            )
        log.info("train: %s trained in %.0f s", trainer.name, time.monotonic() - started)
    trained = json.loads((out / base.TRAINER_RECORD).read_text()) if (out / base.TRAINER_RECORD).exists() else {}
    record = {
        "stage": "train",
        "key": key,
        "dataset": {
            "folder": str(plan.config.dataset_dir),
            "version": placed.version.name,
            "rows": placed.manifest.get("rows"),
            "tokens": placed.manifest.get("tokens"),
            "loss_tokens": placed.manifest.get("loss_tokens"),
        },
        "trainer": {
            "name": trainer.name,
            "version": trainer.version,
            "recipe": spec.recipe,
            "method": trainer.recipe(spec.recipe).method,
            "gpus": spec.gpus,
        },
        "target": spec.target,
        "settings": spec.settings,
        "run": trained,
    }
    atomic.write_json(out / layout.TRAINED_RECORD, record)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # a folder without its record: a move that was cut short
        shutil.rmtree(folder)
    os.replace(out, folder)
    atomic.fsync_dir(folder.parent)
    shutil.rmtree(work, ignore_errors=True)
    return record


def _follow(argv: list[str], trainer: base.Trainer) -> tuple[int, str]:
    """Run the trainer, its lines into the job's log and its progress into the job's record; its exit code
    and its last line that says something."""
    log.info("train: %s", " ".join(argv))
    last = ""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            log.info("| %s", line)  # the trainer's own line
            last = line
            if (seen := trainer.progress(line)) is not None:
                running.progress(**seen)
    return proc.returncode, last


def publish(record_path: Path, folder: Path, record: dict[str, Any]) -> None:
    """``dist/NAME-drafter``: a version holding the checkpoint's files (links to the store's), named by its
    manifest, which names the train key; the dataset's drafter in place stays until it is complete."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    with release.publish(release.folder_of(record_path), record_path) as tmp:
        listed = []
        for path in files:
            rel = path.relative_to(folder)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            atomic.link(path, tmp / rel)
            listed.append({"path": str(rel), "sha256": hashing.sha256_file(path)})
        manifest = {
            "stage": "train",
            "key": record["key"],
            "dataset": record["dataset"]["version"],
            "trainer": record["trainer"],
            "files": listed,
        }
        atomic.write_json(tmp / layout.MANIFEST, manifest)
