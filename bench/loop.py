"""The loop's wall time per step (issue 78): build, train, accept, and the second round, on the toy target,
with a baseline measured in the same run: the same `snakemake accept` again on each unchanged loop, which
must train and measure nothing (an unchanged dataset is never trained on twice).

    make setup && .venv/bin/python bench/loop.py      # about 5 minutes on 2 cores

writes bench/results/loop.json: the seconds of each step of tests/test_loop.py's loop (two datasets built
from one store, a drafter trained on each by NeMo Automodel's recipe on the CPU, each measured by `accept`
on vLLM's CPU server, then the second round on the math-leaning dataset) and of the reruns, with each
rerun's ratio to the first run's train + accept steps. On a node, the train step's share is what grows:
its GPU-hours are `plan`'s estimate from the store's last training.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from tests import conftest  # noqa: E402
from tests.test_loop import LEANS, run_loop  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "loop.json"


def main() -> None:
    conftest._IN_WORKFLOW_TIER["now"] = True  # this runs Snakemake builds, as the workflow tier does
    python = conftest.REPO / ".venv-automodel" / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        run_loop(root, python)
        first = json.loads((root / "loop.json").read_text())
        steps = first["seconds"]
        steps["whole"] = time.monotonic() - started
        again = {}
        for lean in LEANS:
            wf = conftest.Workflow(root / f"work-{lean}")
            t0 = time.monotonic()
            out = wf.run("accept", env_extra={"OMP_NUM_THREADS": "1"})
            again[lean] = time.monotonic() - t0
            assert "Nothing to be done" in out.stdout + out.stderr, out.stdout[-2000:]
    first_loop = (steps["train"] + steps["accept"]) / len(LEANS)  # one dataset's train + accept, first time
    result = {
        "seconds": {k: round(v, 1) for k, v in steps.items()},
        "rerun_seconds": {k: round(v, 1) for k, v in again.items()},
        "rerun_over_first_train_and_accept": {k: round(v / first_loop, 3) for k, v in again.items()},
        "tau": {
            lean: {c: first[lean]["report"]["per_slice"]["trained"]["category"][c]["tau"] for c in LEANS}
            for lean in LEANS
        },
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
