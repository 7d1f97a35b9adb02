"""The package's shape: no import cycle (imports inside functions included), two floors inside stages/
with no arrow up and no two-way tie, short functions, and one module that builds store paths."""

from __future__ import annotations

import ast
import itertools
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from dflash_build.stages import registry as stage_registry
from tests.conftest import REPO

PACKAGE = REPO / "dflash_build"
MAX_FUNCTION_LINES = 60


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees() -> dict[str, ast.Module]:
    return {_module(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports, wherever the import statement is."""
    trees = _trees()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_build"):
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{node.module}.{alias.name}"
                    graph[module].add(sub if sub in trees else node.module)
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names if a.name.startswith("dflash_build")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "dflash_build.spec" in graph["dflash_build.config"]  # the graph is read at all
    assert _cycle(graph) is None, " → ".join(_cycle(graph) or [])


def _unit(module: str) -> str:
    """The first-level unit a module belongs to: a subpackage or a top-level module of dflash_build."""
    return module.split(".")[1] if "." in module else module


def test_first_level_units_form_layers() -> None:
    """Subpackages and top-level modules, as units, import one another without a cycle: spec (the
    settings types) imports nothing of the package; config and plan import no stage; stages import
    them, never the reverse."""
    graph = import_graph()
    units: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        units[_unit(module)] |= {_unit(m) for m in imported if _unit(m) != _unit(module)}
    assert _cycle(units) is None, " → ".join(_cycle(units) or [])
    assert units["spec"] <= set(), units["spec"]
    assert "stages" not in units["config"] | units["plan"] | units["spec"]


def test_the_commands_read_acceptance_measurements_without_the_stage() -> None:
    """`plan`, `gc` and `verify` read the measurements through :mod:`dflash_build.measurements`, which
    imports no stage: the accept stage measures, it is no library of the commands."""
    graph = import_graph()
    readers = [m for m in graph if m.startswith("dflash_build.ops.") or m == "dflash_build.cli"]
    assert "dflash_build.measurements" in graph["dflash_build.ops.gc"]  # the graph is read at all
    importers = [m for m in readers if any(i.startswith("dflash_build.stages.accept") for i in graph[m])]
    assert not importers, importers
    assert not {i for i in graph["dflash_build.measurements"] if i.startswith("dflash_build.stages")}


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_function_reaches_sixty_lines() -> None:
    long = [
        f"{module}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for module, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 >= MAX_FUNCTION_LINES
    ]
    assert not long, long


MAX_MODULE_LINES = 600
STAGES = tuple(s.name for s in stage_registry.stages())


def test_no_module_reaches_six_hundred_lines() -> None:
    """Every module of the package and the benchmarks, but the ones generated from an engine's code."""
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted([*PACKAGE.rglob("*.py"), *(REPO / "bench").rglob("*.py")])
        if "do not edit" not in p.read_text()[:300] and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_every_stage_runs_one_job() -> None:
    """One contract: every stage's ``run`` takes one Job and returns its record."""
    import importlib
    import inspect

    for stage in STAGES:
        run = importlib.import_module(f"dflash_build.stages.{stage}").run
        params = list(inspect.signature(run).parameters.values())
        assert [(p.name, p.annotation) for p in params] == [("job", "Job")], (stage, params)
        assert inspect.signature(run).return_annotation == "dict[str, Any]", stage


def _declared(rule_text: str, section: str) -> set[str]:
    """The names a rule gives its inputs or outputs (``name=...``); a positional one reads as ''."""
    body = re.search(rf"^(\s+){section}:\n((?:\1\s+.*\n)+)", rule_text, re.MULTILINE)
    assert body is not None, section
    indent = len(body.group(1)) + 4
    items = [line for line in body.group(2).splitlines() if len(line) - len(line.lstrip()) == indent]
    items = [line.strip() for line in items if not line.strip().startswith(("#", ")", "]", "}"))]
    return {m.group(1) if (m := re.match(r"(\w+)=", line)) else "" for line in items}


def test_every_rule_declares_the_names_its_stage_reads() -> None:
    """The rules name each input and output as the stage's Job reads them (its descriptor's)."""
    for stage in STAGES:
        text = (REPO / "rules" / f"{stage}.smk").read_text()
        assert '"scripts/stage.py"' in text or f'"scripts/{stage}.py"' in text, stage  # the stage its rule names
        declared = stage_registry.get(stage)
        assert _declared(text, "input") <= set(declared.inputs), (stage, _declared(text, "input"))
        assert _declared(text, "output") <= set(declared.outputs), (stage, _declared(text, "output"))
    assert _declared("rule r:\n    input:\n        a=1,\n        [b],\n    output:\n        c\n", "input") == {"a", ""}


# -- one owner of store paths ------------------------------------------------------------------
# What building a store path by hand looks like: a store file's name, a stage folder as a path
# segment, or a shard's file name from its name. dflash_build/store/layout.py alone may write these.
STORE_NAMES = (".stats.json", "manifest.json", "bands.parquet", "rows.jsonl", "rows.sqlite", "published.", ".cache")
STORE_FILES = ("rebuild.lock", "fingerprints.json")
STORE_SEGMENTS = ("prompts", "completions", "tokens", "journal", "configs", "index", ".cache")
RULE_PATTERNS = re.compile(r"/(prompts|completions|tokens|journal)/|\.stats\.json|manifest\.json|\{shard\}\.")


def _docstrings(tree: ast.Module) -> set[int]:
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _built_paths(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of every store path this module builds by hand."""
    found = []
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if (
                node.value in STORE_FILES
                or any(name in node.value for name in STORE_NAMES)
                or any(f"/{s}/" in node.value for s in STORE_SEGMENTS)
            ):
                found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = node.right
            if isinstance(right, ast.Constant) and right.value in STORE_SEGMENTS:
                found.append((node.lineno, f"/ {right.value!r}"))
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for value, after in itertools.pairwise(parts):
                named = isinstance(value, ast.FormattedValue) and "shard" in ast.unparse(value.value)
                if named and isinstance(after, ast.Constant) and str(after.value).startswith("."):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_store_paths_are_built_only_by_the_layout_module() -> None:
    built = [
        f"{path.relative_to(REPO)}:{line} {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "layout.py"
        for line, what in _built_paths(ast.parse(path.read_text(), str(path)))
    ]
    rules = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk")), *sorted(REPO.glob("rules/scripts/*.py"))]
    built += [
        f"{path.relative_to(REPO)}:{i} {line.strip()}"
        for path in rules
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if RULE_PATTERNS.search(line) and not line.lstrip().startswith("#")
    ]
    assert not built, "store paths built outside dflash_build/store/layout.py:\n" + "\n".join(built)


def test_the_path_finder_finds_hand_built_paths() -> None:
    code = """
def f(store, shard, folder):
    a = store / "completions" / "s"
    b = folder / f"{shard}.parquet"
    c = folder.with_name("x.stats.json")
    return a, b, c
"""
    assert [line for line, _ in _built_paths(ast.parse(code))] == [3, 4, 5]


def test_a_dry_run_is_told_from_snakemakes_command_line() -> None:
    from dflash_build.workflow import is_dry_run

    for argv in (["-n"], ["--dry-run"], ["--dryrun"], ["-np"], ["--cores", "2", "-pn"]):
        assert is_dry_run(["snakemake", *argv]), argv
    for argv in ([], ["--cores", "2"], ["-p"], ["--configfile", "-n.yaml"], ["--rerun-incomplete"]):
        assert not is_dry_run(["snakemake", *argv]), argv


# -- one list of backends ------------------------------------------------------------------------
def test_the_registry_is_the_one_list_of_backends() -> None:
    """The schema's enum, the key contract's option decisions and every descriptor agree; a backend that
    only runs served can be served, and a shared engine needs one a host can run."""
    import yaml

    from dflash_build.engines import registry

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    enum = schema["properties"]["engine"]["properties"]["backend"]["enum"]
    assert set(enum) == set(registry.BACKENDS)
    for name, backend in registry.BACKENDS.items():
        assert backend.name == name and (backend.load is not None or backend.serve is not None), name
        assert not backend.always_through_server or backend.serve is not None, name
    # the docs name the same backends: configuration.md's engine.backend row, the schema's engine.shared text
    [row] = [li for li in (REPO / "docs" / "configuration.md").read_text().splitlines() if "| `engine.backend` |" in li]
    assert set(re.findall(r"`(\w+)`", row.split("|")[3])) == set(registry.BACKENDS), row
    shared = schema["properties"]["engine"]["properties"]["shared"]["description"]
    servable = {name for name, b in registry.BACKENDS.items() if b.serve is not None}
    assert {name for name in registry.BACKENDS if re.search(rf"\b{name}\b", shared)} == servable, shared


def test_the_package_imports_its_modules_at_the_top() -> None:
    """Inside a function only where the module pulls an optional heavy engine library (torch, SGLang,
    httpx): the backends' descriptors, so parsing the workflow never needs one."""
    inside = []
    for module, tree in _trees().items():
        if module.startswith("dflash_build.engines.backends."):
            continue
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_build"):
                        inside.append(f"{module}:{node.lineno} {node.module}")
                    elif isinstance(node, ast.Import) and any(a.name.startswith("dflash_build") for a in node.names):
                        inside.append(f"{module}:{node.lineno}")
    assert not inside, inside


def test_cpu_stages_import_no_engine() -> None:
    """A prepare, tokenize, mix, pack or export job loads no engine, GPU driver or engine library: only
    the backends' descriptors, which the config's validation reads."""
    import subprocess
    import sys

    engine_code = (
        "dflash_build.stages.generate",
        "dflash_build.engines.host",
        "dflash_build.engines.transformers_backend",
        "dflash_build.engines.sglang_backend",
        "dflash_build.engines.openai_backend",
        "torch",
        "sglang",
        "httpx",
    )
    for stage in ("prepare", "tokenize", "mix", "pack", "export"):
        code = f"import sys, dflash_build.stages.{stage}; print(sorted(m for m in sys.modules if m in {engine_code!r}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "[]", (stage, out)


def test_a_job_imports_its_own_stage_only() -> None:
    """What rules/scripts/stage.py does before the work: the rule's stage found and its descriptor read
    import that stage's package and no other (the others cost a job 0.03 CPU-s, measured)."""
    import json
    import subprocess
    import sys

    for rule, stage in (("tokenize", "tokenize"), ("prepare_code", "prepare"), ("size_pilot", "size")):
        code = (
            "import json, sys, dflash_build.workflow; from dflash_build.stages import registry;"
            f"registry.get(registry.of_rule({rule!r})).inputs;"
            "print(json.dumps(sorted({m.split('.')[2] for m in sys.modules if m.startswith('dflash_build.stages.')})))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert json.loads(out) == sorted({"common", "registry", stage}), rule


def test_the_design_of_record_names_the_finish_reasons_the_records_have() -> None:
    from dflash_build.store import records

    text = (REPO / "docs" / "architecture.md").read_text()
    listed = re.search(r"`finish_reason` \(((?:`\w+`/?)+)\)", text)
    assert listed is not None
    assert sorted(listed.group(1).replace("`", "").split("/")) == sorted(records.FINISH_REASONS)


def test_the_design_of_record_names_every_extension_point_by_the_module_that_owns_it() -> None:
    """docs/architecture.md's "Where the system grows" names each owner; each exists and registers."""
    from dflash_build import inputs
    from dflash_build.engines import registry
    from dflash_build.stages.export import formats

    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Where the system grows") :]
    for owner in ("dflash_build/engines/backends/", "dflash_build/inputs/", "dflash_build/stages/export/"):
        assert owner in section and (REPO / owner).is_dir(), owner
    assert "dflash_build/stages/NAME/stage.py" in section and "tests/test_stage_recipe.py" in section
    assert registry.BACKENDS and inputs.FORMATS and formats.FORMATS


def _literals(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_layer_names_a_backend_or_compares_an_exports_name() -> None:
    """keys.py names no backend (each backend's descriptor decides its options), and no module outside the
    exports compares a value with an export's name (each export's descriptor says what it needs)."""
    from dflash_build.engines import registry
    from dflash_build.stages.export import formats

    keys = ast.parse((PACKAGE / "keys.py").read_text())
    assert not [v for _, v in _literals(keys) if v in registry.BACKENDS], "keys.py names a backend"
    compared = []
    for path in PACKAGE.rglob("*.py"):
        if "stages/export" in path.as_posix():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                compared += [(path.name, n, v) for n, v in _literals(node) if v in formats.FORMATS]
    assert not compared, compared


# -- the floors inside stages/ ---------------------------------------------------------------------
STAGES_PACKAGE = "dflash_build.stages"
LOWER_FLOOR = ("registry", "common")  # the descriptor type and discovery; what the stages share
# The one way a stage imports another (importer, imported): the modules it may import there, and why. Each
# runs one way: the mix's target rule, which the sizing follows, is common/targets (below both), so size
# imports no mix and the mix's descriptor alone reads the sizing.
SEAMS: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("generate", "prepared"): (frozenset({"prepared.stage"}), "its descriptor's gate input: the prepared record"),
    ("preflight", "prepared"): (frozenset({"prepared.stage"}), "its descriptor's input: the prepared record"),
    ("mix", "size"): (frozenset({"size"}), "its descriptor reads the shards the sizing names (as_needed)"),
    ("mix", "prepare"): (frozenset({"prepare.drops"}), "the drop reason of a prompt another variant kept"),
    ("accept", "evalset"): (frozenset({"evalset"}), "the eval split it measures: its slices, schema, reader"),
    ("accept", "generate"): (frozenset({"generate.work"}), "a row's seed, as generate draws it"),
    ("preflight", "generate"): (
        frozenset({"generate", "generate.work", "generate.gate"}),
        "the pilot runs generate's steps on a shard; parity compares its identity",
    ),
}


def _stage_unit(module: str) -> str | None:
    """The unit of stages/ a module belongs to (``registry``, ``common``, or a stage's package name); None
    for a module outside stages/ and for the stages package itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and module.startswith(f"{STAGES_PACKAGE}.") else None


def _stage_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], set[str]]:
    """(importing unit, imported unit) → the imported modules (relative to stages/), between two units."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, imported in graph.items():
        for target in imported:
            a, b = _stage_unit(module), _stage_unit(target)
            if a is not None and b is not None and a != b:
                edges[(a, b)].add(target.removeprefix(f"{STAGES_PACKAGE}."))
    return edges


def _stage_floors(graph: dict[str, set[str]]) -> tuple[list[str], list[str], list[str]]:
    """(arrows up, stage imports past a seam, two-way ties) inside stages/.

    Two floors: the lower one is the registry (the descriptor type and the discovery, which finds each
    descriptor by package name at run time) and ``common`` (what the stages share); each stage package
    sits above them. An arrow *up* is an import, at the top or inside a function, from a module of the
    lower floor to a module of a stage package: a descriptor may import the registry for ``Stage`` only
    because the registry imports no stage. A stage imports another stage only through a seam of
    :data:`SEAMS` (its importer, the stage it imports, the modules it may import there). A *two-way tie*:
    two units of stages/ (the registry, ``common``, each stage package) that each import the other."""
    edges = _stage_edges(graph)
    up = [
        f"{a} -> {m}"
        for (a, b), ms in sorted(edges.items())
        if a in LOWER_FLOOR and b not in LOWER_FLOOR
        for m in sorted(ms)
    ]
    past = [
        f"{a} -> {m}"
        for (a, b), ms in sorted(edges.items())
        if a not in LOWER_FLOOR and b not in LOWER_FLOOR
        for m in sorted(ms - SEAMS.get((a, b), (frozenset(), ""))[0])
    ]
    ties = [f"{a} <-> {b}" for (a, b) in sorted(edges) if a < b and (b, a) in edges]
    return up, past, ties


def test_no_arrow_points_up_inside_stages_and_no_two_units_are_tied_both_ways() -> None:
    """The registry holds the descriptor type and the discovery and imports no stage; every stage imports
    it and ``common`` from below, another stage only through a named seam, and no two units of stages/
    import each other. Every seam is used, and a planted arrow up, import past a seam and tie are found."""
    graph = import_graph()
    edges = _stage_edges(graph)
    assert ("mix", "registry") in edges and ("registry", "common") in edges  # the graph is read at all
    assert _stage_floors(graph) == ([], [], [])
    unused = [seam for seam, (modules, _) in SEAMS.items() if not modules <= edges.get(seam, set())]
    assert not unused, f"seams no stage uses any more: {unused}"
    planted = {
        "dflash_build.stages.registry": {"dflash_build.stages.mix"},
        "dflash_build.stages.common.chat": {"dflash_build.stages.tokenize"},
        "dflash_build.stages.mix": {"dflash_build.stages.registry", "dflash_build.stages.pack"},
        "dflash_build.stages.size": {"dflash_build.stages.mix.checks"},
        "dflash_build.stages.tokenize": {"dflash_build.stages.common.chat"},
    }
    up, past, ties = _stage_floors(planted)
    assert up == ["common -> tokenize", "registry -> mix"], up
    assert past == ["mix -> pack", "size -> mix.checks"], past
    assert ties == ["common <-> tokenize", "mix <-> registry"], ties


def _private_reads(trees: dict[str, ast.Module]) -> list[str]:
    """Where ops/ or the cli read a private name of stages/: imported, or an attribute of a module it
    imported from there."""
    found = []
    for module, tree in trees.items():
        if not (module.startswith("dflash_build.ops.") or module == "dflash_build.cli"):
            continue
        bound: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(STAGES_PACKAGE):
                private = [a.name for a in node.names if a.name.startswith("_")]
                found += [f"{module}:{node.lineno} from {node.module} import {n}" for n in private]
                bound |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            if node.value.id in bound and node.attr.startswith("_"):
                found.append(f"{module}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_the_commands_read_no_private_name_of_a_stage() -> None:
    """ops/ and the cli call a stage's public entry points (prepare's select, generate's reuse, the
    sizing, the mix's choice) from the stage itself, so a change inside it is made there once; a planted
    private read is found."""
    trees = _trees()
    assert not _private_reads(trees), _private_reads(trees)
    planted = {
        "dflash_build.ops.planted": ast.parse(
            "from dflash_build.stages.mix import _Choice\n"
            "from dflash_build.stages import registry as stages, size\n"
            "stages._private\nsize._round\nsize.replay\n"
        )
    }
    assert len(_private_reads(planted)) == 3, _private_reads(planted)
