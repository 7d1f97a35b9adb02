"""The fault soak (bench/soak.py) in the workflow tier: a short seeded schedule of faults over one build
with shared engines on two fake GPUs ends with every invariant holding, and the same schedule with a
planted defect (a journal that loses its last row on resume) is caught: the soak fails when an
invariant breaks. The long soak (100 faults) runs on demand: docs/operations.md gives its figures."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench import soak_state
from bench.soak import FAULTS, LEAVES_A_JOURNAL, InvariantBroken, Soak
from tests.conftest import own_ports

pytestmark = pytest.mark.workflow

# a journal that loses its last row: what resuming from it must never cost (that row generated again)
LOSES_ITS_LAST_ROW = """
from dflash_build.store import journal

_load = journal.Journal.load


def load(self):
    return _load(self)[:-1]


journal.Journal.load = load
"""


def schedule(seed: int, faults: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(FAULTS) for _ in range(faults)]


SEED, FAULT_COUNT = 7, 5


def test_a_short_soak_holds_every_invariant(tmp_path: Path, tiny_model: Path) -> None:
    figures = Soak(tmp_path, tiny_model, SEED, FAULT_COUNT, sources=2, prompts=12, base_port=own_ports()).run()
    assert figures["problems"] == [] and figures["rows_lost"] == 0
    assert sum(figures["faults_injected"].values()) == FAULT_COUNT == figures["faults_survived"]
    assert figures["rows_generated_again"] is not None
    assert 0 <= figures["rows_generated_again"] <= figures["rows_in_flight_at_faults"], figures


def test_the_soak_fails_on_a_journal_that_loses_its_last_row(tmp_path: Path, tiny_model: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(LOSES_ITS_LAST_ROW)
    # its first fault stops a job with journaled rows: the one fault the defect needs (the schedule's own
    # precondition, not the soak's behaviour)
    assert schedule(SEED, 1)[0] in LEAVES_A_JOURNAL
    soak = Soak(tmp_path / "soak", tiny_model, SEED, 1, sources=2, prompts=12, base_port=own_ports())
    soak.pythonpath = planted
    with pytest.raises(InvariantBroken, match="finished rows were generated again"):
        soak.run()


# vLLM 0.32.0's lines with enable_log_requests, as its server wrote them in the soak on vLLM
VLLM_LOG = """\
(APIServer pid=18227) INFO 12-05 21:39:04 [async_llm.py:578] Added request cmpl-a1a801caa1bc9dc3-0-9b64f6cf.
(APIServer pid=18227) INFO 12-05 21:39:04 [async_llm.py:578] Added request cmpl-87e2eb4181b6d0a0-0-a4d703e6.
(APIServer pid=26187) INFO 12-05 21:48:02 [async_llm.py:578] Added request cmpl-98ab2ed354ba402d-0-acfbc756.
(APIServer pid=26187) INFO 12-05 21:48:03 [async_llm.py:922] Aborted request(s) cmpl-98ab2ed354ba402d-0-acfbc756.
(APIServer pid=26187) INFO 12-05 21:48:03 [async_llm.py:783] Request cmpl-98ab2ed354ba402d-0 aborted.
"""


def test_the_soak_counts_what_each_engine_answered_from_its_log(tmp_path: Path) -> None:
    """Our transformers server logs what it answered per batch; vLLM each request it took and each its client
    gave up on (two lines, counted once): three taken, one aborted (its job was killed) is two answered."""
    engines = tmp_path / "engines"
    engines.mkdir()
    assert soak_state.answered(tmp_path) is None, "no engine log: nothing to count"
    (engines / "gpu-0.log").write_text(VLLM_LOG)
    assert soak_state.answered(tmp_path) == 2
    (engines / "gpu-0.log").write_text(
        "2026-12-05 11:31:02,118 INFO __main__: answered 4 requests (52 output tokens)\n"
        "2026-12-05 11:31:03,240 INFO __main__: answered 3 requests (40 output tokens)\n"
    )
    assert soak_state.answered(tmp_path) == 7
