"""What a server's log says about its end: the root exception it logged, with the frame it was raised in, and
the exit status its host saw (a job quotes them instead of a log tail)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ERROR_SCAN_BYTES = 1 << 20  # how much of a dead server's log is read for its error
# A Python exception as a server logs it (vLLM prefixes each line with its process and level); the
# wrappers that only point back at the root cause are skipped.
_EXCEPTION = re.compile(r"(?:^|\s)((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_WRAPPERS = ("EngineDeadError", "EngineGenerateError")
_POINTS_BACK = re.compile(r"stack trace (\(?above\)?|above)", re.IGNORECASE)
_PROCESS = re.compile(r"^\([^)]*\)")
# pydantic's "1 validation error for ModelConfig" (vLLM's engine arguments) says what was wrong on its next line
_VALIDATION = re.compile(r"^\d+ validation errors? for \w+$")
DETAIL_CHARS = 300
_EXITED = re.compile(r"the server exited with (-?\d+)")  # the host's own line (engines.host.process)


def tail(log_path: str | Path, since: int = 0, limit: int = ERROR_SCAN_BYTES) -> list[str] | None:
    """A server log's lines after byte ``since``, the last ``limit`` bytes of them at most (where its end
    is: the error, the exit); None for a log that cannot be read."""
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(since, size - limit))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def engine_error(log_path: str | Path, since: int = 0) -> str | None:
    """The root exception a server's log shows after byte ``since``, with the innermost frame its process
    raised it in, or None. A wrapper that points back at it ("see the stack trace above") is skipped."""
    if (lines := tail(log_path, since)) is None:
        return None
    frames: dict[str, str] = {}  # by the process a line is from (vLLM prefixes each with it)
    found = None
    for i, line in enumerate(lines):
        process = _PROCESS.match(line)
        who = process.group(0) if process else ""
        if (where := _FRAME.search(line)) is not None:
            frames[who] = f"{Path(where.group(1)).name}:{where.group(2)} in {where.group(3)}"
            continue
        error = _EXCEPTION.search(line)
        if error is None or error.group(1).endswith(_WRAPPERS) or _POINTS_BACK.search(error.group(2)):
            continue
        frame = frames.get(who)
        message = error.group(2).strip()
        if _VALIDATION.search(message) and i + 1 < len(lines):  # pydantic's detail is on its next line
            message += ": " + lines[i + 1].strip()[:DETAIL_CHARS]
        found = f"{error.group(1).rsplit('.', 1)[-1]}: {message}" + (f" ({frame})" if frame else "")
    return found


def exit_code(log_path: str | Path, since: int = 0) -> int | None:
    """The exit status the host saw its server end with (negative: a signal killed it), or None yet."""
    codes = [int(m.group(1)) for line in tail(log_path, since) or () if (m := _EXITED.search(line))]
    return codes[-1] if codes else None
