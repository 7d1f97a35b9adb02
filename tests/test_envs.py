"""The conda envs (`--software-deployment-method conda`) cover every import their rules make.

Conda's channels cannot be reached from the test machines, so the envs are never created here. What is
checked instead: each rule's env file lists (or brings, through the requirements of what it lists, read
from the installed packages' metadata) the distribution of every third-party module the rule's code
can import, the package itself included. The code a rule runs is found by reading imports (module and
function level) from ``dflash_build.workflow`` and the rule's stage module through the package.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest
import yaml

from dflash_build.engines import registry
from tests.conftest import REPO

PACKAGE = REPO / "dflash_build"
STAGES = {"prepare": "prepare", "generate": "generate", "tokenize": "tokenize", "mix": "mix", "pack": "pack"}
# A backend's own engine library (SGLang's: sglang, psutil) is imported only where that backend runs, in
# its env; elsewhere its option check reads what its descriptor recorded (sglang_fields).
ENV_ONLY = {m: b.conda_env for b in registry.BACKENDS.values() for m in b.env_only}


def _module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@functools.cache  # each rule's walk reads the same modules
def imports(module: str) -> tuple[set[str], set[str]]:
    """(package modules, third-party top-level names) one module imports anywhere in its code."""
    file = _module_file(module)
    assert file is not None, module
    ours, theirs = set(), set()
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]).strip(".")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] == "dflash_build":
                if _module_file(name) is not None:
                    ours.add(name)
            elif name and name.split(".")[0] not in sys.stdlib_module_names and name != "__future__":
                theirs.add(name.split(".")[0])
    return ours, theirs


def needed(stage: str, skip: set[str]) -> set[str]:
    """Third-party top-level modules the rule of ``stage`` can import (``skip``: modules whose own
    third-party imports do not count)."""
    workflow_top = {
        n.module for n in ast.parse((PACKAGE / "workflow.py").read_text()).body if isinstance(n, ast.ImportFrom)
    }
    todo = [m for m in workflow_top if m and m.startswith("dflash_build")] + [f"dflash_build.stages.{STAGES[stage]}"]
    seen: set[str] = set()
    third: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        ours, theirs = imports(module)
        if module not in skip:
            third |= theirs
        todo += [m for m in ours if m != "dflash_build.workflow"]
    return third


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def covered(env_file: Path) -> set[str]:
    """Distributions an env file installs: what it lists, and what those require, transitively."""
    env = yaml.safe_load(env_file.read_text())
    listed: list[str] = []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            listed += dep.get("pip", [])
        else:
            listed.append(str(dep).split("=")[0])
    names = set()
    for entry in listed:
        if entry.startswith("-e "):
            assert (env_file.parent / entry[3:].strip()).resolve() == REPO, f"{env_file.name}: {entry}"
            names.add("dflash-build")
        else:
            names.add(_requirement_name(entry))
    todo = list(names)
    while todo:  # the requirements of what is installed here (unconditional ones)
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            name = _requirement_name(req)
            if name not in names:
                names.add(name)
                todo.append(name)
    return names


@functools.cache
def _installed() -> dict[str, list[str]]:
    """Top-level module -> distributions, once: each call reads every installed distribution's files."""
    return dict(metadata.packages_distributions())


def distributions(module: str) -> set[str]:
    found = _installed().get(module)
    assert found, f"no installed distribution provides '{module}'"
    return {_norm(d) for d in found}


def _not_in(env: str) -> set[str]:
    return {module for module, its_env in ENV_ONLY.items() if its_env != env}


RULE_ENVS = [
    *((stage, "cpu.yaml", _not_in("cpu")) for stage in ("prepare", "tokenize", "mix", "pack")),
    # generate runs in its backend's env (rules/common.smk's GENERATE_ENV): one row per env a backend names
    *(("generate", f"{env}.yaml", _not_in(env)) for env in sorted({b.conda_env for b in registry.BACKENDS.values()})),
]


@pytest.mark.parametrize(("stage", "env_name", "skip"), RULE_ENVS)
def test_every_import_of_a_rule_is_covered_by_its_env(stage: str, env_name: str, skip: set[str]) -> None:
    have = covered(REPO / "envs" / env_name)
    assert "dflash-build" in have, f"{env_name} does not install the package itself"
    missing = {}
    for module in sorted(needed(stage, skip)):
        dists = distributions(module)
        if not dists & have:
            missing[module] = sorted(dists)
    assert not missing, f"envs/{env_name} (rule {stage}) lacks {missing}"


def test_the_rules_use_these_envs() -> None:
    """The table above is the rules' own: each rule file names its env."""
    for stage, env_name, _ in RULE_ENVS:
        text = (REPO / "rules" / f"{stage}.smk").read_text()
        if stage == "generate":
            assert "GENERATE_ENV" in text
            common = (REPO / "rules" / "common.smk").read_text()
            assert "registry.get(CONFIG.backend).conda_env" in common
            for backend in registry.BACKENDS.values():
                assert (REPO / "envs" / f"{backend.conda_env}.yaml").exists(), backend.name
        else:
            assert f'"../envs/{env_name}"' in text, stage


def test_the_design_document_lists_every_env() -> None:
    """docs/architecture.md's layout names every conda env in envs/ (it omitted vllm.yaml)."""
    design = (REPO / "docs" / "architecture.md").read_text()
    unnamed = [p.name for p in sorted((REPO / "envs").glob("*.yaml")) if f"`{p.name}`" not in design]
    assert not unnamed, unnamed
