"""Why a row does not become a prompt: the reasons (``DROP_*``), which of them the config asked for,
and the counter that keeps a few example locations of each."""

from __future__ import annotations

from collections import Counter, defaultdict

from dflash_build.stages.filters import DROP_CONTAMINATED, DROP_NEAR_DUPLICATE

DROP_MALFORMED = "malformed_row"
DROP_INVALID_UTF8 = "invalid_utf8"
DROP_NO_USER_TURN = "no_user_turn"
DROP_EMPTY_CONTENT = "empty_content"
DROP_NON_STRING_CONTENT = "non_string_content"
DROP_UNKNOWN_ROLE = "unknown_role"
DROP_MISSING_FIELD = "missing_field"
DROP_INVALID_TOOLS = "invalid_tools"
DROP_TOO_SHORT = "too_short"
DROP_TOO_LONG = "too_long"
DROP_DUPLICATE = "duplicate"
DROP_OVER_MAX_SAMPLES = "over_max_samples"
DROP_TEMPLATE_KWARG = "template_kwarg"  # a value chat_template_kwargs_from has no mapping for
DROP_LANGUAGE = "language"  # not in the source's languages
DROP_OTHER_VARIANT = "other_variant"  # drawn to another sampling variant of the source (config variants)
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
}


class Drop(Exception):
    """A row that cannot become a prompt; ``reason`` is one of the DROP_* constants."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DropCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(f"{location}: {detail}" if detail else location)
