"""The suite's budget (a pytest plugin, loaded by conftest): what each test module cost in this run against
the table of docs/development.md (its last clean-clone run), printed at the end of the tier, and written
to .test-times/TIER.json for the next table (``python -m tests.budget``).

A report, not a timed test: a slow machine fails nothing here. With pytest-xdist the controller sees every
worker's reports, so the figures are the whole tier's; the workers' busy share shows a worker left waiting
(on a fixture another worker builds, say)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
BUDGET_DOC = REPO / "docs" / "development.md"
TIMES = REPO / ".test-times"
# The budget tables: a header row names the tier (| workflow test module | test-seconds |), then a row a
# module: | tests/test_x.py | 123 |
_HEADER = re.compile(r"^\| (\S+) test module \| test-seconds")
_ROW = re.compile(r"^\| (tests/[\w/]+\.py) \| ([\d,]+) \|")
GREW_MOST = 5


def budget(tier_name: str, doc: Path = BUDGET_DOC) -> dict[str, float]:
    """Test-seconds per module of ``tier_name`` from the budget tables of ``doc``."""
    found, current = {}, None
    for line in doc.read_text().splitlines() if doc.exists() else ():
        if header := _HEADER.match(line):
            current = header.group(1)
        elif (row := _ROW.match(line)) and current == tier_name:
            found[row.group(1)] = float(row.group(2).replace(",", ""))
    return found


def tier(config: pytest.Config) -> str:
    expr = (config.option.markexpr or "").strip()
    known = {"workflow and not engine_pin": "workflow", "not workflow": "unit", "engine_pin": "engine-pin"}
    return known.get(expr, expr.replace(" ", "-") or "all")


class Budget:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.by_test: dict[str, float] = defaultdict(float)
        self.busy: dict[str, float] = defaultdict(float)
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.by_test[report.nodeid] += report.duration
        node = getattr(report, "node", None)  # xdist: the worker that ran it
        worker = getattr(getattr(node, "gateway", None), "id", "main")
        self.busy[worker] += report.duration

    def by_module(self) -> dict[str, float]:
        modules: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.by_test.items():
            modules[nodeid.split("::", 1)[0]] += seconds
        return dict(modules)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.by_test:
            return
        wall = time.monotonic() - self.started
        name = tier(self.config)
        modules = self.by_module()
        TIMES.mkdir(exist_ok=True)
        waits = self.waits()
        record = {"tier": name, "wall": round(wall, 1), "workers": dict(self.busy), "modules": modules,
                  "tests": dict(self.by_test), "waited": waits}  # fmt: skip
        (TIMES / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
        for line in report_lines(name, modules, budget(name), wall, dict(self.busy), waits):
            terminalreporter.write_line(line)

    def waits(self) -> dict[str, float]:
        """Seconds workers waited for a shared fixture another worker built (conftest.once_per_session)."""
        from tests.conftest import WAITS

        path = self.config._tmp_path_factory.getbasetemp() / "once" / WAITS  # type: ignore[attr-defined]
        waited: dict[str, float] = defaultdict(float)
        for line in path.read_text().splitlines() if path.exists() else ():
            entry = json.loads(line)
            waited[entry["fixture"]] += entry["waited"]
        return dict(waited)


def report_lines(
    name: str,
    modules: dict[str, float],
    planned: dict[str, float],
    wall: float,
    busy: dict[str, float],
    waits: dict[str, float],
) -> list[str]:
    """What the end of a tier prints: its test-seconds against the budget, the workers' busy share and the
    modules that grew most since the budget's run."""
    total = sum(modules.values())
    budgeted = sum(planned.get(m, 0.0) for m in modules)
    share = total / (wall * max(len(busy), 1)) if wall else 0.0
    lines = [
        f"budget ({name} tier): {total:,.0f} test-seconds in {wall:,.0f} s of wall on {len(busy)} workers "
        f"({share:.0%} busy); the budget of docs/development.md for these modules: {budgeted:,.0f}"
    ]
    if waits:
        each = ", ".join(f"{k} {v:,.0f} s" for k, v in sorted(waits.items(), key=lambda kv: -kv[1]))
        lines.append(f"  of which waiting for a shared fixture another worker built: {each}")
    grown = sorted(modules, key=lambda m: modules[m] - planned.get(m, 0.0), reverse=True)[:GREW_MOST]
    for module in grown:
        before = planned.get(module)
        since = "new: not in the budget" if before is None else f"{modules[module] - before:+,.0f} s on {before:,.0f}"
        lines.append(f"  {module}: {modules[module]:,.0f} s ({since})")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) reports; workers run
        config.pluginmanager.register(Budget(config), "dflash-build-budget")


# A module the budget does not list yet (new): scheduled as if it cost this much
UNBUDGETED = 60.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The costliest modules of the budget first (each module's tests stay together and in order): with
    ``--dist loadfile`` a worker takes a whole module, so the longest start first and none is left to run alone
    at the end (the longest-processing-time rule). Every worker collects in this same order."""
    planned = budget(tier(config))
    if planned:
        items.sort(key=lambda item: -planned.get(item.nodeid.split("::", 1)[0], UNBUDGETED))


def table(tier_name: str = "workflow") -> str:
    """The budget table of ``tier_name`` from its last run (.test-times/TIER.json), slowest first."""
    modules = json.loads((TIMES / f"{tier_name}.json").read_text())["modules"]
    rows = [f"| {m} | {s:,.0f} |" for m, s in sorted(modules.items(), key=lambda kv: -kv[1])]
    return "\n".join([f"| {tier_name} test module | test-seconds |", "|---|---|", *rows])


if __name__ == "__main__":
    print(table(*sys.argv[1:]))
