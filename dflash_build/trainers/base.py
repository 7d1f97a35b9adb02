"""The one interface of a trainer backend: a :class:`Trainer` descriptor, as an engine backend has its own.

A trainer is run as a command in an interpreter of its own (its pinned release and that release's
dependencies, which the project's environment does not share: `make setup` builds one per trainer); the
train stage writes what it asks for into a run file, runs the command, reads its progress from the
trainer's own log lines, and publishes the checkpoint the command leaves in ``out``.
"""

from __future__ import annotations

import difflib
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_build.spec import ConfigError

# what a runner writes beside the checkpoint: at least steps, final_loss and train_seconds (what `plan`
# estimates the next training's GPU-hours from), and the trainer's release
TRAINER_RECORD = "train.json"


@dataclass(frozen=True)
class Setting:
    """One of a recipe's keys: its default, and whether it changes the weights (it enters the train key)
    or only how fast or how verbosely they are reached (it does not)."""

    default: Any
    weights: bool = True
    required: bool = False  # no default the trainer could take: the config must give it


@dataclass(frozen=True)
class Run:
    """One training, as the stage asks for it: the recipe, the target folder, the dataset's row files
    (``input_ids`` and ``loss_mask``), where the checkpoint goes (``out``, which must not exist yet), a
    scratch folder, the settings by section (defaults filled) and the GPUs it may use."""

    recipe: str
    target: Path
    rows: tuple[Path, ...]
    out: Path
    work: Path
    settings: Mapping[str, Mapping[str, Any]]
    gpus: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "target": str(self.target),
            "rows": [str(p) for p in self.rows],
            "out": str(self.out),
            "work": str(self.work),
            "settings": {s: dict(v) for s, v in self.settings.items()},
            "gpus": self.gpus,
        }


@dataclass(frozen=True)
class Recipe:
    """A trainer's recipe: the drafter method an engine serves its checkpoint as (vLLM's speculative
    method), and its settings by section."""

    method: str
    settings: Mapping[str, Mapping[str, Setting]]
    targets: tuple[str, ...] = ()  # the target architectures it trains drafters for (none: any)


@dataclass(frozen=True)
class Trainer:
    """A trainer backend: its name (config `train.trainer`), the package its interpreter must import and the
    pinned release (`train.python`'s check), the venv `make setup` builds with it, its recipes, the command
    that runs one :class:`Run` from its run file, and what a line of its log says of its progress."""

    name: str
    package: str
    version: str
    venv: str
    recipes: Mapping[str, Recipe]
    command: Callable[[str, Path, Run], list[str]]  # (python, run file, run) -> argv
    progress: Callable[[str], dict[str, Any] | None]
    # why it cannot run on this machine's kind (None: it can); a contract test checks its command instead
    runs_here: Callable[[], str | None] = lambda: None
    max_gpus: int | None = None  # the most train.gpus it runs on (0: the CPU only; None: no bound)
    notes: tuple[str, ...] = field(default=())

    def recipe(self, name: str, key: str = "train.recipe") -> Recipe:
        if name not in self.recipes:
            raise ConfigError(key, f"{self.name} has no recipe {name!r}{closest(name, self.recipes)}")
        return self.recipes[name]

    def settings(self, recipe: str, given: Mapping[str, Any], key: str = "train.settings") -> dict[str, dict[str, Any]]:
        """``given`` checked against the recipe's sections and keys (an unknown one is refused with the
        closest name) and completed with the defaults: what the run file holds."""
        sections = self.recipe(recipe).settings
        out: dict[str, dict[str, Any]] = {}
        for section, values in given.items():
            if section not in sections:
                raise ConfigError(
                    f"{key}.{section}",
                    f"{self.name}'s {recipe} recipe has no section {section!r}{closest(section, sections)}",
                )
            if not isinstance(values, Mapping):
                raise ConfigError(f"{key}.{section}", "is a section: give its keys as a mapping")
            for name in values:
                if name not in sections[section]:
                    elsewhere = [f"{other}.{name}" for other in sections if name in sections[other]]
                    hint = f"; did you mean {elsewhere[0]!r}?" if elsewhere else closest(name, sections[section])
                    raise ConfigError(
                        f"{key}.{section}.{name}",
                        f"{self.name} {self.version}'s {recipe} recipe has no key {name!r} in {section}{hint}",
                    )
        for section, known in sections.items():
            values = given.get(section) or {}
            out[section] = {}
            for name, setting in known.items():
                if name in values:
                    out[section][name] = values[name]
                elif setting.required:
                    raise ConfigError(f"{key}.{section}.{name}", f"{self.name}'s {recipe} recipe needs it: set it")
                else:
                    out[section][name] = setting.default
        return out

    def keyed(self, recipe: str, settings: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """The settings that change the weights: what the train key holds of them."""
        sections = self.recipe(recipe).settings
        return {
            section: {k: v for k, v in values.items() if sections[section][k].weights}
            for section, values in settings.items()
        }


def closest(name: str, known: Mapping[str, Any] | tuple[str, ...]) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {near[0]!r}?" if near else f" (it has: {', '.join(sorted(known))})"


def installed_version(python: str, package: str) -> str | None:
    """The version of ``package`` that ``python`` has (None: it has none, or ``python`` does not run)."""
    code = (
        "import importlib.metadata as m, importlib.util as u, sys\n"
        f"spec = u.find_spec({package!r})\n"
        f"print(m.version({package!r}) if spec else '')"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    found = done.stdout.strip()
    return found if done.returncode == 0 and found else None


# A runner's progress line, one per step its trainer logs: "step 12/225 loss 3.2154" (any prefix before it)
_STEP = re.compile(r"\bstep (?P<step>\d+)/(?P<steps>\d+)\b.*?\bloss (?P<loss>[-+0-9.eE]+|nan|inf)")


def progress(line: str) -> dict[str, Any] | None:
    """What a runner's line says of its training's progress (None: nothing)."""
    found = _STEP.search(line)
    if found is None:
        return None
    return {"step": f"{found['step']}/{found['steps']}", "loss": float(found["loss"])}


def runner_command(runner: Path) -> Callable[[str, Path, Run], list[str]]:
    """The command of a trainer whose runner is one process that reads the run file (its trainer starts
    whatever else it needs)."""
    return lambda python, run_file, run: [python, str(runner), str(run_file)]
