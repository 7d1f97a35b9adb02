"""uv's options for the indexes, wheel folders and constraints pip is configured with on this machine
(pip.conf, PIP_* variables): uv reads no pip configuration, and a machine's CPU torch may come from a wheel
folder only pip knows, or be capped by a constraints file only pip reads. Printed for the Makefile's
`uv pip install`; pip's own resolution takes the best version over every index, so uv does too
(unsafe-best-match)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_config() -> dict[str, str]:
    """pip's settings of the options uv takes, from its files then its environment (pip's own order)."""
    found: dict[str, str] = {}
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        option = name.split(".", 1)[-1]
        if option in OPTIONS and name.split(".", 1)[0] in ("global", "install"):
            found[option] = value.strip().strip("'\"")
    for option in OPTIONS:
        value = os.environ.get("PIP_" + option.upper().replace("-", "_"))
        if value:
            found[option] = value
    return found


def uv_arguments(config: dict[str, str]) -> list[str]:
    args = ["--index-strategy", "unsafe-best-match"]
    for option, value in config.items():
        for item in value.split():
            args += [OPTIONS[option], item]
    return args


if __name__ == "__main__":
    print(shlex.join(uv_arguments(pip_config())))
