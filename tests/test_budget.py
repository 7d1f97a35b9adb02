"""The suite's budget (tests/budget.py): the tables of docs/development.md read per tier, the report at the
end of a tier, the costliest modules scheduled first, and every workflow module in the budget."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests import budget
from tests.conftest import REPO

DOC = """
| workflow test module | test-seconds |
|---|---|
| tests/test_slow.py | 1,200 |
| tests/test_quick.py | 30 |

| unit test module | test-seconds |
|---|---|
| tests/test_slow.py | 4 |
"""


def test_each_tiers_table_is_read_apart(tmp_path: Path) -> None:
    doc = tmp_path / "development.md"
    doc.write_text(DOC)
    assert budget.budget("workflow", doc) == {"tests/test_slow.py": 1200.0, "tests/test_quick.py": 30.0}
    assert budget.budget("unit", doc) == {"tests/test_slow.py": 4.0}
    assert budget.budget("engine-pin", doc) == {}


def test_the_report_gives_the_total_against_the_budget_the_waits_and_what_grew_most() -> None:
    modules = {"tests/test_slow.py": 1000.0, "tests/test_quick.py": 90.0, "tests/test_new.py": 40.0}
    planned = {"tests/test_slow.py": 1200.0, "tests/test_quick.py": 30.0}
    lines = budget.report_lines("workflow", modules, planned, 600.0, {"gw0": 580.0, "gw1": 550.0}, {"accept": 12.0})
    assert lines[0].startswith("budget (workflow tier): 1,130 test-seconds in 600 s of wall on 2 workers (94% busy)")
    assert lines[0].endswith("the budget of docs/development.md for these modules: 1,230")
    assert "waiting for a shared fixture another worker built: accept 12 s" in lines[1]
    grown = [line.strip() for line in lines[2:]]
    assert grown == [
        "tests/test_quick.py: 90 s (+60 s on 30)",
        "tests/test_new.py: 40 s (new: not in the budget)",
        "tests/test_slow.py: 1,000 s (-200 s on 1,200)",
    ]


def test_the_costliest_modules_run_first_each_module_kept_in_order(monkeypatch: Any) -> None:
    monkeypatch.setattr(budget, "budget", lambda tier: {"tests/b.py": 500.0, "tests/a.py": 10.0})
    names = ["tests/a.py::one", "tests/a.py::two", "tests/b.py::one", "tests/c.py::one", "tests/b.py::two"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    config = SimpleNamespace(option=SimpleNamespace(markexpr="workflow and not engine_pin"))
    budget.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    # c.py is not in the budget: it counts as UNBUDGETED (60 s), between the two
    assert [i.nodeid for i in items] == [
        "tests/b.py::one",
        "tests/b.py::two",
        "tests/c.py::one",
        "tests/a.py::one",
        "tests/a.py::two",
    ]


def test_every_workflow_module_has_a_line_in_the_budget() -> None:
    """A new workflow module adds its measured cost to docs/development.md's table (python -m tests.budget)."""
    listed = budget.budget("workflow")
    marked = re.compile(r"pytest\.mark\.workflow\b")
    modules = {
        f"tests/{p.name}"
        for p in sorted((REPO / "tests").glob("test_*.py"))
        if marked.search(p.read_text()) and "pytest.mark.engine_pin" not in p.read_text()
    }
    assert modules - listed.keys() == set(), "workflow modules missing from docs/development.md's budget table"
