"""Which options each backend accepts: checked when the config is read, before any job."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_build.engines.base import closest
from dflash_build.keys import ENGINE_OPTIONS
from dflash_build.spec import ConfigError


def check_options(backend: str, options: Mapping[str, Any]) -> None:
    """Refuse an engine option the backend does not know, naming the closest known one (at parse time:
    no engine library is imported, so a typo stops the run before any job). A backend with a check of
    its own (SGLang's, over every ServerArgs field) is checked through :func:`registry.check_options`."""
    known = sorted(ENGINE_OPTIONS.get(backend, {}))
    for name in sorted(options):
        if name not in known:
            raise ConfigError(
                f"engine.options.{name}", f"the {backend} backend has no such option{closest(name, known)}"
            )
