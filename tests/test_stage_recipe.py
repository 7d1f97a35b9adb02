"""Adding a stage is its package, its rule file and its schema section (docs/architecture.md, "Where the
system grows"): a toy stage written into a copy of the workflow, by that recipe alone, is listed by the dry
run where its config section is set, runs, and is absent where it is not."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import Workflow, copy_workflow, parse_dry_run

TOY_INIT = '''"""A toy stage: counts the dataset's rows into logs/toy.json."""

from __future__ import annotations

import json
from typing import Any

from dflash_build.publish import release
from dflash_build.stages.common.job import Job
from dflash_build.store import atomic


def run(job: Job) -> dict[str, Any]:
    manifest = release.in_place(job.published()).manifest
    record = {"stage": "toy", "rows": manifest["rows"], "note": job.plan.config.raw["toy"]["note"]}
    atomic.write_json(job.output("tally"), record)
    return record
'''

TOY_STAGE = '''"""The toy stage's descriptor."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_build.publish import release
from dflash_build.stages.registry import Of, Paths, Stage

if TYPE_CHECKING:
    from dflash_build.plan import Plan
    from dflash_build.spec import Config


def paths(plan: Plan, of: Of) -> tuple[Paths, Paths]:
    cfg = plan.config
    return {"dataset": (release.record_dir(cfg.dataset_dir),)}, {"tally": (cfg.logs / "toy.json",)}


def enabled(config: Config) -> bool:
    return "toy" in config.raw


def targets(plan: Plan) -> list[Path]:
    return [plan.config.logs / "toy.json"]


def params(plan: Plan, of: Of) -> Any:
    return plan.config.raw["toy"]


STAGE = Stage("toy", ("dataset",), ("tally",), "config", 65, paths, enabled, targets, params)
'''

TOY_RULE = """rule toy:
    input:
        dataset=planned_paths("toy", "dataset"),
    output:
        tally=planned_paths("toy", "tally", True)[0],
    params:
        toy=get_params("toy"),
    script:
        "scripts/stage.py"
"""

TOY_SCHEMA = {"type": "object", "additionalProperties": False, "properties": {"note": {"type": "string"}}}


@pytest.mark.workflow
def test_a_stage_added_by_the_recipe_alone_is_planned_and_run(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    code = copy_workflow(tmp_path / "code")
    package = code / "dflash_build" / "stages" / "toy"
    package.mkdir()
    (package / "__init__.py").write_text(TOY_INIT)
    (package / "stage.py").write_text(TOY_STAGE)
    (code / "rules" / "toy.smk").write_text(TOY_RULE)
    schema = yaml.safe_load((code / "config" / "schema.yaml").read_text())
    schema["properties"]["toy"] = TOY_SCHEMA
    (code / "config" / "schema.yaml").write_text(yaml.safe_dump(schema, sort_keys=False))
    copied = Workflow(operated_store[0]).copy_to(tmp_path / "w")
    wf = Workflow(copied.workdir, snakefile=code / "Snakefile", pythonpath=code)

    config = copy.deepcopy(operated_store[1])
    wf.write_config(config)
    assert wf.dry_run() == {}, "without its section the toy stage is not in the build"
    config["toy"] = {"note": "counted"}
    wf.write_config(config)
    assert parse_dry_run(wf.run("-n").stdout) == {"toy": [{}]}, "its section set: the dry run lists it alone"
    wf.build()
    record = json.loads((wf.workdir / "logs" / "toy.json").read_text())
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    assert record == {"stage": "toy", "rows": manifest["rows"], "note": "counted"}
    assert wf.dry_run() == {}, "built: nothing to do"
    config["toy"] = {"note": "again"}
    wf.write_config(config)
    assert set(wf.dry_run()) == {"toy"}, "its params rerun it, and nothing else"
