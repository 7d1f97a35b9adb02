"""Why a row does not become a prompt: the reasons (``DROP_*``), which of them the config asked for,
and the counter that keeps a few example locations of each."""

from __future__ import annotations

from collections import Counter, defaultdict

from dflash_build.inputs.drops import (  # what a row's conversion refuses, with the reasons selection adds
    DROP_EMPTY_CONTENT as DROP_EMPTY_CONTENT,
)
from dflash_build.inputs.drops import (
    DROP_INVALID_TOOLS as DROP_INVALID_TOOLS,
)
from dflash_build.inputs.drops import (
    DROP_INVALID_UTF8 as DROP_INVALID_UTF8,
)
from dflash_build.inputs.drops import (
    DROP_MALFORMED as DROP_MALFORMED,
)
from dflash_build.inputs.drops import (
    DROP_MISSING_FIELD as DROP_MISSING_FIELD,
)
from dflash_build.inputs.drops import (
    DROP_NO_USER_TURN as DROP_NO_USER_TURN,
)
from dflash_build.inputs.drops import (
    DROP_NON_STRING_CONTENT as DROP_NON_STRING_CONTENT,
)
from dflash_build.inputs.drops import (
    DROP_TEMPLATE_KWARG as DROP_TEMPLATE_KWARG,
)
from dflash_build.inputs.drops import (
    DROP_TOO_LONG,
    DROP_TOO_SHORT,
)
from dflash_build.inputs.drops import (
    DROP_UNKNOWN_ROLE as DROP_UNKNOWN_ROLE,
)
from dflash_build.inputs.drops import Drop as Drop
from dflash_build.stages.common.filters import DROP_CONTAMINATED, DROP_NEAR_DUPLICATE

DROP_DUPLICATE = "duplicate"
DROP_OVER_MAX_SAMPLES = "over_max_samples"
DROP_LANGUAGE = "language"  # not in the source's languages
DROP_OTHER_VARIANT = "other_variant"  # drawn to another sampling variant of the source (config variants)
DROP_HELD_OUT = "held_out"  # in the eval split (config eval): measured on, never trained on
EXAMPLES_PER_REASON = 5


# Drops the config asked for: they never count towards a source's loss (checks.max_drop_fraction).
INTENDED_DROPS = frozenset(
    {
        DROP_DUPLICATE,
        DROP_OVER_MAX_SAMPLES,
        DROP_TOO_SHORT,
        DROP_TOO_LONG,
        DROP_CONTAMINATED,
        DROP_NEAR_DUPLICATE,
        DROP_LANGUAGE,
        DROP_OTHER_VARIANT,
        DROP_HELD_OUT,
    }
)


# The config key behind each intended drop, for a source those drops empty.
DROP_SETTINGS = {
    DROP_DUPLICATE: "exact copies of other rows",
    DROP_OVER_MAX_SAMPLES: "max_samples",
    DROP_TOO_SHORT: "filters.min_chars",
    DROP_TOO_LONG: "filters.max_chars",
    DROP_CONTAMINATED: "decontaminate.references",
    DROP_NEAR_DUPLICATE: "dedup.near.threshold",
    DROP_LANGUAGE: "languages",
    DROP_OTHER_VARIANT: "variants.*.share",
    DROP_HELD_OUT: "eval.share",
}


class DropCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(f"{location}: {detail}" if detail else location)
