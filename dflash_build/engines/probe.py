"""What an engine's interpreter has: the engine's version, torch's and its CUDA's, the GPUs it sees with
their compute capability, and the architectures torch's wheel carries kernels for (``preflight``).

The probe runs in the engine's own interpreter (vLLM's env need not have this package), so it is a
script of the standard library and torch only. :func:`kernels_for` is the rule a GPU runs a wheel by.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

PROBE_SECONDS = 180.0  # importing an engine (vLLM: its kernels, triton) takes tens of seconds on a busy node

_SCRIPT = r"""
import importlib, json, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0]}
try:
    module = importlib.import_module(sys.argv[1])
    out["engine"] = str(getattr(module, "__version__", None) or "unknown")
except Exception as e:
    out["engine_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["arch_list"] = list(torch.cuda.get_arch_list())
        out["gpus"] = [
            {"index": i, "name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i))}
            for i in range(torch.cuda.device_count())
        ]
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
print("PROBE " + json.dumps(out))
"""


@dataclass(frozen=True)
class Probed:
    """One interpreter's answer; ``error``: why there is none (it did not start, or printed no answer)."""

    python: str
    found: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def probe(python: str, package: str, env: dict[str, str] | None = None) -> Probed:
    """Ask ``python`` what it has of ``package`` (the engine), torch and CUDA."""
    try:
        done = subprocess.run(
            [python, "-c", _SCRIPT, package], capture_output=True, text=True, timeout=PROBE_SECONDS, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return Probed(python, error=f"{type(e).__name__}: {e}")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("PROBE "):
            return Probed(python, json.loads(line.removeprefix("PROBE ")))
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return Probed(python, error=f"exit {done.returncode}: {last[:300]}")


_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")


def kernels_for(capability: tuple[int, int], arch_list: list[str]) -> str | None:
    """The entry of a wheel's arch list (torch's ``get_arch_list()``) a GPU of ``capability`` runs, or None.

    CUDA's rule: a binary for ``sm_XY`` runs on a GPU of the same major version and a minor of at least Y;
    an arch-specific one (``sm_90a``, ``sm_120a``) only on exactly that GPU; PTX (``compute_XY``) is compiled
    by the driver for any GPU of XY or later. So an ``sm_120`` wheel has nothing for an ``sm_90`` GPU, and an
    ``sm_90`` wheel nothing for an ``sm_120`` one unless it carries ``compute_90`` PTX (then the GPU runs
    JIT-compiled kernels: slower to start, and never the tuned ones).
    """
    major, minor = capability
    binaries, ptx = [], []
    for entry in arch_list:
        m = _ARCH.fullmatch(entry.strip())
        if m is None:
            continue
        kind, arch_major, arch_minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "sm" and arch_major == major and (arch_minor == minor or (not suffix and arch_minor < minor)):
            binaries.append((arch_minor, entry))
        if kind == "compute" and not suffix and (arch_major, arch_minor) <= (major, minor):
            ptx.append(((arch_major, arch_minor), entry))
    if binaries:
        return max(binaries)[1]  # the closest binary: what the GPU runs
    return max(ptx)[1] if ptx else None
